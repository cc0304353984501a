"""What the Trainer route refuses, it refuses on every rank of the job (:func:`fpdt.hf.errors.refuse_on_every_rank`).

With data parallelism (world = dp x sp) each sequence-parallel group trains on windows of its
own. A window one group refuses (positions that jump, left padding, a length the layout cannot
cut) must stop the other groups too: had only the refusing group raised, the others would
wait forever in their next collective (ZeRO-3's parameter all-gathers). Here every rank runs
under :func:`tests.distributed.run_distributed`'s timeout and asserts that it raised, so a
missing collective refusal fails (a fine rank reports "DID NOT RAISE", or the run times out)
rather than hanging.
"""

from __future__ import annotations

import re

import pytest
import torch

from tests.distributed import run_distributed

SP, CHUNKS, S = 2, 2, 32
VOCAB = 128          # below the test models' vocabulary


def _window(case: str, S: int = S) -> dict[str, torch.Tensor]:
    """One window ``[1, S]``: ids, positions, shift_labels and a mask, fine or broken as ``case`` says."""
    g = torch.Generator().manual_seed(S)
    ids = torch.randint(0, VOCAB, (1, S), generator=g)
    positions = torch.arange(S)[None]
    labels = torch.nn.functional.pad(ids, (0, 1), value=-100)[:, 1:].clone()
    mask = torch.ones_like(ids)
    if case == "jumping":                      # positions neither +1 nor restarting at 0
        positions = positions * 2
    elif case == "left_padding":
        mask[:, :3] = 0
        labels[:, :3] = -100
    elif case == "right_padding":              # fine: the padding's targets are -100
        mask[:, -5:] = 0
        labels[:, -5:] = -100
    return {"input_ids": ids, "position_ids": positions, "labels": labels, "attention_mask": mask}


def _slice(window: dict[str, torch.Tensor], sp_rank: int) -> dict[str, torch.Tensor]:
    """DeepSpeed's data adapter: rank ``r`` of the SP group holds tokens ``[r S / P, (r + 1) S / P)``."""
    n = window["input_ids"].shape[-1] // SP
    return {k: v[:, sp_rank * n:(sp_rank + 1) * n] for k, v in window.items()}


REFUSALS = {   # replica 1's case -> what its own ranks say; replica 0's ranks name ranks 2, 3 and say it too
    "jumping": r"step from 0 to 2 .*restart at 0 where a packed document starts",
    "left_padding": r"not right padding .*padding_side='right'",
    "length": r"a window of 10 tokens is not a multiple of sp\*num_chunks=2\*2=4: .*FlatteningCollator",
}


def _dp2_sp2(rank, world):
    import torch.distributed as dist

    from fpdt.hf import FPDTHFError
    from fpdt.hf.trainer import contiguous_to_fpdt_layout
    from fpdt.layout.fpdt_layout import shard

    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]      # as DeepSpeed builds them: every rank, in order
    replica, sp_rank = rank // SP, rank % SP
    group = groups[replica]

    def layout(window):
        x = _slice(window, sp_rank)
        return contiguous_to_fpdt_layout(x["input_ids"], x["position_ids"], x["labels"], x["attention_mask"],
                                         group=group, job_group=None, sp=SP, rank=sp_rank, num_chunks=CHUNKS)

    # replica 0 fine, replica 1 refused: all four ranks raise, the fine ones naming ranks 2, 3 and the fix
    for case, fix in REFUSALS.items():
        window = _window("fine") if replica == 0 else (_window("fine", 10) if case == "length" else _window(case))
        with pytest.raises(FPDTHFError) as raised:
            layout(window)
        message = str(raised.value)
        if replica == 0:
            assert message.startswith("ranks 2, 3 of 4 refused this step's inputs"), message
        else:
            assert "[refused on ranks 2, 3 of 4, every rank stops]" in message, message
        assert re.search(fix, message), (case, message)
    # both replicas refuse, for different reasons: each rank says its own, then the other's
    with pytest.raises(FPDTHFError) as raised:
        layout(_window("left_padding" if replica == 0 else "jumping"))
    own, other = (("the attention_mask is not right padding", "ranks 2, 3: position_ids step") if replica == 0 else
                  ("position_ids step", "ranks 0, 1: the attention_mask is not right padding"))
    message = str(raised.value)
    assert message.startswith(own) and "[refused on ranks 0, 1, 2, 3 of 4, every rank stops; " + other in message, \
        message
    # every replica fine (after the refusals: the collectives are still in step): the layout as before
    for case in ("fine", "right_padding"):
        window = _window(case, S=S * (1 + replica))         # the replicas' lengths may differ
        got = layout(window)
        assert got[3] is None                               # one document: no document ids
        names = ("input_ids", "position_ids", "labels")
        for name, t in zip(names, got):
            want = shard(window[name], SP, CHUNKS, sp_rank, dim=-1)
            assert t.dtype == window[name].dtype and torch.equal(t, want), (case, name, rank)


@pytest.mark.slow
def test_a_refusal_on_one_data_parallel_replica_stops_every_rank():
    run_distributed(_dp2_sp2, 4, timeout=120)


def _trainer_route_dp2_sp2(rank, world):
    """The same through the model's forward on DeepSpeed's own groups (``parallel_state_sp``)."""
    import copy

    import deepspeed
    from deepspeed.runtime.sequence_parallel import parallel_state_sp

    import fpdt.hf
    from fpdt.hf import FPDTHFError
    from tests.model.helpers import hf_model

    deepspeed.init_distributed(dist_backend="gloo")
    parallel_state_sp.initialize_sequence_parallel(SP)
    try:
        model = fpdt.hf.apply_fpdt(copy.deepcopy(hf_model("llama_gqa")), group="trainer", num_chunks=CHUNKS)
        model.train()
        replica, sp_rank = rank // SP, rank % SP

        def forward(case):
            x = _slice(_window(case), sp_rank)
            labels = x.pop("labels")
            return model(**x, shift_labels=labels)

        with pytest.raises(FPDTHFError, match=("ranks 2, 3 of 4 refused.*" if replica == 0 else "") +
                           REFUSALS["jumping"]):
            forward("fine" if replica == 0 else "jumping")
        assert torch.isfinite(forward("right_padding").loss)      # the next step goes on, on every rank
    finally:
        parallel_state_sp._release_sequence_parallel_groups()


@pytest.mark.slow
def test_trainer_route_refuses_on_every_replica():
    pytest.importorskip("deepspeed")
    run_distributed(_trainer_route_dp2_sp2, 4, timeout=180)


def _data_parallel_only(rank, world):
    """``group="trainer"`` without sequence parallelism: each rank trains on whole windows of its own."""
    import copy

    import fpdt.hf
    from fpdt.hf import FPDTHFError
    from tests.model.helpers import hf_model

    model = fpdt.hf.apply_fpdt(copy.deepcopy(hf_model("llama_gqa")), group="trainer", num_chunks=CHUNKS)
    model.train()

    def forward(case):
        x = _window(case)
        labels = x.pop("labels")
        return model(**x, shift_labels=labels)

    with pytest.raises(FPDTHFError, match=("rank 1 of 2 refused.*" if rank == 0 else "") + REFUSALS["left_padding"]):
        forward("fine" if rank == 0 else "left_padding")
    with pytest.raises(FPDTHFError, match=("rank 1 of 2 refused.*" if rank == 0 else "") + REFUSALS["jumping"]):
        forward("fine" if rank == 0 else "jumping")
    assert torch.isfinite(forward("right_padding").loss)


@pytest.mark.slow
def test_data_parallel_only_refuses_on_every_rank():
    run_distributed(_data_parallel_only, 2, timeout=120)
