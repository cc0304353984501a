"""``fpdt.hf.FlatteningCollator``: Transformers' ``DataCollatorWithFlattening`` batches of any length
through ``fpdt.hf``, padded by one padding document (positions from 0, labels -100) to a length
fpdt's layout cuts. Against plain Transformers on the unpadded batch (loss and every gradient,
fp32 within 1e-5), and under the real ``Trainer`` with the real collator on 1 process and on 2
ranks of sequence parallelism (DeepSpeed ZeRO-3): every step's loss within 1e-5 relative (SGD,
no clipping, so a wrong gradient changes the next step's loss)."""

from __future__ import annotations

import copy
import json
import os

import pytest
import torch
from transformers import DataCollatorWithFlattening

import fpdt.hf
from tests.distributed import run_distributed
from tests.hf.test_packed_documents import _grads, hf_loss_and_grads_packed
from tests.model.helpers import compare, hf_model

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning")

LENGTHS = [5, 1, 13, 2, 20, 8]        # 49 tokens: a multiple of no chunk count above 1
STEPS, PER_DEVICE, SGD_LR, RTOL = 3, 3, 0.5, 1e-5


def _features(vocab: int, lengths=LENGTHS, seed: int = 4, labels: bool = False) -> list[dict]:
    """Examples of random tokens in ``[0, vocab - 1)``: ``vocab - 1`` is left for the padding."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for n in lengths:
        ids = torch.randint(0, vocab - 1, (n,), generator=g).tolist()
        out.append({"input_ids": ids, **({"labels": [t if t % 3 else -100 for t in ids]} if labels else {})})
    return out


@pytest.mark.parametrize("multiple", [1, 2, 3, 7, 8, 64])
@pytest.mark.parametrize("labels", [False, True])
def test_one_padding_document_to_the_next_multiple(multiple, labels):
    features = _features(256, labels=labels)
    kw = dict(return_flash_attn_kwargs=True, return_seq_idx=True)
    plain = DataCollatorWithFlattening(**kw)(features)
    got = fpdt.hf.FlatteningCollator(multiple=multiple, pad_token_id=255, **kw)(features)
    S, pad = 49, -49 % multiple
    assert got["input_ids"].shape == (1, S + pad) and (S + pad) % multiple == 0
    for k in ("input_ids", "labels", "position_ids", "seq_idx"):
        assert torch.equal(got[k][:, :S], plain[k]), k                  # the batch itself is untouched
    assert got["input_ids"][0, S:].tolist() == [255] * pad
    assert got["position_ids"][0, S:].tolist() == list(range(pad))      # a document of its own
    assert got["labels"][0, S:].tolist() == [-100] * pad                 # that no loss sees
    assert got["seq_idx"][0, S:].tolist() == [len(LENGTHS)] * pad
    cu = plain["cu_seq_lens_q"].tolist() + ([S + pad] if pad else [])
    assert got["cu_seq_lens_q"].tolist() == cu and got["cu_seq_lens_k"].tolist() == cu
    assert got["max_length_q"] == max(LENGTHS + [pad])


@pytest.mark.parametrize("name,u,options", [("llama_gqa", 2, {}), ("qwen2_tied", 3, {"checkpointing": "on"}),
                                            ("llama_bias", 4, {"chunked_qkv": False, "loss_chunks": 0}),
                                            ("llama_gqa", 8, {"offload": True, "checkpointing": "offload",
                                                              "runtime": "sim"})])
def test_one_process_matches_transformers_on_the_unpadded_batch(name, u, options):
    ref = hf_model(name)
    features = _features(ref.config.vocab_size)
    plain = DataCollatorWithFlattening()(features)
    ref_loss, ref_grads = hf_loss_and_grads_packed(ref, plain)
    model = fpdt.hf.apply_fpdt(copy.deepcopy(ref), num_chunks=u, **options).train()
    with pytest.raises(fpdt.hf.FPDTHFError, match=r"49 tokens is not a multiple of sp\*num_chunks=1\*%d.*"
                                                  r"fpdt.hf.FlatteningCollator\(model\)" % u):
        model(**plain)
    batch = fpdt.hf.FlatteningCollator(model)(features)
    assert batch["input_ids"].shape[1] == 49 + (-49 % u)
    loss = model(**batch).loss
    loss.backward()
    compare(loss, _grads(model), ref_loss, ref_grads, f"{name} u={u} {options} padded from 49")


def test_refused_with_the_fix():
    with pytest.raises(fpdt.hf.FPDTHFError, match="exactly one of them"):
        fpdt.hf.FlatteningCollator()
    with pytest.raises(fpdt.hf.FPDTHFError, match="exactly one of them"):
        fpdt.hf.FlatteningCollator(hf_model("llama_gqa"), multiple=2)
    with pytest.raises(fpdt.hf.FPDTHFError, match="multiple=0 must be a positive integer"):
        fpdt.hf.FlatteningCollator(multiple=0)
    with pytest.raises(fpdt.hf.FPDTHFError, match="return_position_ids=True"):
        fpdt.hf.FlatteningCollator(multiple=2, return_position_ids=False)
    with pytest.raises(fpdt.hf.FPDTHFError, match="to the collator you give"):
        fpdt.hf.FlatteningCollator(multiple=2, collator=DataCollatorWithFlattening(), separator_id=-1)
    with pytest.raises(fpdt.hf.FPDTHFError, match="call fpdt.hf.apply_fpdt"):
        fpdt.hf.FlatteningCollator(hf_model("llama_gqa"))(_features(256))


# ---- under the real Trainer, with the real collator

def _dataset(vocab: int, n: int = 24, seed: int = 0) -> list[dict]:
    """Documents of 1-40 random tokens (none is ``vocab - 1``, the padding's id)."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 41, (n,), generator=g).tolist()
    return _features(vocab, lengths, seed=seed + 1)


def _args(tmp: str, **kw):
    from transformers import TrainingArguments

    return TrainingArguments(output_dir=os.path.join(tmp, "out"), max_steps=STEPS, per_device_train_batch_size=PER_DEVICE,
                             learning_rate=SGD_LR, optim="sgd", max_grad_norm=0.0, lr_scheduler_type="constant",
                             warmup_steps=0, weight_decay=0.0, logging_steps=1, save_strategy="no", report_to=[],
                             seed=0, use_cpu=True, train_sampling_strategy="sequential", **kw)


def _train(model, args, dataset, collator) -> tuple[list[float], list[dict]]:
    """The Trainer's logged losses and the batches (this rank's) its model was called with."""
    from transformers import Trainer

    seen = []
    model.register_forward_pre_hook(lambda m, a, kw: seen.append({k: v.clone() for k, v in kw.items()
                                                                  if torch.is_tensor(v)}), with_kwargs=True)
    trainer = Trainer(model=model, args=args, train_dataset=dataset, data_collator=collator)
    trainer.train()
    return [h["loss"] for h in trainer.state.log_history if "loss" in h], seen


@pytest.mark.slow
@pytest.mark.parametrize("u", [2, 3])
def test_trainer_one_process_matches_transformers(tmp_path, u):
    """The Trainer on one process: fpdt with FlatteningCollator against plain Transformers with
    DataCollatorWithFlattening on the same checkpoint and data, step by step."""
    from tests.hf.test_trainer import _save_model
    from transformers import AutoModelForCausalLM

    tmp = str(tmp_path)
    path = _save_model(tmp)
    ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    dataset = _dataset(ref.config.vocab_size)
    want, plain = _train(ref, _args(tmp), dataset, DataCollatorWithFlattening())
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    fpdt.hf.apply_fpdt(model, group="trainer", num_chunks=u)
    got, padded = _train(model, _args(tmp), dataset, fpdt.hf.FlatteningCollator(model, pad_token_id=ref.config.vocab_size - 1))
    lengths = [b["input_ids"].shape[1] for b in plain]
    assert len(lengths) == STEPS and any(n % u for n in lengths), lengths     # lengths the layout cannot cut
    for p, b in zip(padded, plain):
        n = b["input_ids"].shape[1]
        assert p["input_ids"].shape[1] == n + (-n % u) and torch.equal(p["input_ids"][:, :n], b["input_ids"])
    assert len(got) == STEPS
    for step, (g, w) in enumerate(zip(got, want)):
        assert abs(g - w) <= RTOL * abs(w), f"step {step + 1}: {g} vs Transformers {w}"


def _two_ranks(rank, world, tmp, out, recurrent_layers=False):
    import deepspeed
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    for k, v in (("RANK", rank), ("WORLD_SIZE", world), ("LOCAL_RANK", rank), ("LOCAL_WORLD_SIZE", world)):
        os.environ[k] = str(v)
    deepspeed.init_distributed(dist_backend="gloo")
    ds = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "hf_trainer", "ds_zero3.json")
    args = _args(tmp, deepspeed=ds, parallelism_config=fpdt.hf.trainer_parallelism_config(
        sp_size=world, recurrent_layers=recurrent_layers))
    model = AutoModelForCausalLM.from_pretrained(os.path.join(tmp, "model"), dtype=torch.float32)
    fpdt.hf.apply_fpdt(model, group="trainer", num_chunks=2)
    vocab = model.config.vocab_size
    # 3 documents of 17 tokens a batch: 51, padded to 52. Each rank's batch the same length: DeepSpeed's adapter
    # all-gathers the ranks' batches, which gloo takes only in equal shapes (NCCL takes uneven ones too).
    dataset = _features(vocab, [17] * 2 * STEPS * PER_DEVICE, seed=1)
    losses, seen = _train(model, args, dataset, fpdt.hf.FlatteningCollator(model, pad_token_id=vocab - 1))
    windows = []
    for b in seen:          # DeepSpeed's adapter gave each rank a contiguous slice: the window is their concatenation
        parts = {}
        for k in ("input_ids", "position_ids", "shift_labels"):
            slices = [torch.empty_like(b[k]) for _ in range(world)]
            dist.all_gather(slices, b[k].contiguous())
            parts[k] = torch.cat(slices, dim=-1)[0].tolist()
        windows.append(parts)
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"losses": losses, "windows": windows, "vocab": vocab}, f)


@pytest.mark.slow
def test_trainer_two_ranks_matches_transformers(tmp_path):
    """Sequence parallelism over 2 ranks under the Trainer (DeepSpeed ZeRO-3, its data adapter
    cutting each padded window in 2 slices, then fpdt's layout in 2 x 2 pieces; 51 tokens would not
    even cut in 2): every step's loss against single-process Transformers with SGD on the window
    without its padding."""
    from tests.hf.test_trainer import _save_model
    from transformers import AutoModelForCausalLM

    tmp = str(tmp_path)
    _save_model(tmp)
    out = os.path.join(tmp, "result.json")
    run_distributed(_two_ranks, 2, args=(tmp, out), timeout=300)
    with open(out) as f:
        got = json.load(f)
    assert len(got["losses"]) == STEPS and len(got["windows"]) == STEPS
    model = AutoModelForCausalLM.from_pretrained(os.path.join(tmp, "model"), dtype=torch.float32).train()
    sgd = torch.optim.SGD(model.parameters(), lr=SGD_LR)
    for step, (w, loss_got) in enumerate(zip(got["windows"], got["losses"])):
        ids = torch.tensor(w["input_ids"])
        n = len(ids)
        while n and ids[n - 1] == got["vocab"] - 1:       # the padding document (no example holds that id)
            n -= 1
        assert (n, len(ids)) == (51, 52) and w["position_ids"][n:] == [0]
        sgd.zero_grad()
        logits = model(input_ids=ids[None, :n], position_ids=torch.tensor(w["position_ids"][:n])[None],
                       use_cache=False).logits
        loss = torch.nn.functional.cross_entropy(logits[0].float(), torch.tensor(w["shift_labels"][:n]),
                                                 ignore_index=-100)
        loss.backward()
        sgd.step()
        assert abs(loss_got - loss.item()) <= RTOL * abs(loss.item()), f"step {step + 1}: {loss_got} vs {loss.item()}"
    assert len({tuple(w["input_ids"]) for w in got["windows"]}) == STEPS


# ---- Qwen3.5 (Gated DeltaNet + gated attention): each packed document alone is the reference

@pytest.mark.parametrize("u,options", [(2, {}), (3, {"checkpointing": "offload", "offload": True, "runtime": "sim"})])
def test_qwen35_matches_each_document_alone(u, options):
    """Transformers' PyTorch fallback refuses packed batches (cu_seqlens without fla), so its
    reference runs each document alone (``tests/model/qwen35.py``); the padding document has no label."""
    from tests.model.qwen35 import compare_hybrid, qwen35_model, reference

    ref = qwen35_model()
    features = _features(ref.config.vocab_size)
    model = fpdt.hf.apply_fpdt(copy.deepcopy(ref), num_chunks=u, **options).train()
    batch = fpdt.hf.FlatteningCollator(model, pad_token_id=ref.config.vocab_size - 1)(features)
    S = batch["input_ids"].shape[1]
    assert S == 49 + (-49 % u)
    rows = [LENGTHS + ([S - 49] if S > 49 else [])]
    refs = reference(ref, batch["input_ids"], batch["labels"], rows)
    loss = model(**batch).loss
    loss.backward()
    compare_hybrid(loss, _grads(model), refs, f"qwen35 FlatteningCollator u={u} {options}")


def _qwen35_per_document_sgd(path: str, batches: list[dict]) -> list[float]:
    """Single-process Transformers SGD on ``batches`` (the Trainer's windows: ``input_ids``,
    ``position_ids`` and ``shift_labels``, 1-D), each document alone."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).train()
    sgd = torch.optim.SGD(model.parameters(), lr=SGD_LR)
    losses = []
    for b in batches:
        ids, pos, shifted = (torch.as_tensor(b[k]) for k in ("input_ids", "position_ids", "shift_labels"))
        starts = [t for t in range(len(ids)) if pos[t] == 0] + [len(ids)]
        total, count = 0.0, 0
        for s, e in zip(starts, starts[1:]):
            target = shifted[s:e]
            if not bool((target != -100).any()):
                continue
            logits = model(input_ids=ids[None, s:e], use_cache=False).logits[0]
            total = total + torch.nn.functional.cross_entropy(logits.float(), target, ignore_index=-100, reduction="sum")
            count += int((target != -100).sum())
        loss = total / count
        sgd.zero_grad()
        loss.backward()
        sgd.step()
        losses.append(loss.item())
    return losses


@pytest.mark.slow
def test_qwen35_trainer_one_process_matches_transformers(tmp_path):
    """The real Trainer with FlatteningCollator on a Qwen3.5 model (u=3, documents padded to a multiple
    of 3): every step's loss against SGD on plain Transformers running each document alone."""
    from transformers import AutoModelForCausalLM

    from tests.model.qwen35 import qwen35_model

    tmp, u = str(tmp_path), 3
    path = os.path.join(tmp, "model")
    qwen35_model().save_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    fpdt.hf.apply_fpdt(model, group="trainer", num_chunks=u)
    vocab = model.config.vocab_size
    got, batches = _train(model, _args(tmp), _dataset(vocab), fpdt.hf.FlatteningCollator(model, pad_token_id=vocab - 1))
    assert len(got) == STEPS and all(b["input_ids"].shape[1] % u == 0 for b in batches)
    windows = [{"input_ids": b["input_ids"][0], "position_ids": b["position_ids"][0],
                "shift_labels": torch.cat([b["labels"][0, 1:], torch.tensor([-100])])} for b in batches]
    assert any(int(w["position_ids"][-1]) < len(w["input_ids"]) - 1 for w in windows)
    want = _qwen35_per_document_sgd(path, windows)
    for step, (g, w) in enumerate(zip(got, want)):
        assert abs(g - w) <= RTOL * abs(w), f"step {step + 1}: {g} vs Transformers {w}"


@pytest.mark.slow
def test_qwen35_trainer_two_ranks_matches_transformers(tmp_path):
    """The Trainer's sequence parallelism over 2 ranks (DeepSpeed ZeRO-3) on a Qwen3.5 model (Gated
    DeltaNet heads split over the ranks): every step's loss against SGD on plain Transformers
    running each document of the window alone."""
    from tests.model.qwen35 import qwen35_model

    tmp = str(tmp_path)
    qwen35_model().save_pretrained(os.path.join(tmp, "model"))
    out = os.path.join(tmp, "result.json")
    run_distributed(_two_ranks, 2, args=(tmp, out, True), timeout=300)
    with open(out) as f:
        got = json.load(f)
    assert len(got["losses"]) == STEPS and len({tuple(w["input_ids"]) for w in got["windows"]}) == STEPS
    want = _qwen35_per_document_sgd(os.path.join(tmp, "model"), got["windows"])
    for step, (g, w) in enumerate(zip(got["losses"], want)):
        assert abs(g - w) <= RTOL * abs(w), f"step {step + 1}: {g} vs Transformers {w}"
