"""Parity of fpdt's bf16 training step with Transformers', both against a float64 reference.

For each model config (a Transformers ``config.json``, e.g. ``benchmarks/models/qwen3_5_small.json``
or ``qwen3_moe_small.json``): one set of weights (Transformers' seeded init, norms, ``A_log`` and
``dt_bias`` moved off their init values, then rounded to bf16 once, so that every run holds exactly
the same values) and one batch of random tokens (``[1, S]``, the labels the tokens themselves) run one
forward + backward four times:

* ``reference``: Transformers in float64, eager attention and experts, and the gated delta rule as a
  float64 token-by-token recurrence (Transformers' own fallback computes in fp32 whatever its input);
* ``transformers_fp32``: Transformers in fp32 on its default kernels, the check that the reference
  computes Transformers' function;
* ``transformers_bf16``: Transformers in bf16 on its default kernels (SDPA; fla's gated delta rule
  where it imports on CUDA; ``grouped_mm`` experts where torch has them): plain bf16's own error;
* ``fpdt``: :mod:`fpdt.model` in bf16 as the ``fpdt`` strategy trains (``S / --chunk-size`` chunks,
  attention offload, offloaded layer checkpoints) on its automatic kernels.

Per quantity, the loss (with the balancing loss where the config routes experts) and every parameter's
gradient, the error is ``||x - ref|| / ||ref||`` (Frobenius). **Pass**: for every quantity, fpdt's error
is at most ``--factor`` (default 2) times plain bf16's, or below bf16's epsilon ``2**-7`` (one unit in
the last place: storing the exact value in bf16 costs up to half of it, so below it the two results
differ by less than the spacing of the numbers that hold them). Two correct bf16 computations of the
same sums differ only in order and chunking, so their errors are alike: on the CPU (128 tokens, three
token draws) the ratio was mostly 0.8-1.2 and at most 1.6 on the larger tensors (the hybrid CPU
tests hold fpdt's fp32 within twice Transformers' fp32 error on every tensor, ``tests/model/qwen35.py``);
a missing term or a kernel called wrongly gives several times that or more. A tensor of few elements is one draw of a noisy
error, though (``A_log``, ``dt_bias``: one element per value head, sums with cancellation; on the
CPU at 128 tokens their ratio ranged 0.3-5 over token draws, both ways): a tensor of ``2 <= n < 64``
elements is allowed the ratio chance exceeds once in a thousand, :func:`chance_ratio`, where that is
larger. The loss, one number, keeps ``--factor`` and the ``2**-7`` floor (chance's ratio for one
element, about 600, would pass any loss). With experts, a token whose top-k experts in bf16 differ
from float64's (a near-tie) moves its gradient from one expert to another, a change no rounding
makes: where either bf16 run moved a route in a layer (:func:`moved_routes`), that layer's expert,
router and router-input-norm gradients are judged by the moved routes, fpdt's at most ``--factor``
times plain bf16's plus 2, and their errors must be within the ratio allowed or below a bound that
only a broken expert kernel exceeds (:data:`ROUTED_BOUND`); a moved route's error is not rounding,
and with few moved routes it is one coin toss. The exit status is 1 when any quantity fails.

Measured on the CPU at 1024 tokens in 4 chunks (full small configs, PyTorch kernels): Qwen3.5 ratios
0.73-1.06 on the 64+ element tensors, 0.29-1.53 on ``A_log`` / ``dt_bias`` (allowed 3.4); Qwen3-MoE
10-19 moved routes per layer for fpdt against 16-38 for plain bf16, routed ratios 0.5-0.95.

The reference is float64 where Transformers lets it be: its RMSNorms, attention softmax and loss
round through fp32 (about ``1e-7``, the ``transformers_fp32`` column), far below bf16's ``4e-3``.

Which kernel ran is counted, not assumed: calls into fla's ``chunk_gated_delta_rule`` and fpdt's own
``chunked_delta_rule``, and ``torch._grouped_mm``, during fpdt's step (``kernels``), beside fpdt's
attention and conv kernels and what Transformers dispatched to. JSON and a markdown table go to
``benchmarks/results/<device>/<date>/model_parity-<config>.{json,md}`` (``--tiny``: ``cpu-smoke/``).

    python -m profiling.model_parity --model-config benchmarks/models/qwen3_5_small.json \\
        benchmarks/models/qwen3_moe_small.json                         # GPU: 4096 tokens, 4 chunks
    python -m profiling.model_parity --tiny --model-config benchmarks/models/qwen3_5_small.json  # CPU
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os
import sys

import torch

from fpdt.bench.parity import chance_ratio
from profiling import bench_common as bc
from profiling import strategies as st

BF16_EPS = 2.0 ** -7
ROUTED_BOUND = 0.5
"""An error a routed gradient may have where routes moved, whatever plain bf16's: on the CPU one moved
route at 128 tokens cost the router gradient up to 0.28, and 10-38 per layer at 1024 tokens cost plain
bf16's 0.15-0.34; a grouped GEMM with wrong offsets or a transposed expert weight costs order 1."""
# --tiny: the config's own layer types and routing, at test sizes
TINY = {"vocab_size": 256, "hidden_size": 64, "intermediate_size": 96, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16}
TINY_GDN = {"linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 16,
            "linear_value_head_dim": 16}
TINY_MOE = {"moe_intermediate_size": 32, "num_experts": 8, "num_experts_per_tok": 2}


def load_config(path: str, tiny: bool) -> dict:
    with open(path) as f:
        cfg = json.load(f)
    if tiny:
        cfg |= TINY | (TINY_GDN if "layer_types" in cfg else {}) | (TINY_MOE if "num_experts" in cfg else {})
    return cfg


# ----------------------------------------------------------------------------- models

def hf_model(cfg: dict, dtype: torch.dtype, device, reference: bool = False):
    """Transformers' causal LM of ``cfg`` in ``dtype``; ``reference``: eager attention and experts."""
    from transformers import AutoConfig, AutoModelForCausalLM
    hf_cfg = AutoConfig.for_model(cfg["model_type"], **{k: v for k, v in cfg.items()
                                                        if k not in ("architectures", "model_type")})
    if reference:
        hf_cfg._attn_implementation = "eager"
        hf_cfg._experts_implementation = "eager"
    model = AutoModelForCausalLM.from_config(hf_cfg).to(device=device, dtype=dtype)
    model.config.use_cache = False
    return model.train()


def bf16_weights(cfg: dict) -> dict:
    """Seeded Transformers init with norms, ``A_log``, ``dt_bias`` moved off their init, as bf16
    (exactly representable in fp32 and float64, so every run holds the same values)."""
    torch.manual_seed(0)
    model = hf_model(cfg, torch.float32, "cpu")
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith(("norm.weight", "dt_bias", "A_log")):
                p.add_(0.1 * torch.randn_like(p))
    return {k: v.to(torch.bfloat16) for k, v in model.state_dict().items()}


def float64_delta_rule(query, key, value, g, beta, chunk_size=64, initial_state=None, output_final_state=False,
                       use_qk_l2norm_in_kernel=False, **kwargs):
    """Transformers' ``torch_chunk_gated_delta_rule`` contract in float64, one token at a time:
    ``S <- e^g S; S += beta k (v - S^T k)^T; o = S^T q / sqrt(dk)`` per value head. ``query``, ``key``
    ``[B, T, Hk, dk]``, ``value`` ``[B, T, HV, dv]``, ``g``, ``beta`` ``[B, T, HV]``. Each block of
    ``chunk_size`` tokens is checkpointed, so backward keeps one state per block, not per token."""
    from torch.utils.checkpoint import checkpoint
    if query.dtype != torch.float64:
        raise TypeError(f"the reference delta rule runs float64 inputs only, got {query.dtype}")
    if use_qk_l2norm_in_kernel:          # Transformers' l2norm (eps 1e-6 inside the root)
        query, key = (x * torch.rsqrt((x * x).sum(-1, keepdim=True) + 1e-6) for x in (query, key))
    repeat = value.shape[2] // key.shape[2]
    q = query.repeat_interleave(repeat, dim=2) * query.shape[-1] ** -0.5
    k = key.repeat_interleave(repeat, dim=2)
    B, T, H, dk = q.shape
    S = q.new_zeros(B, H, dk, value.shape[-1]) if initial_state is None else initial_state.double()
    outs = []
    for s in range(0, T, chunk_size):
        block = (x[:, s:s + chunk_size] for x in (q, k, value, g, beta))
        o, S = checkpoint(_token_steps, S, *block, use_reentrant=False)
        outs.append(o)
    return torch.cat(outs, 1), S if output_final_state else None


def _token_steps(S, q, k, v, g, beta):
    """``S`` ``[B, H, dk, dv]``, ``q``, ``k`` ``[B, n, H, dk]``, ``v`` ``[B, n, H, dv]``, ``g``, ``beta``
    ``[B, n, H]`` -> ``(o [B, n, H, dv], S)``."""
    outs = []
    for t in range(q.shape[1]):
        k_t = k[:, t, :, None, :]                                      # [B, H, 1, dk]
        S = S * g[:, t].exp()[..., None, None]
        err = v[:, t, :, None, :] - k_t @ S                            # [B, H, 1, dv]
        S = S + k_t.transpose(-1, -2) @ (beta[:, t, :, None, None] * err)
        outs.append((q[:, t, :, None, :] @ S).squeeze(-2))
    return torch.stack(outs, 1), S


@contextlib.contextmanager
def patched(owner, attr: str, fn):
    saved = getattr(owner, attr)
    setattr(owner, attr, fn)
    try:
        yield
    finally:
        setattr(owner, attr, saved)


@contextlib.contextmanager
def counting(targets: dict):
    """``{label: (owner, attr)}``: count calls of each ``owner.attr`` inside the block -> ``{label: n}``."""
    counts = dict.fromkeys(targets, 0)
    with contextlib.ExitStack() as stack:
        for label, (owner, attr) in targets.items():
            def wrapped(*args, _fn=getattr(owner, attr), _label=label, **kwargs):
                counts[_label] += 1
                return _fn(*args, **kwargs)
            stack.enter_context(patched(owner, attr, wrapped))
        yield counts


def hf_step(model, ids: torch.Tensor):
    """``(loss, {name: grad}, {MoE layer: tokens per expert [E]})`` of one forward + backward of a
    Transformers model (the counts are the top-k of its router logits; empty without experts)."""
    moe = getattr(model.config, "num_experts", 0)
    out = model(input_ids=ids, labels=ids, use_cache=False, **({"output_router_logits": True} if moe else {}))
    out.loss.backward()
    counts = {}
    if moe:
        layers = [i for i, layer in enumerate(model.model.layers) if hasattr(layer.mlp, "experts")]
        for i, logits in zip(layers, out.router_logits):
            top = logits.detach().topk(model.config.num_experts_per_tok, dim=-1).indices
            counts[i] = torch.bincount(top.flatten(), minlength=moe).cpu()
    return out.loss.detach(), {n: p.grad for n, p in model.named_parameters()}, counts


def reference_step(cfg: dict, weights: dict, ids: torch.Tensor):
    model = hf_model(cfg, torch.float64, ids.device, reference=True)
    model.load_state_dict({k: v.double() for k, v in weights.items()})
    module = sys.modules[type(model).__module__]
    ctx = patched(module, "torch_chunk_gated_delta_rule", float64_delta_rule) \
        if hasattr(module, "torch_chunk_gated_delta_rule") else contextlib.nullcontext()
    with ctx:
        return hf_step(model, ids)


def transformers_step(cfg: dict, weights: dict, ids: torch.Tensor, dtype: torch.dtype):
    """Transformers on its default kernels; also the kernels it ran. Its PyTorch delta rule is the
    only caller of the module's ``l2norm`` (twice a call): no such call means fla's kernel ran."""
    model = hf_model(cfg, dtype, ids.device)
    model.load_state_dict({k: v.to(dtype) for k, v in weights.items()})
    module = sys.modules[type(model).__module__]
    targets = {name: (owner, name) for owner, name in ((torch, "_grouped_mm"), (torch.nn.functional, "grouped_mm"))
               if hasattr(owner, name)}
    gdn = "layer_types" in cfg and hasattr(module, "l2norm")
    if gdn:
        targets["l2norm"] = (module, "l2norm")
    with counting(targets) as calls:
        loss, grads, counts = hf_step(model, ids)
    kernels = {"attention": st.attention_kernel("hf", cfg, ids.device, dtype),
               "experts": getattr(model.config, "_experts_implementation", None) if "num_experts" in cfg else None}
    if gdn:
        fallback = calls.pop("l2norm") // 2
        kernels.update({"delta_rule": "torch" if fallback else "fla", "delta_rule:torch": fallback})
    return loss, grads, counts, {**kernels, **calls}


def fpdt_step(cfg: dict, weights: dict, ids: torch.Tensor, chunk: int, perturb: str | None):
    """fpdt in bf16 as the ``fpdt`` strategy builds it; the kernels it ran, counted."""
    import fpdt.model as fm
    from fpdt.ops import delta_rule
    from fpdt.ops.causal_conv import conv_kernel
    device, S = ids.device, ids.shape[1]
    model = fm.from_config(cfg, device=device, dtype=torch.bfloat16, num_chunks=S // chunk, offload=True,
                           checkpointing="offload", lm_head_wgrad=st.LM_HEAD_WGRAD)
    fm.load_hf_state_dict(model, {k: v.to(device) for k, v in weights.items()})
    if perturb:                               # tests: a defect the criterion must catch
        params = dict(model.named_parameters())
        if perturb not in params:
            raise SystemExit(f"--perturb {perturb}: no such parameter in this model (one of {', '.join(params)})")
        p = params[perturb]
        with torch.no_grad():
            p.add_(0.05 * p.float().pow(2).mean().sqrt() * torch.randn_like(p.float()).to(p.dtype))
    targets = {"delta_rule:torch": (delta_rule, "chunked_delta_rule")}
    if delta_rule.delta_rule_kernel(device) == "fla":
        targets["delta_rule:fla"] = (importlib.import_module("fla.ops.gated_delta_rule"), "chunk_gated_delta_rule")
    if hasattr(torch, "_grouped_mm"):
        targets["grouped_mm"] = (torch, "_grouped_mm")
    with counting(targets) as calls:
        loss = model(**model.prepare_inputs(ids, labels=ids))
        loss.backward()
    kernels = {"attention": st.attention_kernel("fpdt", cfg, device, torch.bfloat16),
               "conv": conv_kernel(device) if "layer_types" in cfg else None, **calls}
    counts = {i: c.cpu() for i, c in model.router_stats.layer_counts().items()} if "num_experts" in cfg else {}
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}, counts, kernels


# ----------------------------------------------------------------------------- comparison

def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    """``||x - ref|| / ||ref||`` in float64 (``||x||`` when ``ref`` is 0)."""
    x, ref = x.detach().double(), ref.detach().double().to(x.device)
    scale = ref.norm().item()
    return (x - ref).norm().item() / scale if scale > 0 else x.norm().item()


def moved_routes(counts: dict, ref_counts: dict) -> dict:
    """Per MoE layer, tokens whose experts differ from the reference's, at least: half the summed
    ``|count - reference count|`` over experts (a token moved from expert a to b changes two counts)."""
    return {i: int((c.long() - ref_counts[i].long()).abs().sum()) // 2 for i, c in counts.items()}


def routed(name: str, layer: int) -> bool:
    """Whether gradient ``name`` belongs to MoE layer ``layer``'s routed part (experts, router, its input norm)."""
    return name.startswith((f"model.layers.{layer}.mlp.", f"model.layers.{layer}.post_attention_layernorm."))


def judge(row: dict, factor: float, allowed: float, moves: tuple[int, int] | None) -> bool:
    """One quantity's verdict (module docstring): the error rule, or where a route moved, fpdt's moved
    routes at most ``factor`` times plain bf16's plus 2, and its error within ``allowed`` times plain
    bf16's or below :data:`ROUTED_BOUND`."""
    if moves is not None and max(moves) > 0:
        return moves[0] <= factor * moves[1] + 2 and row["fpdt"] <= max(allowed * row["transformers_bf16"], ROUTED_BOUND)
    return row["fpdt"] <= max(allowed * row["transformers_bf16"], BF16_EPS)


def compare(runs: dict, factor: float, moves: dict) -> dict:
    """``runs``: ``{name: (loss, grads)}`` with ``reference``, ``transformers_fp32``, ``transformers_bf16``,
    ``fpdt``; ``moves``: ``{run: {MoE layer: moved routes}}``. Per quantity the three errors, the ratio
    fpdt / bf16, the ratio allowed, the moved routes where it is routed, and whether it passes."""
    (ref_loss, ref_grads) = runs["reference"]
    missing = set(ref_grads) ^ set(runs["fpdt"][1])
    if missing:
        raise SystemExit(f"fpdt's parameters differ from Transformers' by name: {sorted(missing)}")
    rows = {}
    for name in ["loss", *ref_grads]:
        errs = {"transformers_fp32": None}
        errs.update({run: rel_err(loss if name == "loss" else grads[name], ref_loss if name == "loss" else ref_grads[name])
                     for run, (loss, grads) in runs.items() if run != "reference"})
        n = 1 if name == "loss" else ref_grads[name].numel()
        allowed = max(factor, chance_ratio(n)) if 1 < n < 64 else factor
        plain = errs["transformers_bf16"]
        row = {**errs, "ratio": errs["fpdt"] / plain if plain > 0 else float("inf"), "allowed_ratio": allowed,
               "elements": n}
        layer = next((i for i in moves.get("fpdt", {}) if routed(name, i)), None)
        if layer is not None:
            row["moved_routes"] = (moves["fpdt"][layer], moves["transformers_bf16"][layer])
        row["pass"] = judge(row, factor, allowed, row.get("moved_routes"))
        rows[name] = row
    return rows


def verdict(row: dict) -> str:
    moves = row.get("moved_routes")
    by_routes = f" (moved routes {moves[0]} / {moves[1]})" if moves and max(moves) > 0 else ""
    return ("yes" if row["pass"] else "**no**") + by_routes


def markdown(result: dict) -> str:
    k = result["kernels"]
    lines = [f"# Parity: {result['config']} ({result['model']['model_type']}), {result['seq_len']} tokens, "
             f"{result['num_chunks']} chunks, {result['device']}", "",
             f"Errors `||x - ref|| / ||ref||` against Transformers in float64. Pass: fpdt <= {result['factor']:g} x "
             "Transformers bf16 (more for tensors of few elements: the allowed ratio), or <= 2^-7. "
             f"**{'PASS' if result['pass'] else 'FAIL'}** (closest to its limit: {result['worst']}, "
             f"ratio {result['worst_ratio']:.2f}).", "",
             f"- fpdt kernels: {json.dumps(k['fpdt'])}", f"- Transformers bf16 kernels: {json.dumps(k['transformers_bf16'])}",
             f"- moved routes per MoE layer (tokens whose experts differ from float64's): {json.dumps(result['moved_routes'])}",
             "", "| quantity | elements | fpdt bf16 | Transformers bf16 | fpdt / bf16 (allowed) | Transformers fp32 | pass |",
             "|---|---|---|---|---|---|---|"]
    for name, r in result["quantities"].items():
        fp32 = "-" if r["transformers_fp32"] is None else f"{r['transformers_fp32']:.2e}"
        lines.append(f"| {name} | {r['elements']} | {r['fpdt']:.2e} | {r['transformers_bf16']:.2e} | {r['ratio']:.2f} "
                     f"({r['allowed_ratio']:.1f}) | {fp32} | {verdict(r)} |")
    return "\n".join(lines) + "\n"


def run(path: str, args, device: torch.device) -> dict:
    cfg = load_config(path, args.tiny)
    if args.seq_len % args.chunk_size:
        raise SystemExit(f"--seq-len {args.seq_len} is not a multiple of --chunk-size {args.chunk_size}")
    weights = bf16_weights(cfg)
    ids = torch.randint(0, cfg["vocab_size"], (1, args.seq_len), generator=torch.Generator().manual_seed(1)).to(device)
    *ref, ref_counts = reference_step(cfg, weights, ids)
    runs, kernels, counts = {"reference": ref}, {}, {}
    try:        # the fp32 column only vouches for the reference: its failure must not cost the comparison
        *runs["transformers_fp32"], counts["transformers_fp32"], kernels["transformers_fp32"] = \
            transformers_step(cfg, weights, ids, torch.float32)
    except Exception as exc:        # e.g. a Triton kernel without an fp32 variant
        kernels["transformers_fp32"] = {"error": f"{type(exc).__name__}: {exc}"[:500]}
    *runs["transformers_bf16"], counts["transformers_bf16"], kernels["transformers_bf16"] = \
        transformers_step(cfg, weights, ids, torch.bfloat16)
    *runs["fpdt"], counts["fpdt"], kernels["fpdt"] = fpdt_step(cfg, weights, ids, args.chunk_size, args.perturb)
    moves = {run: moved_routes(c, ref_counts) for run, c in counts.items() if c}
    rows = compare(runs, args.factor, moves)
    worst = max(rows, key=lambda n: 0.0 if max(rows[n].get("moved_routes", (0,))) else
                rows[n]["ratio"] / rows[n]["allowed_ratio"])
    tag = os.path.splitext(os.path.basename(path))[0]
    return {**bc.header("model_parity", args), "config": tag, "model": cfg, "seq_len": args.seq_len,
            "num_chunks": args.seq_len // args.chunk_size, "factor": args.factor, "kernels": kernels,
            "moved_routes": moves,
            "pass": all(r["pass"] for r in rows.values()), "worst": worst, "worst_ratio": rows[worst]["ratio"],
            "quantities": rows}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-config", nargs="+", required=True, help="config.json file(s), one parity run each")
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--chunk-size", type=int, default=1024, help="fpdt's chunk: seq-len / chunk-size chunks")
    p.add_argument("--factor", type=float, default=2.0, help="fpdt's error may be this many times plain bf16's")
    p.add_argument("--device", help="default: cuda where available, else cpu")
    p.add_argument("--tiny", action="store_true", help="test-sized model (128 tokens, 4 chunks), results in cpu-smoke/")
    p.add_argument("--out-dir", help="write here instead of benchmarks/results/<device>/<date>")
    p.add_argument("--threads", type=int, help="torch's CPU threads (--tiny: 1; its ops are too small to share, "
                                               "and on a busy machine each shared op waits for both cores)")
    p.add_argument("--perturb", metavar="PARAM", help="tests only: noise on fpdt's copy of PARAM (5%% of its RMS)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.tiny:
        args.seq_len, args.chunk_size = min(args.seq_len, 128), min(args.chunk_size, 32)
    if args.threads or args.tiny:
        torch.set_num_threads(args.threads or 1)
    device = torch.device(args.device) if args.device else torch.device("cuda" if torch.cuda.is_available() else "cpu")
    out_dir = bc.results_dir(args.tiny, args.out_dir, device)
    failed = []
    for path in args.model_config:
        result = run(path, args, device)
        base = os.path.join(out_dir, f"model_parity-{result['config']}")
        bc.write_json(base + ".json", result)
        with open(base + ".md", "w") as f:
            f.write(markdown(result))
        print(f"{result['config']}: {'pass' if result['pass'] else 'FAIL'}, closest to its limit {result['worst']} "
              f"(fpdt / bf16 {result['worst_ratio']:.2f}); fpdt kernels {result['kernels']['fpdt']}; "
              f"wrote {os.path.relpath(base, bc.ROOT)}.md")
        if not result["pass"]:
            failed += [f"{result['config']}:{n}" for n, r in result["quantities"].items() if not r["pass"]]
    if failed:
        print(f"model_parity: fpdt fails the criterion (error within {args.factor:g}x plain bf16's, the module "
              f"docstring) on {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
