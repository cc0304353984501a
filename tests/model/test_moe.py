"""Chunked MoE MLP == Transformers' sparse MoE blocks (output and all gradients), and the router
statistics == ``load_balancing_loss_func`` (value and gradient), over chunks and ranks."""

import copy

import pytest
import torch
from transformers import Qwen3MoeConfig, Qwen3NextConfig
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeRMSNorm, Qwen3MoeSparseMoeBlock, load_balancing_loss_func
from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextSparseMoeBlock

from fpdt.model.llama import RMSNorm
from fpdt.model.moe import ChunkedMoE, RouterStatistics, balancing_loss, default_moe_chunks, moe_kernel
from tests.distributed import run_distributed
from tests.model.helpers import assert_no_worse_than_bf16, rel_err

E, K = 8, 2


def _reference(hidden, ffn, norm_topk, shared=0, seed=0):
    torch.manual_seed(seed)
    if shared:
        cfg = Qwen3NextConfig(hidden_size=hidden, moe_intermediate_size=ffn, num_experts=E, num_experts_per_tok=K,
                              norm_topk_prob=norm_topk, shared_expert_intermediate_size=shared)
        block = Qwen3NextSparseMoeBlock(cfg)
    else:
        cfg = Qwen3MoeConfig(hidden_size=hidden, moe_intermediate_size=ffn, num_experts=E, num_experts_per_tok=K,
                             norm_topk_prob=norm_topk)
        block = Qwen3MoeSparseMoeBlock(cfg)
    block.experts.config._experts_implementation = "eager"
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0.0, 0.3)
    return block


def _ours(block, hidden, ffn, norm_topk, shared=0, num_chunks=1, kernel=None):
    m = ChunkedMoE(hidden, ffn, E, K, norm_topk, shared_intermediate_size=shared, num_chunks=num_chunks)
    m.load_state_dict(block.state_dict())
    m.kernel = kernel
    return m


def _grads(module, x, dy, **kw):
    module.zero_grad(set_to_none=True)
    xr = x.clone().requires_grad_()
    y = module(xr, **kw) if kw else module(xr)
    y.backward(dy)
    return y.detach(), {"x": xr.grad, **{n: p.grad.clone() for n, p in module.named_parameters()}}


@pytest.mark.parametrize("num_chunks", [1, 3, 4])
@pytest.mark.parametrize("norm_topk", [True, False])
@pytest.mark.parametrize("kernel,hidden,ffn", [("loop", 24, 13), ("grouped_mm", 24, 12)])
def test_matches_transformers_block(num_chunks, norm_topk, kernel, hidden, ffn):
    """fp32, random output gradients, 2 x 11 tokens (uneven chunks), E=8, k=2; the grouped kernel
    (``torch._grouped_mm``, which the CPU build runs too) needs 16-byte aligned widths."""
    block = _reference(hidden, ffn, norm_topk)
    x, dy = torch.randn(2, 11, hidden), torch.randn(2, 11, hidden)
    y0, g0 = _grads(block, x, dy)
    y, g = _grads(_ours(block, hidden, ffn, norm_topk, num_chunks=num_chunks, kernel=kernel), x, dy)
    assert rel_err(y, y0) < 1e-5
    assert g.keys() == g0.keys()
    for n in g0:
        assert rel_err(g[n], g0[n]) < 1e-5, n


@pytest.mark.parametrize("num_chunks", [1, 3])
def test_norm_inside_and_shared_expert(num_chunks):
    """With the pre-MLP RMSNorm fused in and Qwen3-Next's shared expert with its sigmoid gate."""
    hidden, ffn, shared = 16, 9, 11
    block = _reference(hidden, ffn, True, shared=shared)
    ours = _ours(block, hidden, ffn, True, shared=shared, num_chunks=num_chunks)
    ref_norm, norm = Qwen3MoeRMSNorm(hidden, eps=1e-5), RMSNorm(hidden, 1e-5)
    with torch.no_grad():
        ref_norm.weight.normal_(1.0, 0.2)
        norm.weight.copy_(ref_norm.weight)
    x, dy = torch.randn(3, 7, hidden) * 2, torch.randn(3, 7, hidden)
    xr = x.clone().requires_grad_()
    y0 = block(ref_norm(xr))
    y0.backward(dy)
    x2 = x.clone().requires_grad_()
    y = ours(x2, norm=norm)
    y.backward(dy)
    assert rel_err(y, y0) < 1e-5 and rel_err(x2.grad, xr.grad) < 1e-5
    assert rel_err(norm.weight.grad, ref_norm.weight.grad) < 1e-5
    ref = dict(block.named_parameters())
    for n, p in ours.named_parameters():
        assert rel_err(p.grad, ref[n].grad) < 1e-5, n


def test_bf16_no_worse_than_plain():
    """bf16 weights and input: within 2e-2 of Transformers' bf16 block and no further from float64."""
    block = _reference(32, 16, True)
    x, dy = torch.randn(2, 9, 32), torch.randn(2, 9, 32)
    exact = _grads(copy.deepcopy(block).double(), x.double(), dy.double())
    plain = _grads(copy.deepcopy(block).bfloat16(), x.bfloat16(), dy.bfloat16())
    ours = _ours(block, 32, 16, True, num_chunks=3).bfloat16()
    got = _grads(ours, x.bfloat16(), dy.bfloat16())
    assert_no_worse_than_bf16(got[0], plain[0], exact[0], "y")
    for n in exact[1]:
        assert got[1][n].dtype == torch.bfloat16, n
        assert_no_worse_than_bf16(got[1][n], plain[1][n], exact[1][n], n)


def _layers(hidden=16, ffn=10, n=3, norm_topk=False):
    return [_reference(hidden, ffn, norm_topk, seed=i) for i in range(n)]


def _reference_loss_grads(blocks, xs, dys, coef):
    """Σ outputs · dy + coef · Transformers' balancing loss over every layer's router logits."""
    for b in blocks:
        b.zero_grad(set_to_none=True)
    leaves = [x.clone().requires_grad_() for x in xs]
    total = sum((b(x) * dy).sum() for b, x, dy in zip(blocks, leaves, dys))
    logits = tuple(b.gate(x)[0] for b, x in zip(blocks, leaves))
    aux = load_balancing_loss_func(logits, E, K)
    (total + coef * aux).backward()
    return aux.detach(), [x.grad for x in leaves], [{n: p.grad for n, p in b.named_parameters()} for b in blocks]


def _our_loss_grads(mods, xs, dys, coef, group=None):
    """The same through RouterStatistics and balancing_loss; ``xs`` this rank's tokens."""
    stats = RouterStatistics(E, K, group=group)
    leaves = [x.clone().requires_grad_() for x in xs]
    outs = [m(x, stats=stats) for m, x in zip(mods, leaves)]
    h = torch.cat([o.reshape(-1) for o in outs])
    h, aux = balancing_loss(h, stats)
    (torch.dot(h, torch.cat([dy.reshape(-1) for dy in dys])) + coef * aux).backward()
    return aux.detach(), [x.grad for x in leaves], [{n: p.grad for n, p in m.named_parameters()} for m in mods], stats


@pytest.mark.parametrize("norm_topk", [False, True])
@pytest.mark.parametrize("num_chunks", [1, 3, 4])
def test_balancing_loss_matches_transformers(norm_topk, num_chunks):
    """Three MoE layers, per-expert sums over chunks: loss and every gradient with coefficient 0.37."""
    blocks = _layers(norm_topk=norm_topk)
    mods = [_ours(b, 16, 10, norm_topk, num_chunks=num_chunks) for b in blocks]
    for i, m in enumerate(mods):
        m.layer_index = i
    xs = [torch.randn(2, 13, 16) for _ in blocks]
    dys = [torch.randn(2, 13, 16) for _ in blocks]
    aux0, dx0, g0 = _reference_loss_grads(blocks, xs, dys, 0.37)
    aux, dx, g, stats = _our_loss_grads(mods, xs, dys, 0.37)
    assert rel_err(aux, aux0) < 1e-6
    for a, b in zip(dx, dx0):
        assert rel_err(a, b) < 1e-5
    for ga, gb in zip(g, g0):
        for n in gb:
            assert rel_err(ga[n], gb[n]) < 1e-5, n
    load = stats.expert_load()
    assert sorted(load) == [0, 1, 2] and all(v["mean"] == 2 * 13 * K / E for v in load.values())
    assert all(v["max"] >= v["mean"] for v in load.values())


def test_balancing_loss_gradient_reaches_the_router():
    """With zero output gradients, the routers' gradients are the balancing loss's alone (not zero)."""
    blocks = _layers(n=2)
    mods = [_ours(b, 16, 10, False, num_chunks=2) for b in blocks]
    xs = [torch.randn(1, 10, 16) for _ in blocks]
    dys = [torch.zeros(1, 10, 16) for _ in blocks]
    _, _, g0 = _reference_loss_grads(blocks, xs, dys, 1.0)
    _, _, g, _ = _our_loss_grads(mods, xs, dys, 1.0)
    for ga, gb in zip(g, g0):
        assert ga["gate.weight"].abs().max() > 0 and rel_err(ga["gate.weight"], gb["gate.weight"]) < 1e-5


def test_statistics_refuse_reuse_and_empty():
    stats = RouterStatistics(E, K)
    with pytest.raises(RuntimeError, match="no MoE layer"):
        stats.balancing_loss()
    stats = RouterStatistics(E, K)
    stats.record(0, torch.ones(E), torch.ones(E), 4)
    stats.balancing_loss()
    with pytest.raises(RuntimeError, match="fresh RouterStatistics"):
        stats.record(0, torch.ones(E), torch.ones(E), 4)


def test_kernel_choice_and_chunks():
    assert moe_kernel(torch.device("cpu"), torch.bfloat16, 2048, 768) == "loop"
    # Qwen3-30B-A3B at u = 4: k (2 hidden + 4 ffn) = 8 * 7168 bf16 elements per token
    assert default_moe_chunks(2048, 768, 128, 8, 4) == -(-4 * (5 * 2048 + 256 + 144 + 8 * (5 * 2048 + 4 * 768)) // 4096)
    with pytest.raises(ValueError, match="num_experts_per_tok"):
        ChunkedMoE(16, 8, 4, 5)


def _distributed_body(rank, world_size, norm_topk):
    import torch.distributed as dist
    blocks = _layers(norm_topk=norm_topk)
    mods = [_ours(b, 16, 10, norm_topk, num_chunks=3) for b in blocks]
    for i, m in enumerate(mods):
        m.layer_index = i
    torch.manual_seed(123)
    xs = [torch.randn(2, 12, 16) for _ in blocks]
    dys = [torch.randn(2, 12, 16) for _ in blocks]
    aux0, dx0, g0 = _reference_loss_grads(blocks, xs, dys, 0.5)
    part = lambda t: t.chunk(world_size, dim=1)[rank].contiguous()  # noqa: E731
    aux, dx, g, _ = _our_loss_grads(mods, [part(x) for x in xs], [part(d) for d in dys], 0.5, group=dist.group.WORLD)
    assert rel_err(aux, aux0) < 1e-6
    for a, b in zip(dx, dx0):
        assert rel_err(a, part(b)) < 1e-5
    for ga, gb in zip(g, g0):                   # parameter gradients summed over the ranks
        for n in gb:
            total = ga[n].clone()
            dist.all_reduce(total)
            assert rel_err(total, gb[n]) < 1e-5, n


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [1, 2])
def test_statistics_all_reduced_over_ranks(world_size):
    """Each rank routes its share of every sequence; the loss is the global one and the summed
    gradients are the reference's."""
    run_distributed(_distributed_body, world_size, args=(True,))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_kernel_matches_loop_bf16():
    """On a GPU: the kernel moe_kernel picks (grouped_mm on sm90+) against the loop, bf16, both
    against float64 no worse than Transformers' bf16 block."""
    block = _reference(64, 32, True)
    x, dy = torch.randn(2, 257, 64), torch.randn(2, 257, 64)
    exact = _grads(copy.deepcopy(block).double(), x.double(), dy.double())
    plain = _grads(copy.deepcopy(block).bfloat16().cuda(), x.bfloat16().cuda(), dy.bfloat16().cuda())
    for kernel in (None, "loop"):
        ours = _ours(block, 64, 32, True, num_chunks=3, kernel=kernel).bfloat16().cuda()
        got = _grads(ours, x.bfloat16().cuda(), dy.bfloat16().cuda())
        assert_no_worse_than_bf16(got[0].cpu(), plain[0].cpu(), exact[0], f"y {kernel}")
        for n in exact[1]:
            assert_no_worse_than_bf16(got[1][n].cpu(), plain[1][n].cpu(), exact[1][n], f"{n} {kernel}")


def test_config_refusals():
    from fpdt.model import ModelConfig, UnsupportedConfigError
    base = dict(model_type="qwen3_moe", vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                num_attention_heads=2, num_key_value_heads=1, head_dim=8, moe_intermediate_size=8, num_experts=4)
    assert ModelConfig.from_hf({**base, "num_experts_per_tok": 2}).moe.top_k == 2
    with pytest.raises(UnsupportedConfigError, match="num_experts_per_tok=5 must be in"):
        ModelConfig.from_hf({**base, "num_experts_per_tok": 5})
    with pytest.raises(UnsupportedConfigError, match="decoder_sparse_step=0"):
        ModelConfig.from_hf({**base, "num_experts_per_tok": 2, "decoder_sparse_step": 0})


def _peft_block(shared: int, seed: int = 0):
    """A Qwen3-Next sparse block (``shared`` wide shared expert, or Qwen3-MoE's without) with PEFT's
    LoRA on its shared expert and sigmoid gate (``target_modules``), router and fused experts
    (``target_parameters``); random ``B``, base weights trainable too."""
    peft = pytest.importorskip("peft")
    block = _reference(16, 9, True, shared=shared, seed=seed)
    names = ["gate_proj", "up_proj", "down_proj", "shared_expert_gate"] if shared else None
    holder = peft.inject_adapter_in_model(peft.LoraConfig(
        r=3, lora_alpha=5, target_modules=names, init_lora_weights=False,
        target_parameters=["mlp.gate.weight", "experts.gate_up_proj", "experts.down_proj"]),
        torch.nn.ModuleDict({"mlp": block}))
    with torch.no_grad():
        for n, p in holder.named_parameters():
            if "lora_B" in n:
                p.normal_(0.0, 0.1)
    assert sum(".lora_A." in n for n, _ in holder.named_parameters()) == 3 + 4 * bool(shared)
    holder.requires_grad_(True)
    return holder.mlp


@pytest.mark.parametrize("shared,num_chunks", [(11, 1), (11, 3), (0, 2)])
def test_lora_on_router_and_shared_expert_matches_peft(shared, num_chunks):
    """PEFT's LoRA on the router, the shared expert's three projections and its sigmoid gate and the
    experts, the pre-MLP norm inside: output, input and every gradient (adapters and base) within
    1e-5 of the PEFT block run by Transformers, fp32, random output gradients, the balancing loss's
    gradient (coefficient 0.37) reaching the router's adapter."""
    peft_block = _peft_block(shared)
    ours = ChunkedMoE.from_block(copy.deepcopy(peft_block), num_chunks)
    ref_norm, norm = Qwen3MoeRMSNorm(16, eps=1e-5), RMSNorm(16, 1e-5)
    with torch.no_grad():
        ref_norm.weight.normal_(1.0, 0.2)
        norm.weight.copy_(ref_norm.weight)
    x, dy = torch.randn(2, 11, 16) * 2, torch.randn(2, 11, 16)
    xr, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    h = ref_norm(xr)
    aux0 = load_balancing_loss_func((peft_block.gate(h.reshape(-1, 16))[0],), E, K)
    y0 = peft_block(h)
    ((y0 * dy).sum() + 0.37 * aux0).backward()
    stats = RouterStatistics(E, K)
    y, aux = balancing_loss(ours(x2, norm=norm, stats=stats), stats)
    ((y * dy).sum() + 0.37 * aux).backward()
    assert rel_err(y, y0) < 1e-5 and rel_err(aux, aux0) < 1e-6 and rel_err(x2.grad, xr.grad) < 1e-5
    assert rel_err(norm.weight.grad, ref_norm.weight.grad) < 1e-5
    ref = dict(peft_block.named_parameters())
    got = dict(ours.named_parameters())
    assert got.keys() == ref.keys()
    for n, p in got.items():
        assert p.grad is not None and p.grad.abs().max() > 0 and rel_err(p.grad, ref[n].grad) < 1e-5, n


class _FpdtMasks(torch.nn.Module):
    """Dropout with fpdt's masks (``fpdt.ops.lora.keep_scale``) of one term over token chunks: the
    reference for the shared expert's LoRA dropout."""

    def __init__(self, p, seed, stream, num_chunks):
        super().__init__()
        self.p, self.seed, self.stream, self.num_chunks = p, seed, stream, num_chunks

    def forward(self, x):
        from fpdt.model.chunks import chunk_bounds
        from fpdt.ops.lora import keep_scale
        return torch.cat([x[s:e] * keep_scale(x[s:e].shape, x.dtype, x.device, self.p, self.seed, self.stream, c)
                          for c, (s, e) in enumerate(chunk_bounds(x.shape[0], self.num_chunks))])


def test_shared_expert_lora_dropout_against_its_masks():
    """LoRA dropout 0.3 on the shared expert (PEFT's adapters): output and every gradient within 1e-5
    of the PEFT block whose dropout draws fpdt's masks for the call's seed, per term and token chunk
    (the backward regenerates them); another seed differs."""
    peft = pytest.importorskip("peft")
    from fpdt.ops.lora import rank_seed
    block = _reference(16, 9, True, shared=11)
    holder = peft.inject_adapter_in_model(peft.LoraConfig(
        r=3, lora_alpha=5, lora_dropout=0.3, init_lora_weights=False,
        target_modules=["gate_proj", "up_proj", "down_proj", "shared_expert_gate"]), torch.nn.ModuleDict({"mlp": block}))
    ref = holder.requires_grad_(True).mlp
    ours = ChunkedMoE.from_block(copy.deepcopy(ref), 2)
    torch.manual_seed(7)
    seed = rank_seed(int(torch.randint(0, 2 ** 62, (), dtype=torch.int64)), 0)
    for stream, proj in enumerate((ref.shared_expert.gate_proj, ref.shared_expert.up_proj,
                                   ref.shared_expert.down_proj, ref.shared_expert_gate)):
        proj.lora_dropout["default"] = _FpdtMasks(0.3, seed, stream, 2)
    x, dy = torch.randn(2, 9, 16), torch.randn(2, 9, 16)
    y0, g0 = _grads(ref, x, dy)
    torch.manual_seed(7)
    y, g = _grads(ours, x, dy)
    assert rel_err(y, y0) < 1e-5 and g.keys() == g0.keys()
    for n in g0:
        assert rel_err(g[n], g0[n]) < 1e-5, n
    torch.manual_seed(8)
    assert rel_err(_grads(ours, x, dy)[0], y0) > 1e-3
