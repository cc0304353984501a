"""``stream_layers`` through :func:`fpdt.hf.apply_fpdt`: the streamed run of ``fpdt.model``
(:mod:`fpdt.model.streaming`) on a Transformers model's own modules.

Loss and every gradient against the same model unstreamed (fp32, within 1e-5, the loss scaled by a
random factor) and against plain Transformers; 1 and 2 ranks, GQA / MHA with biases / tied Qwen2 /
Qwen3's q/k norms, both attention checkpoints, packed documents, PEFT LoRA, Transformers' own MLP
and norms; Qwen3.5, Qwen3-MoE and Qwen3-Next against Transformers; refusals; ``remove_fpdt``; the
device peak flat in the sequence (counted).
"""

from __future__ import annotations

import gc

import pytest
import torch
import torch.distributed as dist
import transformers

import fpdt.hf
from fpdt.memory.accountant import MemoryAccountant
from tests.distributed import run_distributed
from tests.hf.test_apply_fpdt import _qwen3, _rope_variant
from tests.hf.test_peft import lora_config, peft_model
from tests.model.helpers import compare, hf_loss_and_grads, hf_model, tokens

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning")

STREAMED = dict(offload=True, checkpointing="offload", runtime="sim")


def _model(name: str):
    return _qwen3() if name == "qwen3" else hf_model(name)


def _step(model, inputs: dict, scale: torch.Tensor):
    model.zero_grad(set_to_none=True)
    loss = model(**inputs).loss
    (loss * scale).backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    if dist.is_initialized() and dist.get_world_size() > 1:
        for g in grads.values():
            dist.all_reduce(g)
    return loss.detach(), grads


def check_parity(name: str, S: int, what: str, *, B: int = 2, docs: bool = False, lora: bool = False,
                 apply: dict | None = None, **options):
    """The same weights streamed and not, through apply_fpdt."""
    pair = []
    for stream in (False, True):
        model = peft_model(name, lora_config(dropout=0.0)) if lora else _model(name)
        fpdt.hf.apply_fpdt(model, **STREAMED, **options, **(apply or {}), stream_layers=stream)
        model.train()
        pair.append(model)
    ids, labels = tokens(pair[0].config.vocab_size, B, S)
    position_ids = None
    if docs:    # three packed documents per row, one of a single token
        cuts = [0, S // 3, S // 3 + 1, S]
        position_ids = torch.cat([torch.arange(b - a) for a, b in zip(cuts, cuts[1:])]).expand(B, S)
    inputs = fpdt.hf.prepare_inputs(pair[0], ids, labels=labels, position_ids=position_ids)
    scale = torch.randn((), generator=torch.Generator().manual_seed(S)) + 2.0
    ref = _step(pair[0], inputs, scale)
    got = _step(pair[1], inputs, scale)
    assert got[1].keys() == ref[1].keys() and got[1]
    compare(*got, *ref, f"apply_fpdt streamed vs not: {what}")


@pytest.mark.parametrize("name,u,save", [
    ("llama_gqa", 3, "recompute"),
    ("qwen2_tied", 2, "save"),
    ("llama_bias", 1, "recompute"),
    ("mistral", 4, "save"),
    ("qwen3", 2, "recompute"),
])
def test_single_rank_parity(name, u, save):
    check_parity(name, 8 * u, f"{name} u={u} {save}", num_chunks=u, attention_checkpoint=save)


@pytest.mark.parametrize("save", ["recompute", "save"])
def test_packed_documents(save):
    check_parity("llama_gqa", 24, f"packed documents {save}", docs=True, num_chunks=3, attention_checkpoint=save)


def test_peft_lora():
    check_parity("llama_gqa", 16, "PEFT LoRA on every linear", lora=True, num_chunks=2)


def test_transformers_own_mlp_and_norms():
    """mlp_chunks=0 and lean_norms=False keep Transformers' MLP and RMSNorm classes; streamed, they run
    a chunk at a time as modules."""
    check_parity("llama_gqa", 16, "HF MLP and norms", num_chunks=2, mlp_chunks=0, apply=dict(lean_norms=False))


def test_against_plain_transformers():
    ref = hf_model("mistral")
    model = fpdt.hf.apply_fpdt(hf_model("mistral"), **STREAMED, num_chunks=2, stream_layers=True)
    model.train()
    ids, labels = tokens(ref.config.vocab_size, 2, 16)
    ref_loss, ref_grads = hf_loss_and_grads(ref, ids, labels)
    model.zero_grad(set_to_none=True)
    loss = model(**fpdt.hf.prepare_inputs(model, ids, labels=labels)).loss
    loss.backward()
    compare(loss, {n: p.grad for n, p in model.named_parameters()}, ref_loss, ref_grads, "streamed vs Transformers")


def test_qwen35_against_transformers():
    """Qwen3.5 (Gated DeltaNet, gated attention, zero-centred norms) streamed through apply_fpdt, packed
    documents, saved attention outputs: fp32 against a float64 Transformers run (``tests/model/qwen35.py``)."""
    import copy

    from tests.model.qwen35 import compare_hybrid, qwen35_model, reference
    rows = ([5, 1, 13, 1, 1, 20, 7], [16, 16, 16])
    ref = qwen35_model()
    ids, labels = tokens(ref.config.vocab_size, 2, 48, seed=5)
    pos = torch.stack([torch.cat([torch.arange(n) for n in r]) for r in rows])
    refs = reference(ref, ids, labels, rows, scale=1.7)
    model = fpdt.hf.apply_fpdt(copy.deepcopy(ref).train(), **STREAMED, num_chunks=3, attention_checkpoint="save",
                               stream_layers=True)
    loss = model(**fpdt.hf.prepare_inputs(model, ids, labels=labels, position_ids=pos)).loss
    (loss * 1.7).backward()
    compare_hybrid(loss.detach(), {n: p.grad / 1.7 for n, p in model.named_parameters()}, refs, "hf qwen3.5 streamed")


def test_qwen35_with_transformers_own_mlp_and_zero_centred_norms():
    """mlp_chunks=0 and lean_norms=False: Transformers' MLP and its zero-centred RMSNorm classes, streamed."""
    import copy

    from tests.model.qwen35 import compare_hybrid, qwen35_model, reference
    ref = qwen35_model()
    ids, labels = tokens(ref.config.vocab_size, 2, 12)
    refs = reference(ref, ids, labels)
    model = fpdt.hf.apply_fpdt(copy.deepcopy(ref).train(), **STREAMED, num_chunks=3, mlp_chunks=0, lean_norms=False,
                               stream_layers=True)
    loss = model(**fpdt.hf.prepare_inputs(model, ids, labels=labels)).loss
    loss.backward()
    compare_hybrid(loss.detach(), {n: p.grad for n, p in model.named_parameters()}, refs, "hf qwen3.5 own modules")


def test_qwen3_moe_against_transformers():
    """Qwen3-MoE streamed through apply_fpdt: the balancing loss and every gradient against Transformers."""
    from tests.model.test_moe_model import hf_moe
    ref, model = hf_moe(), hf_moe()
    ids, labels = tokens(ref.config.vocab_size, 2, 16)
    ref_loss, ref_grads = hf_loss_and_grads(ref, ids, labels)
    fpdt.hf.apply_fpdt(model, **STREAMED, num_chunks=2, mlp_chunks=3, stream_layers=True)
    model.train()
    loss = model(**fpdt.hf.prepare_inputs(model, ids, labels=labels)).loss
    loss.backward()
    compare(loss, {n: p.grad for n, p in model.named_parameters()}, ref_loss, ref_grads, "hf qwen3_moe streamed")
    assert sorted(model.router_stats.expert_load()) == [0, 2]


def test_qwen3_next_against_transformers():
    """Qwen3-Next streamed through apply_fpdt: its fused Gated DeltaNet projections (the streamed
    backward follows the regrouping to ``in_proj_qkvz`` / ``in_proj_ba``), experts with the shared
    expert and a dense layer; fp32 against a float64 Transformers run."""
    import copy

    from tests.model.hybrid_moe import hybrid_moe_model
    from tests.model.qwen35 import compare_hybrid, reference
    ref = hybrid_moe_model("qwen3next_odd")
    ids, labels = tokens(ref.config.vocab_size, 2, 12)
    refs = reference(ref, ids, labels, scale=1.7)
    model = fpdt.hf.apply_fpdt(copy.deepcopy(ref).train(), **STREAMED, num_chunks=3, stream_layers=True)
    loss = model(**fpdt.hf.prepare_inputs(model, ids, labels=labels)).loss
    (loss * 1.7).backward()
    compare_hybrid(loss.detach(), {n: p.grad / 1.7 for n, p in model.named_parameters()}, refs, "hf qwen3-next streamed")


def _two_ranks(rank, world):
    check_parity("llama_gqa", 32, f"rank {rank}/{world}", num_chunks=2, attention_checkpoint="save", docs=True)
    check_parity("qwen2_tied", 16, f"rank {rank}/{world} LoRA", num_chunks=2, lora=True)


@pytest.mark.slow
def test_two_ranks():
    run_distributed(_two_ranks, 2, timeout=300)


def test_refusals_name_the_fix():
    with pytest.raises(fpdt.hf.FPDTHFError, match="keep chunked_qkv=True"):
        fpdt.hf.apply_fpdt(hf_model("llama_gqa"), **STREAMED, stream_layers=True, chunked_qkv=False)
    with pytest.raises(fpdt.hf.FPDTHFError, match="stream_layers=False"):
        fpdt.hf.apply_fpdt(_rope_variant("llama_dynamic"), **STREAMED, stream_layers=True)
    with pytest.raises(fpdt.hf.FPDTHFError, match="checkpointing='offload'"):
        fpdt.hf.apply_fpdt(hf_model("llama_gqa"), offload=True, runtime="sim", stream_layers=True)
    model = fpdt.hf.apply_fpdt(hf_model("llama_gqa"), **STREAMED, num_chunks=2, stream_layers=True)
    ids, labels = tokens(model.config.vocab_size, 1, 16)
    with pytest.raises(fpdt.hf.FPDTHFError, match="input_ids and labels"):
        model(input_ids=ids)
    with pytest.raises(fpdt.hf.FPDTHFError, match="input_ids and labels"):
        model(inputs_embeds=model.model.embed_tokens(ids), labels=labels)


def test_remove_fpdt_restores_the_modules():
    model = hf_model("llama_gqa")
    modules = dict(model.named_modules())
    fpdt.hf.apply_fpdt(model, **STREAMED, num_chunks=2, stream_layers=True)
    fpdt.hf.remove_fpdt(model)
    assert dict(model.named_modules()) == modules
    assert not any("_z3_leaf" in m.__dict__ or "forward" in m.__dict__ for m in model.modules())


CONFIG = dict(vocab_size=512, hidden_size=256, intermediate_size=704, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=1, head_dim=64, max_position_embeddings=1 << 16, tie_word_embeddings=False)


def _device_peak(seq: int, chunk: int) -> int:
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**CONFIG)).to(torch.bfloat16)
    fpdt.hf.apply_fpdt(model, **STREAMED, num_chunks=seq // chunk, stream_layers=True)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    ids, labels = tokens(CONFIG["vocab_size"], 1, seq)
    inputs = fpdt.hf.prepare_inputs(model, ids, labels=labels)
    model(**inputs).loss.backward()          # first-use kernel checks outside the count
    gc.collect()
    with MemoryAccountant("cpu") as acct:
        loss = model(**inputs).loss
        loss.backward()
        del loss
    return acct.device_peak


def test_device_peak_is_flat_in_the_sequence():
    """The same chunk (256 tokens, u = 4 and 8) at twice the sequence: the same device peak (the
    integer inputs, 8 bytes a token each, are all that may grow: within 1%)."""
    short, long = _device_peak(1024, 256), _device_peak(2048, 256)
    assert long <= 1.01 * short, (short, long)


@pytest.mark.parametrize("stream", [False, True])
def test_nvme_tier_is_bit_identical(tmp_path, stream):
    """``nvme_path`` through apply_fpdt (the layer inputs, saved attention outputs and, streamed, the
    residual stream on disk): loss and every gradient equal to the host-only run's, bit for bit."""
    import warnings

    ids, labels = tokens(256, 2, 24)
    runs = []
    for nvme in (None, str(tmp_path)):
        model = hf_model("llama_gqa")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")           # tmp_path may be on tmpfs
            fpdt.hf.apply_fpdt(model, **STREAMED, num_chunks=3, attention_checkpoint="save", stream_layers=stream,
                               nvme_path=nvme)
            model.train()
            loss = model(**fpdt.hf.prepare_inputs(model, ids, labels=labels)).loss
            loss.backward()
        runs.append((loss.detach(), {n: p.grad for n, p in model.named_parameters()}))
    (loss, grads), (ref_loss, ref_grads) = runs[1], runs[0]
    assert torch.equal(loss, ref_loss)
    assert grads.keys() == ref_grads.keys() and all(torch.equal(grads[n], ref_grads[n]) for n in grads)
    from fpdt.hf.settings import layer_checkpoints_of
    store = layer_checkpoints_of(model.model.layers).nvme_store()
    assert store.bytes_written > 0          # the tier was used
    store.close()
    assert not [f for f in tmp_path.rglob("*") if f.is_file() and not f.name.startswith(".")], \
        list(tmp_path.rglob("*"))
