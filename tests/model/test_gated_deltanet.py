"""GatedDeltaNet (fpdt.model.gated_deltanet) against Transformers' Qwen3_5GatedDeltaNet on the same
weights: output and every parameter and input gradient, random output gradients, over chunk
counts, head shapes (HV > Hk and HV = Hk), world sizes and offload
(tests.model.gdn_helpers.check_against_references says how they are judged)."""

import copy

import pytest
import torch.distributed as dist
import torch

from fpdt.layout import shard, unshard
from fpdt.model.gated_deltanet import GatedDeltaNet
from tests.distributed import run_distributed
from tests.model.gdn_helpers import HIDDEN, SHAPES, check_against_references, fpdt_layer, fpdt_run, hf_layer


def inputs(B, S, seed):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(B, S, HIDDEN, generator=gen), torch.randn(B, S, HIDDEN, generator=gen)


def check_single(layer, ref, x, dout, doc_ids=None, where=""):
    l64 = copy.deepcopy(layer).double()
    check_against_references(lambda: fpdt_run(layer, x, dout, doc_ids),
                             lambda: fpdt_run(l64, x.double(), dout.double(), doc_ids), ref, x, dout, doc_ids, where)


@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize("num_chunks,S", [(1, 70), (2, 70), (4, 76), (6, 6)])
def test_single_rank_matches_transformers(shape, num_chunks, S):
    """u = 6 over 6 tokens: one-token chunks, so the conv window spans three earlier chunks."""
    config, ref = hf_layer(SHAPES[shape], seed=num_chunks)
    layer = fpdt_layer(config, ref)
    layer.num_chunks = num_chunks
    x, dout = inputs(2, S, seed=S + num_chunks)
    check_single(layer, ref, x, dout, where=f"{shape} u={num_chunks}")


def ids_with_starts(S, rows):
    ids = torch.zeros(len(rows), S, dtype=torch.long)
    for b, starts in enumerate(rows):
        for t in starts:
            ids[b, t:] += 1
    return ids


@pytest.mark.parametrize("num_chunks", [1, 2, 5])
def test_packed_documents_are_each_document_alone(num_chunks):
    """ms-swift #9618 (Transformers 5.2-5.8 leaked the state across packed samples): a document start
    resets the state and the conv window, inside a chunk and at a chunk edge (35 for u = 2; 56 for
    u = 5), with one-token documents (5, 6) and rows starting documents at different places."""
    config, ref = hf_layer(SHAPES["gva"], seed=7)
    layer = fpdt_layer(config, ref)
    layer.num_chunks = num_chunks
    x, dout = inputs(2, 70, seed=9)
    doc_ids = ids_with_starts(70, [[5, 6, 35, 56, 57], [1, 20, 64, 69]])
    check_single(layer, ref, x, dout, doc_ids, where=f"packed u={num_chunks}")


def test_packed_documents_under_offload():
    from fpdt.offload import fresh_runtime
    config, ref = hf_layer(SHAPES["equal"], seed=8)
    layer = fpdt_layer(config, ref)
    x, dout = inputs(1, 48, seed=4)
    with fresh_runtime("sim") as rt:
        layer.num_chunks, layer.offload, layer.runtime = 4, True, rt
        check_single(layer, ref, x, dout, ids_with_starts(48, [[12, 13, 30]]), where="packed offload")


def test_offload_on_the_simulated_runtime():
    from fpdt.offload import fresh_runtime
    config, ref = hf_layer(SHAPES["gva"], seed=3)
    layer = fpdt_layer(config, ref)
    x, dout = inputs(1, 64, seed=5)
    with fresh_runtime("sim") as rt:
        layer.num_chunks, layer.offload, layer.runtime, layer.stash_label = 4, True, rt, "layer 0"
        check_single(layer, ref, x, dout, where="offload")


def test_frozen_weights_and_no_grad():
    """Frozen weights: the same input gradient, no weight gradients; no grad: the same output."""
    config, ref = hf_layer(SHAPES["equal"], seed=1)
    layer = fpdt_layer(config, ref)
    layer.num_chunks = 2
    x, dout = inputs(1, 10, seed=2)
    out, grads = fpdt_run(layer, x, dout)
    with torch.no_grad():
        assert torch.equal(layer(x), out)
    for p in layer.parameters():
        p.requires_grad_(False)
    layer.zero_grad()
    xg = x.clone().requires_grad_()
    layer(xg).backward(dout)
    assert (xg.grad - grads["x"]).norm() <= 1e-6 * grads["x"].norm(), (xg.grad - grads["x"]).norm() / grads["x"].norm()
    assert all(p.grad is None for p in layer.parameters())


def test_bad_input_is_refused_in_one_line():
    layer = GatedDeltaNet(HIDDEN, 2, 4, 8, 6)
    layer.num_chunks = 3
    with pytest.raises(ValueError, match="not divisible by sp\\*num_chunks"):
        layer(torch.randn(1, 10, HIDDEN))
    with pytest.raises(ValueError, match="multiple of linear_num_key_heads"):
        GatedDeltaNet(HIDDEN, 3, 4, 8, 6)
    layer.num_chunks = 1
    with pytest.raises(ValueError, match="doc_ids must be"):
        layer(torch.randn(1, 10, HIDDEN), doc_ids=torch.zeros(1, 9, dtype=torch.long))


def test_kernel_is_named_and_state_dict_matches_transformers():
    config, ref = hf_layer(SHAPES["gva"])
    layer = fpdt_layer(config, ref)
    assert layer.kernel_name() == "torch"
    assert {k: v.shape for k, v in layer.state_dict().items()} == {k: v.shape for k, v in ref.state_dict().items()}


DIST_SHAPES = {"gva2": (2, 4, 8, 6), "equal2": (2, 2, 8, 5), "gva4": (4, 8, 4, 6)}


def packed_doc_ids(B, S, seed):
    """Document ids ``[B, S]``: rows with different starts, some inside chunks, one at a chunk edge."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.zeros(B, S, dtype=torch.long)
    for b in range(B):
        starts = sorted(set(torch.randint(1, S, (3,), generator=gen).tolist()) | ({S // 2} if b == 0 else set()))
        for s in starts:
            ids[b, s:] += 1
    return ids


def _ulysses_body(rank, world, shape, num_chunks, S, docs, offload=False):
    from fpdt.offload import fresh_runtime
    with fresh_runtime("sim") as rt:
        _ulysses_check(rank, world, shape, num_chunks, S, docs, rt if offload else None)


def _ulysses_check(rank, world, shape, num_chunks, S, docs, runtime):
    config, ref = hf_layer(DIST_SHAPES[shape], seed=11)
    layer = fpdt_layer(config, ref)
    layer.num_chunks, layer.offload, layer.runtime = num_chunks, runtime is not None, runtime
    l64 = copy.deepcopy(layer).double()
    x, dout = inputs(2, S, seed=S)
    doc_ids = packed_doc_ids(2, S, seed=S) if docs else None
    xs, ds = (shard(t, world, num_chunks, rank) for t in (x, dout))

    def reduce(g):
        dist.all_reduce(g)
        return g

    def gather(result):
        out, grads = result
        full = []
        for t in (out, grads["x"]):
            parts = [torch.empty_like(t) for _ in range(world)]
            dist.all_gather(parts, t.contiguous())
            full.append(unshard(parts, num_chunks))
        return full[0], {**grads, "x": full[1]}
    check_against_references(lambda: fpdt_run(layer, xs, ds, doc_ids, reduce),
                             lambda: fpdt_run(l64, xs.double(), ds.double(), doc_ids, reduce),
                             ref, x, dout, doc_ids, f"rank {rank}/{world} {shape} u={num_chunks}", gather)
    bad = GatedDeltaNet(HIDDEN, 3, 6, 4, 4)
    with pytest.raises(ValueError, match=f"sp={world} does not divide linear_num_key_heads=3"):
        bad(xs)


@pytest.mark.slow
@pytest.mark.parametrize("world,shape,num_chunks,S,docs,offload", [
    (2, "equal2", 4, 40, False, False), (4, "gva4", 2, 40, False, False),
    (2, "gva2", 2, 36, True, False), (4, "gva4", 2, 40, True, False), (2, "equal2", 4, 40, True, True)])
def test_ulysses_matches_transformers(world, shape, num_chunks, S, docs, offload):
    """Heads split over the ranks after the all-to-all; gradients summed over the ranks; with ``docs``
    packed documents whose starts fall inside chunks and across ranks; ``offload`` on the sim runtime."""
    run_distributed(_ulysses_body, world, (shape, num_chunks, S, docs, offload), timeout=300)


def test_2d_mesh_with_context_parallelism_is_refused():
    from types import SimpleNamespace
    layer = GatedDeltaNet(HIDDEN, 2, 4, 8, 6)
    layer.mesh = SimpleNamespace(cp=2, hp=1, hp_group=None)
    with pytest.raises(ValueError, match="cp=2 > 1"):
        layer(torch.randn(1, 8, HIDDEN))


def test_apply_steps_reach_the_mixer_and_zero3_sees_every_read_parameter():
    """DecoderAdapter.set_attention sets the attention's options on ``layer.linear_attn`` too, and
    every parameter the Function reads is listed for ZeRO-3 (the module's own A_log, dt_bias are its)."""
    from torch import nn

    from fpdt.model.apply import ATTENTION_FIELDS, DecoderAdapter
    from fpdt.model.external_params import directly_read
    from fpdt.options import FPDTOptions
    layer = nn.Module()
    layer.linear_attn = GatedDeltaNet(HIDDEN, 2, 4, 8, 6)
    options = FPDTOptions(num_chunks=4, offload=True)
    DecoderAdapter().set_attention(layer, options)
    assert all(getattr(layer.linear_attn, f) == getattr(options, f) for f in ATTENTION_FIELDS)
    read = {id(p) for reader, p in directly_read(layer, lm_head=False) if reader is layer.linear_attn}
    own = {id(layer.linear_attn.A_log), id(layer.linear_attn.dt_bias)}
    assert read | own == {id(p) for p in layer.linear_attn.parameters()} and not read & own


GDN_TARGETS = ["in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj"]


def _lora_run(layer, x, dout):
    """Output and the input's and adapters' gradients (the base is frozen)."""
    layer.zero_grad()
    x = x.detach().clone().requires_grad_()
    out = layer(x)
    out.backward(dout)
    return out.detach(), {"x": x.grad, **{n: p.grad.clone() for n, p in layer.named_parameters() if p.requires_grad}}


def _with_peft_lora(module, dropout=0.0, seed=0):
    peft = pytest.importorskip("peft")
    torch.manual_seed(seed)
    config = peft.LoraConfig(r=3, lora_alpha=5, lora_dropout=dropout, target_modules=GDN_TARGETS,
                             init_lora_weights=False)        # random B: every gradient nonzero
    return peft.inject_adapter_in_model(config, module)


@pytest.mark.parametrize("num_chunks,offload", [(1, False), (3, True)])
def test_peft_lora_on_every_projection_matches_transformers(num_chunks, offload):
    """PEFT LoRA on in_proj_qkv, in_proj_z, in_proj_b, in_proj_a and out_proj, computed inside the
    chunked Function: output, input and adapter gradients against PEFT on Transformers' layer
    (float64 with the float64 token recurrence; fp32 within 1e-5 or twice Transformers' fp32 error)."""
    from fpdt.offload import fresh_runtime
    from tests.model.gdn_helpers import rel
    from tests.model.qwen35 import float64_delta_rule
    config, ref = hf_layer(SHAPES["gva"], seed=21)
    layer = fpdt_layer(config, ref)
    ref = _with_peft_lora(ref)
    layer = _with_peft_lora(layer)
    layer.load_state_dict(ref.state_dict())
    x, dout = inputs(2, 45, seed=22)
    with float64_delta_rule():
        exact = _lora_run(copy.deepcopy(ref).double(), x.double(), dout.double())
    plain = _lora_run(ref, x, dout)
    with fresh_runtime("sim") as rt:
        layer.num_chunks, layer.offload, layer.runtime = num_chunks, offload, rt
        ours = _lora_run(layer, x, dout)
    names = ["out", *ours[1]]
    assert set(ours[1]) == set(plain[1])
    assert len(names) == 12
    bad = {}
    for n in names:
        want, hf, got = ((r[0] if n == "out" else r[1][n]) for r in (exact, plain, ours))
        if rel(got, want) > max(1e-5, 2 * rel(hf, want)):
            bad[n] = (rel(got, want), rel(hf, want))
    assert not bad, f"u={num_chunks} offload={offload}: (ours, Transformers fp32) errors against float64: {bad}"


def test_peft_lora_bf16_no_worse_than_transformers_bf16():
    """bf16 layer and adapters (PEFT's, cast with the model), 4 chunks: output, input and adapter
    gradients against float64, Transformers' bf16 layer with the same adapters the yardstick."""
    from tests.model.helpers import compare_bf16
    from tests.model.qwen35 import float64_delta_rule
    config, ref = hf_layer(SHAPES["gva"], seed=24)
    layer = _with_peft_lora(fpdt_layer(config, ref))
    ref = _with_peft_lora(ref)
    layer.load_state_dict(ref.state_dict())
    x, dout = inputs(1, 64, seed=25)
    with float64_delta_rule():
        exact = _lora_run(copy.deepcopy(ref).double(), x.double(), dout.double())
    plain = _lora_run(copy.deepcopy(ref).to(torch.bfloat16), x.bfloat16(), dout.bfloat16())
    layer = layer.to(torch.bfloat16)
    layer.num_chunks = 4
    out, grads = _lora_run(layer, x.bfloat16(), dout.bfloat16())
    compare_bf16(out, grads, plain[0], plain[1], exact[0], exact[1], "GDN PEFT LoRA bf16 u=4")


def test_lora_dropout_backward_is_the_forward_s_gradient():
    """With LoRA dropout in training mode the masks are fpdt's (regenerated per chunk in backward): in
    float64, with the dropout seed fixed, the gradients of the input and of every adapter tensor
    against central differences along a random direction, three chunks; eval mode has no dropout."""
    from torch.func import functional_call
    config, ref = hf_layer(SHAPES["gva"], seed=23)
    layer = _with_peft_lora(fpdt_layer(config, ref), dropout=0.4).double()
    layer.num_chunks = 3
    params = {n: p.detach().clone().requires_grad_() for n, p in layer.named_parameters() if p.requires_grad}
    x = torch.randn(1, 6, HIDDEN, dtype=torch.float64, requires_grad=True)
    dout = torch.randn(1, 6, HIDDEN, dtype=torch.float64)

    def run(x, params):
        torch.manual_seed(5)
        return functional_call(layer, params, (x,))
    run(x, params).backward(dout)
    gen = torch.Generator().manual_seed(0)
    dirs = {n: torch.randn(p.shape, generator=gen, dtype=torch.float64) for n, p in params.items()}
    dx = torch.randn(x.shape, generator=gen, dtype=torch.float64)
    analytic = (x.grad * dx).sum() + sum((params[n].grad * d).sum() for n, d in dirs.items())
    eps = 1e-6
    with torch.no_grad():
        plus, minus = (run(x + s * eps * dx, {n: p + s * eps * dirs[n] for n, p in params.items()}) for s in (1, -1))
        numeric = ((plus - minus) * dout).sum() / (2 * eps)
        assert abs(numeric - analytic) <= 1e-7 * abs(analytic), (numeric, analytic)
        train = run(x, params)
        layer.eval()
        assert not torch.allclose(run(x, params), train)


def test_fla_path_by_stub(monkeypatch):
    """With the fla kernel (here a stub running the PyTorch rule with fla's signature) the layer
    passes un-normalised q, k and use_qk_l2norm_in_kernel=True: the same output and gradients."""
    import fpdt.model.gdn_chunks as chunks
    from tests.ops.test_delta_rule import _stub_fla
    config, ref = hf_layer(SHAPES["gva"], seed=5)
    layer = fpdt_layer(config, ref)
    layer.num_chunks = 2
    x, dout = inputs(1, 40, seed=6)
    doc_ids = ids_with_starts(40, [[7, 25]])
    want = fpdt_run(layer, x, dout, doc_ids)
    calls = []
    _stub_fla(monkeypatch, calls)
    monkeypatch.setattr(chunks, "delta_rule_kernel", lambda device: "fla")
    got = fpdt_run(layer, x, dout, doc_ids)
    assert calls and all(c["use_qk_l2norm_in_kernel"] and c["output_final_state"] for c in calls)
    for a, b in zip((got[0], *got[1].values()), (want[0], *want[1].values())):
        assert (a - b).norm() <= 1e-6 * b.norm()


@pytest.mark.parametrize("num_chunks", [1, 4])
def test_bf16_no_worse_than_transformers_bf16(num_chunks):
    """bf16 weights and activations: output and gradients against the float64 reference, with
    Transformers' layer run in bf16 as the yardstick (tests.model.helpers.compare_bf16)."""
    from tests.model.gdn_helpers import float64_run, reference_run
    from tests.model.helpers import compare_bf16
    config, ref = hf_layer(SHAPES["gva"], seed=12)
    layer = fpdt_layer(config, ref).to(torch.bfloat16)
    layer.num_chunks = num_chunks
    x, dout = inputs(1, 64, seed=13)
    exact_out, exact = float64_run(ref, x, dout)
    ref16 = copy.deepcopy(ref).to(torch.bfloat16)
    plain_out, plain = reference_run(ref16, x.bfloat16(), dout.bfloat16())
    out, grads = fpdt_run(layer, x.bfloat16(), dout.bfloat16())
    compare_bf16(out, grads, plain_out, plain, exact_out, exact, f"bf16 u={num_chunks}")


def test_chunk_steps_run_by_a_caller_are_the_function():
    """GDNChunks driven chunk by chunk (as a streamed layer would, each chunk its own tensor) gives
    the Function's output, input gradient and weight gradients exactly."""
    from fpdt.model.gdn_chunks import GDNChunks, build_gdn_spec
    from fpdt.offload import HostStash, fresh_runtime
    config, ref = hf_layer(SHAPES["gva"], seed=2)
    layer = fpdt_layer(config, ref)
    layer.num_chunks = 3
    x, dout = inputs(1, 45, seed=3)
    doc_ids = ids_with_starts(45, [[20]])
    out, grads = fpdt_run(layer, x, dout, doc_ids)
    with fresh_runtime("sim") as rt:
        spec = build_gdn_spec(x.shape, x.device, layer.shape, group=None, mesh=None, num_chunks=3, offload=True,
                              doc_ids=doc_ids, label=None, runtime=rt)
        weights = [p.detach() for p in (layer.in_proj_qkv.weight, layer.in_proj_z.weight, layer.in_proj_b.weight,
                                        layer.in_proj_a.weight, layer.conv1d.weight, layer.A_log, layer.dt_bias,
                                        layer.norm.weight, layer.out_proj.weight)]
        chunks = GDNChunks(spec, weights, HostStash("cpu", enabled=True, runtime=rt))
        xs = [x[:, i * 15:(i + 1) * 15].clone() for i in range(3)]
        ys = [chunks.forward(i, xs[i]) for i in range(3)]
        chunks.start_backward([True] * 10)
        dxs = [chunks.backward(j, dout[:, j * 15:(j + 1) * 15]) for j in (2, 1, 0)][::-1]
        dw = chunks.finish()
    assert torch.equal(torch.cat(ys, 1), out) and torch.equal(torch.cat(dxs, 1), grads["x"])
    names = ("in_proj_qkv.weight", "in_proj_z.weight", "in_proj_b.weight", "in_proj_a.weight", "conv1d.weight",
             "A_log", "dt_bias", "norm.weight", "out_proj.weight")
    assert all(torch.equal(d, grads[n]) for d, n in zip(dw, names))


@pytest.mark.parametrize("offload", [False, True])
def test_under_activation_checkpointing(offload):
    """Inside torch.utils.checkpoint (non-reentrant): the first forward's stash is dropped, the
    recompute's feeds backward; the same output and gradients."""
    from torch.utils.checkpoint import checkpoint

    from fpdt.offload import fresh_runtime
    config, ref = hf_layer(SHAPES["gva"], seed=4)
    layer = fpdt_layer(config, ref)
    x, dout = inputs(1, 40, seed=8)
    with fresh_runtime("sim") as rt:
        layer.num_chunks, layer.offload, layer.runtime = 4, offload, rt
        out, grads = fpdt_run(layer, x, dout)
        layer.zero_grad()
        xc = x.clone().requires_grad_()
        got = checkpoint(layer, xc, use_reentrant=False)
        got.backward(dout)
    assert torch.equal(got, out) and torch.equal(xc.grad, grads["x"])
    assert all(torch.equal(p.grad, grads[n]) for n, p in layer.named_parameters())


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_fla_and_causal_conv1d_match_the_pytorch_path(dtype, monkeypatch):
    """On a GPU with fla-core (and causal-conv1d, where installed): the layer on the automatic kernels
    against the same layer on the PyTorch ones, packed documents and 3 chunks, offload on."""
    pytest.importorskip("fla.ops.gated_delta_rule")
    import fpdt.model.gdn_chunks as chunks
    config, ref = hf_layer((2, 4, 64, 64), seed=3)
    layer = fpdt_layer(config, ref).cuda().to(dtype)
    assert layer.kernel_name() == "fla"
    layer.num_chunks, layer.offload = 3, True
    x, dout = (t.cuda().to(dtype) for t in inputs(2, 3 * 128, seed=1))
    tol = 1e-4 if dtype == torch.float32 else 3e-2     # fla's kernels use tf32 / bf16 tensor cores
    for doc_ids in (None, ids_with_starts(3 * 128, [[50, 128, 300], [7]]).cuda()):   # None: causal-conv1d's path
        with monkeypatch.context() as m:
            got = fpdt_run(layer, x, dout, doc_ids)
            m.setattr(chunks, "delta_rule_kernel", lambda device: "torch")
            m.setattr(chunks, "conv_kernel", lambda device: "torch")
            want = fpdt_run(layer, x, dout, doc_ids)
        for a, b in zip((got[0], *got[1].values()), (want[0], *want[1].values())):
            assert (a.float() - b.float()).norm() <= tol * b.float().norm()
