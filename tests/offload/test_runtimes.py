"""The offload parity suite under the simulated runtime, ``sim`` lazy and ``sim`` threaded.

Re-runs a focused subset of the offloading cases of the attention (sp 1/2/4), layer
(sp 1/2/4), 2D mesh (4 ranks) and model (``checkpointing="offload"``, sp 1/2) parity tests
with unchanged tolerances (the trainer runs are in test_trainer_runtimes.py),
each with a fresh ``runtime=`` on every rank (``FPDT_RUNTIME`` for the trainer, as a
user would run it). Under ``sim`` the copies run late (or on worker threads after random
delays) into NaN-filled destinations, so a missing wait shows as wrong numbers or a
StreamHazardError. The fault tests show that each injected fault is caught.
"""

import pytest
import torch

from fpdt.offload import StreamHazardError, fresh_runtime
from tests.attention import test_fpdt_attention as attention_tests
from tests.attention import test_module as layer_tests
from tests.distributed import run_distributed
from tests.model.test_parity import run_case

# ``sync`` is the CPU default: the parity suites in tests/attention and tests/model already
# run every offloading case under it, so here it only has to be the simulator's two modes.
RUNTIMES = {"sim-lazy": ("sim", {"mode": "lazy"}), "sim-threaded": ("sim", {"mode": "threaded", "seed": 1})}


def _attention_cases(world):
    """A focused subset of the attention parity cases (suite time): MHA, GQA (replicated
    when H_kv < sp), 1-4 chunks, bf16, non-causal."""
    H = 6 if world < 4 else 8
    return [dict(B=2, H=H, H_kv=H, D=40, u=2, seed=1), dict(B=2, H=H, H_kv=2, D=40, u=4, seed=2),
            dict(B=1, H=H, H_kv=1, D=16, u=3, seed=3), dict(B=1, H=H, H_kv=1, D=8, u=1, seed=4),
            dict(B=2, H=H, H_kv=2, D=40, u=2, dtype=torch.bfloat16, seed=5),
            dict(B=1, H=H, H_kv=H, D=16, u=2, causal=False, seed=6)]


def _layer_cases(world):
    H, H_kv, hidden = (6, 2, 96) if world < 4 else (8, 2, 64)
    return [dict(B=2, hidden=hidden, H=H, H_kv=H_kv, D=16, u=2, bias=True, seed=1),
            dict(B=1, hidden=hidden, H=H, H_kv=1, D=16, u=4, bias=False, seed=2),
            dict(B=2, hidden=hidden, H=H, H_kv=H_kv, D=16, u=2, bias=True, dtype=torch.bfloat16, seed=3)]


def _attention_and_layer(rank, world, runtime):
    name, opts = RUNTIMES[runtime]
    with fresh_runtime(name, **opts) as rt:
        for case in _attention_cases(world):
            attention_tests.check_case(rank, world, offload=True, runtime=rt, **case)
        for case in _layer_cases(world):
            layer_tests.check_layer(rank, world, offload=True, runtime=rt, **case)
        if world == 4:
            _mesh_cases(rank, world, rt)


@pytest.mark.slow
@pytest.mark.parametrize("runtime", list(RUNTIMES))
@pytest.mark.parametrize("world", [1, 2, 4])
def test_attention_offload_parity(world, runtime):
    if world == 1:
        _attention_and_layer(0, 1, runtime)
    else:
        run_distributed(_attention_and_layer, world, args=(runtime,), timeout=240)


def _model(rank, world, runtime):
    name, opts = RUNTIMES[runtime]
    with fresh_runtime(name, **opts) as rt:
        run_case("llama_gqa", rank, world, num_chunks=2, mlp_chunks=3, loss_chunks=5, offload=True,
                 checkpointing="offload", runtime=rt)


@pytest.mark.slow
@pytest.mark.parametrize("runtime", list(RUNTIMES))
@pytest.mark.parametrize("world", [1, 2])
def test_model_checkpoint_offload_parity(world, runtime):
    if world == 1:
        _model(0, 1, runtime)
    else:
        run_distributed(_model, world, args=(runtime,), timeout=240)


# --- each fault is caught by the parity tests ------------------------------------------

def _faulty(rank, world, fault, checks, what):
    with fresh_runtime("sim", fault=fault, checks=checks) as rt:
        if what == "attention":
            attention_tests.check_case(rank, world, B=2, H=6, H_kv=2, D=8, u=4, offload=True, runtime=rt)
        elif what == "layer":
            layer_tests.check_layer(rank, world, B=2, hidden=24, H=6, H_kv=2, D=8, u=4, offload=True, bias=True,
                                    runtime=rt)
        else:
            run_case("llama_gqa", rank, world, num_chunks=2, mlp_chunks=3, loss_chunks=5, offload=True,
                     checkpointing="offload", runtime=rt)


@pytest.mark.parametrize("what", ["attention", "layer", "model"])
@pytest.mark.parametrize("fault", ["drop_wait", "drop_record_stream"])
def test_injected_fault_is_caught(fault, what):
    """With the hazard checks the fault raises a StreamHazardError naming the data."""
    with pytest.raises(StreamHazardError, match=r"chunk \d|layer input"):
        _faulty(0, 1, fault, True, what)


@pytest.mark.parametrize("what", ["attention", "model"])
def test_dropped_waits_give_wrong_numbers_without_the_checks(what):
    """The hostile data alone catches dropped waits: NaN reaches the parity comparison."""
    with pytest.raises(AssertionError, match="non-finite|rel"):
        _faulty(0, 1, "drop_wait", False, what)


def _faulty_ranks(rank, world):
    for fault in ("drop_wait", "drop_record_stream"):
        with pytest.raises(StreamHazardError):
            _faulty(rank, world, fault, True, "attention")


@pytest.mark.slow
def test_injected_faults_are_caught_on_two_ranks():
    run_distributed(_faulty_ranks, 2, timeout=120)


def _mesh_cases(rank, world, runtime):
    """The 2D (hp x cp) mesh pipeline's offloading cases on 4 ranks."""
    from fpdt.comm import SequenceMesh
    from tests.attention import test_mesh_attention as mesh_tests
    meshes = [SequenceMesh(**kw) for kw in mesh_tests.MESHES_4[:4]]   # cp=4 ring, inner ring, hp x cp both placements
    for m, case in mesh_tests._cases_4(len(meshes)):
        if case["offload"] and case["u"] > 1:
            mesh_tests.check_mesh_case(meshes[m], runtime=runtime, **case)
    mesh_tests.check_mesh_case(meshes[2], u=2, H=4, H_kv=2, offload=True, causal=False, runtime=runtime)
