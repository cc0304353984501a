"""``attention_checkpoint="save"``: counted through the kernel table, and exact.

Every attention-kernel call goes through :data:`fpdt.attention.kernels.BACKENDS`; the tests
swap in counting wrappers of the CPU's backends (``cpu``, ``math``) and count per step:

* forwards = one per block with ``"save"``, two with ``"recompute"`` (per checkpointed
  layer; with ``save_attention_layers=K`` the other layers two); backwards = one per block
  either way (each pipeline runs one backward call per block it ran one forward call for);
* loss and every gradient equal the ``"recompute"`` run's (fp32, within 1e-6 relative:
  the same kernel gives the same ``o`` and lse), incl. LoRA with dropout.

Cases: sp 1/2/4 (Ulysses), a 2 x 2 mesh (ring and double ring), u 1-4, checkpointing
``"on"`` and ``"offload"`` (simulated runtime on the CPU), K below the layer count.
"""

from __future__ import annotations

import contextlib
import dataclasses

import pytest
import torch
import torch.distributed as dist

import fpdt.model as fm
from fpdt.attention import kernels
from fpdt.comm import SequenceMesh
from fpdt.model.lora import LoraSpec
from fpdt.offload import fresh_runtime
from tests.distributed import run_distributed
from tests.model.helpers import compare, fpdt_from_hf, hf_model, tokens

EXACT = 1e-6


class Counter:
    def __init__(self):
        self.forward = self.backward = 0


def counting(monkeypatch, name: str, dtype=torch.float32, head_dim: int = 16) -> Counter:
    """Replace ``BACKENDS[name]`` by a wrapper counting its calls (self-checked first, so the
    self-check's own calls are not counted)."""
    original = kernels.get_backend(name, torch.device("cpu"), dtype, head_dim)
    counter = Counter()

    def forward(*a, **k):
        counter.forward += 1
        return original.forward(*a, **k)

    def backward(*a, **k):
        counter.backward += 1
        return original.backward(*a, **k)

    monkeypatch.setitem(kernels.BACKENDS, name, dataclasses.replace(original, forward=forward, backward=backward))
    return counter


def _step(model, ids, labels):
    model.zero_grad(set_to_none=True)
    loss = model(**model.prepare_inputs(ids, labels=labels))
    loss.backward()
    return loss.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def _run(name, counter, ids, labels, *, lora=None, runtime=None, **options):
    """``runtime``: the simulated runtime's mode (None: the automatic runtime)."""
    with fresh_runtime("sim", mode=runtime) if runtime is not None else contextlib.nullcontext() as rt:
        torch.manual_seed(5)
        model = fpdt_from_hf(hf_model(name), runtime=rt, **options)
        if lora is not None:
            model = fm.add_lora(model, lora)
            model.train()
        counter.forward = counter.backward = 0
        torch.manual_seed(7)         # the LoRA dropout masks' seeds come from here
        out = _step(model, ids, labels)
    return out, (counter.forward, counter.backward)


def _check(name, counter, ids, labels, layers, save_layers=None, lora=None, runtime=None, what="", **options):
    (ref_loss, ref_grads), (ref_f, ref_b) = _run(name, counter, ids, labels, lora=lora, runtime=runtime,
                                                 attention_checkpoint="recompute", **options)
    (loss, grads), (f, b) = _run(name, counter, ids, labels, lora=lora, runtime=runtime,
                                 attention_checkpoint="save", save_attention_layers=save_layers, **options)
    compare(loss, grads, ref_loss, ref_grads, f"save vs recompute {what} {options}", tol=EXACT)
    K = layers if save_layers is None else save_layers
    per_layer = b // layers      # blocks per layer and step on this rank
    assert b == ref_b and b == per_layer * layers and per_layer > 0, (b, ref_b)
    assert ref_f == 2 * b, f"recompute: {ref_f} forwards for {b} blocks ({what} {options})"
    assert f == per_layer * (2 * layers - K), f"save: {f} forwards, {b} blocks, {K} of {layers} saving ({options})"


@pytest.mark.parametrize("backend", ["cpu", "math"])
@pytest.mark.parametrize("u", [1, 2, 3, 4])
@pytest.mark.parametrize("checkpointing", ["on", "offload"])
def test_one_attention_forward_per_block_and_exact(monkeypatch, backend, u, checkpointing):
    counter = counting(monkeypatch, backend)
    ids, labels = tokens(256, 2, 8 * u)
    offload = checkpointing == "offload"
    _check("llama_gqa", counter, ids, labels, 2, num_chunks=u, checkpointing=checkpointing, offload=offload,
           backend=backend, runtime="lazy" if offload else None)


@pytest.mark.parametrize("checkpointing,device_layers", [("on", 0), ("offload", 0), ("offload", 1)])
def test_fewer_saving_layers(monkeypatch, checkpointing, device_layers):
    counter = counting(monkeypatch, "cpu", head_dim=8)
    ids, labels = tokens(256, 1, 12)
    _check("llama_bias", counter, ids, labels, 2, save_layers=1, num_chunks=3, checkpointing=checkpointing,
           checkpoint_device_layers=device_layers, backend="cpu",
           runtime="threaded" if checkpointing == "offload" else None)
    _check("llama_bias", counter, ids, labels, 2, save_layers=0, num_chunks=2, checkpointing=checkpointing,
           backend="cpu", runtime="lazy" if checkpointing == "offload" else None)


@pytest.mark.parametrize("checkpointing", ["on", "offload"])
def test_lora_with_dropout_replays_its_masks(monkeypatch, checkpointing):
    counter = counting(monkeypatch, "cpu")
    ids, labels = tokens(256, 1, 12)
    offload = checkpointing == "offload"
    _check("llama_gqa", counter, ids, labels, 2, lora=LoraSpec(3, dropout=0.3), num_chunks=3,
           checkpointing=checkpointing, offload=offload, backend="cpu", runtime="threaded" if offload else None)


def test_options_are_validated():
    with pytest.raises(ValueError, match="attention_checkpoint='bogus' must be one of"):
        fm.FPDTOptions(attention_checkpoint="bogus").validate()
    with pytest.raises(ValueError, match="must be an integer >= 0"):
        fm.FPDTOptions(attention_checkpoint="save", checkpointing="on", save_attention_layers=-1).validate()
    model = fpdt_from_hf(hf_model("llama_bias"), checkpointing="on")
    with pytest.raises(ValueError, match="more than the model's 2 decoder layers"):
        model.configure(attention_checkpoint="save", save_attention_layers=3)
    assert model.configure(attention_checkpoint="save", save_attention_layers=1).saving_layers == 1
    assert model.configure(save_attention_layers=None).saving_layers == 2
    with pytest.raises(ValueError, match="checkpointing='off' recomputes nothing"):
        model.configure(checkpointing="off")                                 # nothing to recompute
    assert model.configure(checkpointing="on", attention_checkpoint="recompute").saving_layers == 0


def _distributed_body(rank, world, cases):
    import pytest as _pytest
    monkeypatch = _pytest.MonkeyPatch()
    counter = counting(monkeypatch, "cpu", head_dim=12)
    for mesh_kw, u, checkpointing, save_layers in cases:
        mesh = SequenceMesh(**mesh_kw) if mesh_kw is not None else None
        ids, labels = tokens(256, 1, 2 * world * u * 2)
        offload = checkpointing == "offload"
        options = dict(num_chunks=u, checkpointing=checkpointing, offload=offload, backend="cpu", mesh=mesh)
        (ref_loss, ref_grads), (ref_f, ref_b) = _run("llama_sp4", counter, ids, labels,
                                                     runtime="lazy" if offload else None,
                                                     attention_checkpoint="recompute", **options)
        (loss, grads), (f, b) = _run("llama_sp4", counter, ids, labels, runtime="lazy" if offload else None,
                                     attention_checkpoint="save", save_attention_layers=save_layers, **options)
        K = 2 if save_layers is None else save_layers
        assert b == ref_b and b % 2 == 0 and b > 0 and ref_f == 2 * b and f == b // 2 * (4 - K), (f, b, ref_f)
        compare(loss, grads, ref_loss, ref_grads, f"rank {rank} save vs recompute {mesh_kw} u={u}", tol=EXACT)
    monkeypatch.undo()
    dist.barrier()


@pytest.mark.slow
def test_ulysses_sp2_and_sp4():
    run_distributed(_distributed_body, 2, args=([(None, 2, "offload", None), (None, 3, "on", 1)],), timeout=240)
    run_distributed(_distributed_body, 4, args=([(None, 1, "on", None), (None, 2, "offload", None)],), timeout=240)


@pytest.mark.slow
def test_mesh_2x2_ring_and_double_ring():
    run_distributed(_distributed_body, 4, args=([
        (dict(hp=2, cp=2), 2, "offload", None),
        (dict(hp=1, cp=4, inner_ring=2), 1, "on", 1),      # the double ring
    ],), timeout=300)


def test_o_proj_input_is_read_back_from_the_stash_without_a_checkpoint():
    """``checkpointing="off"``, ``offload=True``: no layer keeps ``o_proj``'s full-length input
    on the device to backward (counted: one ``[B, S, H D]`` per layer less after the forward than
    ``o_proj`` run as its module, which keeps it); the same loss and gradients."""
    import fpdt.attention.module
    from fpdt.memory import MemoryAccountant

    ids, labels = tokens(256, 2, 24)
    results = {}
    original = fpdt.attention.module.read_output_projection
    for inside in (False, True):
        with fresh_runtime("sim", mode="threaded") as rt:
            torch.manual_seed(5)
            model = fpdt_from_hf(hf_model("llama_gqa"), num_chunks=3, offload=True, runtime=rt)
            inputs = model.prepare_inputs(ids, labels=labels)
            if not inside:
                fpdt.attention.module.read_output_projection = lambda module, owner, training=True: None
            try:
                with MemoryAccountant("cpu") as acct:
                    loss = model(**inputs)
                    after_forward = acct.device_live
                    loss.backward()
            finally:
                fpdt.attention.module.read_output_projection = original
        grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
        results[inside] = (loss.detach(), grads, after_forward)
    compare(results[True][0], results[True][1], results[False][0], results[False][1], "o_proj inside", tol=EXACT)
    cfg = hf_model("llama_gqa").config
    per_layer = ids.numel() * cfg.num_attention_heads * (cfg.hidden_size // cfg.num_attention_heads) * 4
    assert results[False][2] - results[True][2] == cfg.num_hidden_layers * per_layer, \
        (results[False][2] - results[True][2], per_layer)
