"""Qwen3.5 (Gated DeltaNet + gated attention layers) through fpdt.model against Transformers: loss and
every gradient, fp32 against a float64 Transformers run (``tests/model/qwen35.py``), on plain windows,
packed documents, layer checkpoints (offload on the simulated runtime, saved attention outputs), 1, 2
and 4 ranks; one decoder layer of each kind with random output gradients; both checkpoint layouts in,
Transformers' ``Qwen3_5ForCausalLM`` out."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist
import transformers

import fpdt.model as fm
from fpdt.comm import SequenceMesh
from fpdt.model.llama import check_token_mixers
from fpdt.options import FPDTOptions
from tests.distributed import run_distributed
from tests.model.helpers import rel_err, tokens
from tests.model.qwen35 import check_decoder_layer, compare_hybrid, fpdt_qwen35, qwen35_model, reference

# (num_chunks, offload, checkpointing, attention_checkpoint)
CASES = [(1, False, "off", "recompute"), (2, True, "off", "recompute"), (2, False, "on", "recompute"),
         (3, True, "offload", "recompute"), (2, True, "offload", "save"), (1, False, "on", "save")]


def run_case(name, rank, world, *, num_chunks, offload, checkpointing, attention_checkpoint="recompute",
             rows=None, B=2, mesh=None, nvme_path=None):
    """One step of ``name`` on this rank; parity of the loss and of the SP-summed gradients."""
    ref = qwen35_model(name)
    if rows is None:
        S = 4 * world * num_chunks
        ids, labels = tokens(ref.config.vocab_size, B, S)
        pos = None
    else:
        S = sum(rows[0])
        ids, labels = tokens(ref.config.vocab_size, len(rows), S, seed=5)
        pos = torch.stack([torch.cat([torch.arange(n) for n in r]) for r in rows])
    refs = reference(ref, ids, labels, rows)
    runtime = "sim" if offload or checkpointing == "offload" else None
    model = fpdt_qwen35(ref, num_chunks=num_chunks, offload=offload, checkpointing=checkpointing,
                        attention_checkpoint=attention_checkpoint, runtime=runtime, mesh=mesh, nvme_path=nvme_path,
                        group=None if mesh is not None or world == 1 else dist.group.WORLD)
    loss = model(**model.prepare_inputs(ids, labels=labels, position_ids=pos))
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    if world > 1:
        for g in grads.values():
            dist.all_reduce(g)
    what = (f"{name} rank {rank}/{world} u={num_chunks} offload={offload} ckpt={checkpointing} "
            f"attn_ckpt={attention_checkpoint} rows={rows}")
    return compare_hybrid(loss, grads, refs, what)


@pytest.mark.parametrize("num_chunks,offload,checkpointing,attention_checkpoint", CASES)
def test_single_rank(num_chunks, offload, checkpointing, attention_checkpoint):
    run_case("qwen35", 0, 1, num_chunks=num_chunks, offload=offload, checkpointing=checkpointing,
             attention_checkpoint=attention_checkpoint)


def test_nvme_tier(tmp_path):
    """The offloaded layer inputs (and the saved attention outputs) on files: the same loss and gradients."""
    run_case("qwen35", 0, 1, num_chunks=2, offload=True, checkpointing="offload", attention_checkpoint="save",
             nvme_path=str(tmp_path))


ROWS = ([5, 1, 13, 1, 1, 20, 7], [16, 16, 16], [2, 30, 9, 7])    # 48 tokens: across chunk and rank edges


@pytest.mark.parametrize("num_chunks,checkpointing", [(1, "off"), (3, "offload")])
def test_packed_documents_equal_each_alone(num_chunks, checkpointing):
    run_case("qwen35", 0, 1, num_chunks=num_chunks, offload=checkpointing == "offload", checkpointing=checkpointing,
             rows=ROWS)


def _multi_rank(rank, world, cases):
    for name, kwargs in cases:
        run_case(name, rank, world, **kwargs)


@pytest.mark.slow
def test_two_ranks():
    run_distributed(_multi_rank, 2, args=([
        ("qwen35", dict(num_chunks=1, offload=False, checkpointing="off")),
        ("qwen35", dict(num_chunks=2, offload=True, checkpointing="offload", attention_checkpoint="save")),
        ("qwen35", dict(num_chunks=2, offload=False, checkpointing="on", rows=ROWS)),
    ],), timeout=600)


@pytest.mark.slow
def test_four_ranks():
    run_distributed(_multi_rank, 4, args=([
        ("qwen35_sp4", dict(num_chunks=1, offload=False, checkpointing="off")),
        ("qwen35_sp4", dict(num_chunks=2, offload=True, checkpointing="offload", attention_checkpoint="save")),
        ("qwen35_sp4", dict(num_chunks=1, offload=False, checkpointing="on", rows=ROWS[:2])),
    ],), timeout=600)


@pytest.mark.parametrize("layer", [0, 3])
def test_decoder_layer_random_output_gradient(layer):
    """One layer of each kind (0: Gated DeltaNet, 3: gated attention), u = 2 chunks with offload,
    against Transformers' ``Qwen3_5DecoderLayer`` with a causal mask: output, input gradient and
    parameter gradients for a random output gradient."""
    ref_model = qwen35_model()
    ours_model = fpdt_qwen35(ref_model, num_chunks=2, offload=True, runtime="sim")
    check_decoder_layer(ref_model, ours_model, layer)


def _conditional(ref, path):
    """``ref``'s text model saved in the hub's vision-language layout (a tiny vision tower beside it)."""
    text = ref.config.to_dict()
    cfg = transformers.Qwen3_5Config(text_config=text, tie_word_embeddings=ref.config.tie_word_embeddings,
                                     vision_config=dict(depth=1, hidden_size=32, num_heads=2, intermediate_size=32,
                                                        out_hidden_size=ref.config.hidden_size))
    model = transformers.Qwen3_5ForConditionalGeneration(cfg)
    model.model.language_model.load_state_dict(ref.model.state_dict())
    model.lm_head.load_state_dict(ref.lm_head.state_dict())
    model.save_pretrained(path)
    return model


@pytest.mark.parametrize("name", ["qwen35", "qwen35_sp4"])
def test_both_layouts_in_causal_lm_out(name, tmp_path):
    """from_pretrained of a Qwen3_5ForCausalLM and of a Qwen3_5ForConditionalGeneration checkpoint gives
    the same parameters; save_pretrained writes a Qwen3_5ForCausalLM checkpoint that Transformers loads
    with the same logits."""
    ref = qwen35_model(name)
    ref.save_pretrained(tmp_path / "text")
    _conditional(ref, tmp_path / "vl")
    ids = torch.randint(0, ref.config.vocab_size, (2, 16))
    ref_logits = ref(input_ids=ids, use_cache=False).logits
    want = dict(ref.state_dict())
    for layout in ("text", "vl"):
        model = fm.from_pretrained(tmp_path / layout, num_chunks=2)
        got = dict(model.state_dict())
        assert set(got) == set(want), layout
        assert all(torch.equal(got[k], want[k]) for k in got), layout
        _, logits = model(**{k: v for k, v in model.prepare_inputs(ids).items() if k != "labels"}, return_logits=True)
        assert rel_err(logits, ref_logits) <= 1e-5, layout
        model.save_pretrained(tmp_path / f"out-{layout}")
        back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / f"out-{layout}")
        assert type(back) is transformers.Qwen3_5ForCausalLM
        assert rel_err(back(input_ids=ids, use_cache=False).logits, ref_logits) <= 1e-5, layout


def test_refused_options():
    ref = qwen35_model()
    mesh = SequenceMesh.__new__(SequenceMesh)        # only its degrees are read
    mesh.hp, mesh.cp = 1, 2
    with pytest.raises(ValueError, match="context-parallel ring .cp=2. is not implemented for Gated DeltaNet"):
        check_token_mixers(fm.ModelConfig.from_hf(ref.config), dataclasses.replace(FPDTOptions(), mesh=mesh))
