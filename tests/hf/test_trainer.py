"""``apply_fpdt(model, group="trainer")`` under Hugging Face's Trainer with its DeepSpeed
sequence parallelism (``examples/hf_trainer/train.py``: accelerate's ``ParallelismConfig``,
DeepSpeed ZeRO-3, DeepSpeed's data adapter slicing each window contiguously), on 2 gloo
ranks, against single-process Transformers training on the windows the Trainer fed it: every
step's loss within 1e-4 relative, and every step's gradient (as DeepSpeed holds it for the
optimizer step, gathered from ZeRO-3's partitions) within 1e-5 relative (fp32, max |a - b| / max |b|
per tensor).

The optimizer is plain SGD without clipping, so a wrong gradient scale changes the next
step's loss. With ``prompt`` the first 60% of every window's labels are -100 (as in
fine-tuning on answers only): rank 0's contiguous slice then has no valid token, the
Trainer gives its loss weight 0, and only a backward that sums the Trainer's weights over the
group (:func:`fpdt.model.loss.sum_gradient_over_group`) still trains on the tokens that the
FPDT layout put on rank 0.
"""

from __future__ import annotations

import importlib.util
import json
import os

import pytest
import torch

from tests.distributed import run_distributed
from tests.model.helpers import compare
from tests.hf.test_deepspeed_loop import _write_config     # the example's tiny model, smaller

pytest.importorskip("accelerate")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLE = os.path.join(ROOT, "examples", "hf_trainer", "train.py")
SEQ_LEN, STEPS, SGD_LR, RTOL, GRAD_TOL = 128, 3, 0.5, 1e-4, 1e-5
PROMPT_FRACTION = 0.6

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning")


def _example():
    spec = importlib.util.spec_from_file_location("hf_trainer_train", EXAMPLE)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _save_model(tmp: str) -> str:
    """The tiny model with seeded weights as a checkpoint: the Trainer's ranks load it under ZeRO-3's
    partitioned loading (TrainingArguments come first), the reference loads it plainly."""
    from transformers import AutoConfig, AutoModelForCausalLM

    _write_config(tmp)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(os.path.join(tmp, "config.json")),
                                             dtype=torch.float32)
    path = os.path.join(tmp, "model")
    model.save_pretrained(path)
    return path


def _argv(tmp: str, chunks: int, sp: int, grad_accum: int, lora: int = 0) -> list[str]:
    return ["--lora-rank", str(lora),"--model", os.path.join(tmp, "model"),
            "--tokenizer", os.path.join(ROOT, "examples", "tiny-llama", "tokenizer.json"),
            "--data", os.path.join(ROOT, "examples", "data", "jargon-file-4.4.7.txt"),
            "--seq-len", str(SEQ_LEN), "--chunks", str(chunks), "--steps", str(STEPS), "--sp", str(sp),
            "--grad-accum", str(grad_accum), "--optim", "sgd", "--lr", str(SGD_LR), "--max-grad-norm", "0",
            "--output-dir", os.path.join(tmp, "out")]


def _labels(input_ids: torch.Tensor, prompt: bool) -> torch.Tensor:
    labels = input_ids.clone()
    if prompt:
        labels[..., :int(PROMPT_FRACTION * labels.shape[-1])] = -100
    return labels


def _rank(rank, world, tmp, chunks, prompt, sp, grad_accum, out, lora=0):
    import torch.distributed as dist

    for k, v in (("RANK", rank), ("WORLD_SIZE", world), ("LOCAL_RANK", rank), ("LOCAL_WORLD_SIZE", world)):
        os.environ[k] = str(v)
    if 1 < sp < world:      # the Trainer's loss aggregation all-gathers over a subgroup: see _GroupAllGather
        import torch.distributed.nn.functional as differentiable
        differentiable.all_gather = lambda tensor, group=None: _GroupAllGather.apply(tensor, group)
    trainer = _example().build_trainer(_example().parse_args(_argv(tmp, chunks, sp, grad_accum, lora)))
    # loaded partitioned (zero.Init); PEFT's adapters, made after loading, are partitioned when training starts
    assert all(hasattr(p, "ds_id") for n, p in trainer.model.named_parameters() if "lora_" not in n)
    if lora:
        assert {n for n, p in trainer.model.named_parameters() if p.requires_grad} and \
            all("lora_" in n for n, p in trainer.model.named_parameters() if p.requires_grad)
    for item in trainer.train_dataset:
        item["labels"] = _labels(item["input_ids"], prompt)
    batches = []

    def record(module, args, kwargs):     # every rank's input -> the windows this micro-batch trains on
        slices = [torch.empty_like(kwargs["input_ids"]) for _ in range(world)]
        dist.all_gather(slices, kwargs["input_ids"].contiguous())
        batches.append([torch.cat(slices[g:g + sp], dim=-1)[0].tolist() for g in range(0, world, sp)])

    trainer.model.register_forward_pre_hook(record, with_kwargs=True)
    grads = _record_step_gradients()
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    if rank == 0:
        steps = [sum(batches[i:i + grad_accum], []) for i in range(0, len(batches), grad_accum)]
        with open(out, "w") as f:
            json.dump({"losses": losses, "steps": steps}, f)
        torch.save(grads, out + ".grads.pt")


def _record_step_gradients() -> list[dict[str, torch.Tensor]]:
    """Each optimizer step's full gradients, by parameter name, as DeepSpeed's engine holds them at
    the step (ZeRO-3's partitions gathered on every rank; accelerate calls ``engine.step`` right
    after ``engine.backward``, so no Trainer callback sees them)."""
    from deepspeed.runtime.engine import DeepSpeedEngine
    from deepspeed.utils import safe_get_full_grad

    grads: list[dict[str, torch.Tensor]] = []
    step = DeepSpeedEngine.step

    def recording_step(engine, *args, **kwargs):
        if engine.is_gradient_accumulation_boundary():
            grads.append({n: safe_get_full_grad(p).detach().clone() for n, p in engine.module.named_parameters()
                          if p.requires_grad})
        return step(engine, *args, **kwargs)
    DeepSpeedEngine.step = recording_step       # this spawned rank's own class, gone with the process
    return grads


def _reference(tmp: str, steps: list[list[list[int]]], prompt: bool,
               lora: int = 0) -> tuple[list[float], list[dict[str, torch.Tensor]]]:
    """Single-process Transformers (with the example's PEFT adapters when ``lora``) and SGD: each
    step on the mean of its windows' losses (every window has the same number of valid labels,
    so this is also the token mean over the step). Returns each step's loss and gradients."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(os.path.join(tmp, "model"), dtype=torch.float32)
    if lora:
        mod = _example()
        model = mod.with_lora(model, mod.parse_args(_argv(tmp, 1, 1, 1, lora)))
    model.train()
    sgd = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=SGD_LR)
    losses, grads = [], []
    for windows in steps:
        sgd.zero_grad()
        total = 0.0
        for window in windows:
            ids = torch.tensor(window).unsqueeze(0)
            loss = model(input_ids=ids, labels=_labels(ids, prompt), use_cache=False).loss / len(windows)
            loss.backward()
            total += loss.item()
        grads.append({n: p.grad.detach().clone() for n, p in model.named_parameters() if p.requires_grad})
        sgd.step()
        losses.append(total)
    return losses, grads


@pytest.mark.slow
@pytest.mark.parametrize("world,chunks,prompt,sp,grad_accum,lora", [
    (2, 2, True, 2, 2, 0), (2, 2, True, 1, 1, 0), pytest.param(4, 2, True, 2, 1, 0, marks=[pytest.mark.slow, pytest.mark.long]),
    (2, 2, True, 2, 1, 4)],
    ids=["sp2-u2-prompt-masked-accum2", "dp2-u2-prompt-masked", "sp2xdp2-u2-prompt-masked", "sp2-u2-lora"])
def test_trainer_matches_single_process_transformers(tmp_path, world, chunks, prompt, sp, grad_accum, lora):
    """One SP group of 2 (with gradient accumulation); data parallelism alone (no SP group: each
    rank runs FPDT's chunked layers on its own windows); 2 SP groups x 2-way data parallelism;
    PEFT LoRA adapters on one SP group of 2 (against single-process PEFT)."""
    tmp = str(tmp_path)
    _save_model(tmp)
    out = os.path.join(tmp, "result.json")
    run_distributed(_rank, world, args=(tmp, chunks, prompt, sp, grad_accum, out, lora), timeout=300)
    with open(out) as f:
        got = json.load(f)
    assert len(got["losses"]) == STEPS and len(got["steps"]) == STEPS
    assert all(len(w) == grad_accum * world // sp for w in got["steps"])  # windows accumulated, or one per DP group
    windows = [w for step in got["steps"] for w in step]
    assert len({tuple(w) for w in windows}) > 1                   # both ranks' batches were trained on
    want, want_grads = _reference(tmp, got["steps"], prompt, lora)
    for step, (g, w) in enumerate(zip(got["losses"], want)):
        assert abs(g - w) <= RTOL * abs(w), f"step {step + 1}: {g} vs single-process {w}"
    grads = torch.load(out + ".grads.pt")
    assert len(grads) == STEPS
    for step, (g, w) in enumerate(zip(grads, want_grads)):
        compare(torch.zeros(()), g, torch.zeros(()), w, f"step {step + 1} gradients", tol=GRAD_TOL)


# ---- the Trainer's route without the Trainer: DeepSpeed's SP groups and data slicing, Transformers' own
# ---- SP loss aggregation (deepspeed_sp_compute_loss), DeepSpeed's gradient averaging over all ranks

def _adapter_slices(ids, labels, sp_rank, sp, mask=None):
    """What DeepSpeed's UlyssesSPDataLoaderAdapter gives one rank: contiguous slices of the window,
    labels shifted on the whole window (and the padding mask's slice, if any)."""
    S = ids.shape[1]
    shift = torch.nn.functional.pad(labels, (0, 1), value=-100)[:, 1:]
    cut = slice(sp_rank * S // sp, (sp_rank + 1) * S // sp)
    out = {"input_ids": ids[:, cut], "position_ids": torch.arange(S).expand_as(ids)[:, cut],
           "shift_labels": shift[:, cut]}
    if mask is not None:
        out["attention_mask"] = mask[:, cut]
    return out


def _as_under_zero3() -> None:
    """Transformers' SP loss (``deepspeed_sp_compute_loss``) as the Trainer computes it under ZeRO-3,
    the setup docs/hf.md gives: from Transformers 5.24 each rank backpropagates its own share of the
    token mean, scaled by the SP degree where ZeRO-3 averages the gradients over the ranks (DeepSpeed
    before 0.20.2). These routes call it without an engine, so ZeRO-3 is declared here (this spawned
    rank's own module, gone with the process); the tests then average the gradients as ZeRO-3 does."""
    import transformers.integrations.deepspeed as hf_deepspeed

    hf_deepspeed.is_deepspeed_zero3_enabled = lambda: True


class _GroupAllGather(torch.autograd.Function):
    """``torch.distributed.nn.functional.all_gather`` for a gloo subgroup: torch's own backward (an
    all-to-all of scatters) passes group ranks where global ranks belong and fails outside the
    default group (pytorch/pytorch#120213); NCCL takes another path. Same math: the gradient of
    this rank's input is the sum over the group of its slot's gradients."""

    @staticmethod
    def forward(ctx, tensor, group):
        import torch.distributed as dist

        ctx.group = group
        out = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
        dist.all_gather(out, tensor.contiguous(), group=group)
        return tuple(out)

    @staticmethod
    def backward(ctx, *grads):
        import torch.distributed as dist

        stacked = torch.stack(grads).contiguous()
        dist.all_reduce(stacked, group=ctx.group)
        return stacked[dist.get_rank(ctx.group)], None


def _trainer_route(rank, world, sp, cases):
    import copy
    import types

    import deepspeed
    import torch.distributed as dist
    from deepspeed.runtime.sequence_parallel import parallel_state_sp
    from transformers.integrations.deepspeed import deepspeed_sp_compute_loss

    import fpdt.hf
    from tests.model.helpers import compare, hf_model, tokens

    from deepspeed.utils import groups

    deepspeed.init_distributed(dist_backend="gloo")
    parallel_state_sp.initialize_sequence_parallel(sp)
    groups.mpu = parallel_state_sp            # as deepspeed.initialize(mpu=...) sets it
    _as_under_zero3()
    import torch.distributed.nn.functional as differentiable
    differentiable.all_gather = lambda tensor, group=None: _GroupAllGather.apply(tensor, group)
    try:
        window, sp_rank = rank // sp, rank % sp           # each SP group trains on a window of its own
        for name, u, prompt, options in cases:
            ref = hf_model(name)
            S = max(16, 4 * sp * u)
            ids, labels = tokens(ref.config.vocab_size, 1, S, seed=1 + window)
            if prompt:
                labels[:, :int(PROMPT_FRACTION * S)] = -100
            options = dict(options)
            mask = None
            if options.pop("right_padding", False):    # the window's last S/4 + 1 tokens padding, labelled -100
                mask = torch.ones_like(ids)
                mask[:, S - S // 4 - 1:] = 0
                labels[mask == 0] = -100
            model = copy.deepcopy(ref)
            ref.zero_grad(set_to_none=True)
            ref_loss = ref(input_ids=ids, attention_mask=mask, labels=labels).loss   # Transformers with the mask
            ref_loss.backward()
            ref_grads = {n: p.grad.detach().clone() for n, p in ref.named_parameters()}
            model.zero_grad(set_to_none=True)
            hf_checkpointing = options.pop("hf_checkpointing", False)
            fpdt.hf.apply_fpdt(model, group="trainer", num_chunks=u, **options)
            model.train()
            if hf_checkpointing:      # TrainingArguments(gradient_checkpointing=True): recomputed outside forward
                model.gradient_checkpointing_enable()
            pc = types.SimpleNamespace(sp_backend="deepspeed", sp_size=sp)
            loss = deepspeed_sp_compute_loss(None, model, _adapter_slices(ids, labels, sp_rank, sp, mask), False, pc)
            loss.backward()
            assert model.config._attn_implementation == "sdpa"     # what the Trainer's SP setup checked
            grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
            for g, r in zip(grads.values(), ref_grads.values()):   # DeepSpeed: the mean over all ranks;
                dist.all_reduce(g)                                 # the truth: the mean over the windows
                g.div_(world)
                dist.all_reduce(r)
                r.div_(world)
            compare(loss, grads, ref_loss, ref_grads,
                    f"{name} u={u} prompt={prompt} {options} rank {rank}/{world} sp={sp}")
    finally:
        groups.mpu = None
        parallel_state_sp._release_sequence_parallel_groups()


@pytest.mark.slow
@pytest.mark.parametrize("world,sp,cases", [
    (2, 2, [("llama_gqa", 1, False, {}), ("llama_gqa", 2, True, {}), ("qwen2_tied", 4, True, {}),
            ("mistral", 2, False, {"loss_chunks": 0}),
            ("llama_gqa", 2, True, {"offload": True, "checkpointing": "offload"}),
            ("llama_gqa", 2, True, {"offload": True, "checkpointing": "offload", "runtime": "sim",
                                    "stream_layers": True}),
            ("llama_bias", 2, True, {"hf_checkpointing": True}),
            ("llama_gqa", 2, False, {"right_padding": True, "offload": True, "checkpointing": "offload"})]),
    (4, 4, [("llama_sp4", 2, True, {})]),      # KV heads replicated: 2 < 4
    (4, 2, [("llama_bias", 2, True, {})]),     # 2 SP groups x 2-way data parallelism
], ids=["sp2", "sp4", "sp2xdp2"])
def test_trainer_route_matches_transformers(world, sp, cases):
    run_distributed(_trainer_route, world, args=(sp, cases), timeout=240)


# ---- without the Trainer's sequence-parallel group, and what it cannot honour

def test_one_process_needs_no_trainer_group_and_matches_transformers():
    """A world of one (no torch.distributed): group='trainer' is no parallelism; the Trainer's
    unshifted labels= work, and the loss and gradients are Transformers'."""
    import copy

    import fpdt.hf
    from tests.model.helpers import compare, hf_loss_and_grads, hf_model, tokens

    ref = hf_model("llama_gqa")
    ids, labels = tokens(ref.config.vocab_size, 2, 32)
    ref_loss, ref_grads = hf_loss_and_grads(ref, ids, labels)
    model = copy.deepcopy(ref)
    model.zero_grad(set_to_none=True)
    fpdt.hf.apply_fpdt(model, group="trainer", num_chunks=2)
    assert model.config._attn_implementation == "sdpa"    # eager would be refused by the Trainer's SP setup
    out = model(input_ids=ids, labels=labels)
    out.loss.backward()
    compare(out.loss, {n: p.grad for n, p in model.named_parameters()}, ref_loss, ref_grads, "group='trainer', 1 rank")
    streamed = fpdt.hf.apply_fpdt(copy.deepcopy(ref), group="trainer", num_chunks=2, offload=True, runtime="sim",
                                  checkpointing="offload", stream_layers=True)
    streamed.zero_grad(set_to_none=True)
    out = streamed(input_ids=ids, labels=labels)
    out.loss.backward()
    compare(out.loss, {n: p.grad for n, p in streamed.named_parameters()}, ref_loss, ref_grads,
            "group='trainer', 1 rank, stream_layers")


def test_trainer_settings_refused_with_the_fix():
    import fpdt.hf
    from fpdt.comm import SequenceMesh
    from fpdt.hf import FPDTHFError
    from tests.model.helpers import hf_model

    with pytest.raises(FPDTHFError, match="keep chunked_qkv=True"):
        fpdt.hf.apply_fpdt(hf_model("llama_gqa"), group="trainer", chunked_qkv=False)
    with pytest.raises(FPDTHFError, match="pass no mesh"):
        fpdt.hf.apply_fpdt(hf_model("llama_gqa"), group="trainer", mesh=object.__new__(SequenceMesh))
    with pytest.raises(FPDTHFError, match="'trainer'"):
        fpdt.hf.apply_fpdt(hf_model("llama_gqa"), group="deepspeed")
    with pytest.raises(FPDTHFError, match="positive integer"):
        fpdt.hf.trainer_parallelism_config(hf_model("llama_gqa"))
    with pytest.raises(FPDTHFError, match="does not divide the world of 1"):
        fpdt.hf.trainer_parallelism_config(sp_size=2)
    pc = fpdt.hf.trainer_parallelism_config(sp_size=2, dp_shard_size=3)      # explicit sizes are kept
    assert (pc.sp_backend, pc.sp_size, pc.sp_handler.sp_attn_implementation) == ("deepspeed", 2, "sdpa")
    assert pc.sp_handler.sp_seq_length_is_variable and pc.dp_shard_size == 3
    assert fpdt.hf.trainer_parallelism_config(1).dp_shard_size == 1
    eager = hf_model("llama_gqa")                  # the test models are eager, which the Trainer's SP refuses
    assert fpdt.hf.apply_fpdt(eager, group="trainer").config._attn_implementation == "sdpa"


def _refusals_on_two_ranks(rank, world):
    import copy

    import deepspeed
    from deepspeed.runtime.sequence_parallel import parallel_state_sp

    import fpdt.hf
    from fpdt.hf import FPDTHFError
    from tests.model.helpers import hf_model, rel_err, tokens

    ref = hf_model("llama_gqa")
    model = fpdt.hf.apply_fpdt(copy.deepcopy(ref), group="trainer", num_chunks=2)
    ids, labels = tokens(model.config.vocab_size, 1, 32, seed=1 + rank)
    # no sequence-parallel group (the Trainer with data parallelism only): each rank its own whole window
    loss = model(input_ids=ids, labels=labels).loss
    assert rel_err(loss, ref(input_ids=ids, labels=labels).loss) < 1e-5
    ids, labels = tokens(model.config.vocab_size, 1, 32)              # one window for the SP group
    inputs = _adapter_slices(ids, labels, rank, world)
    with pytest.raises(FPDTHFError, match="no DeepSpeed sequence-parallel group"):
        model(**inputs, labels=inputs["shift_labels"])                 # as the Trainer's SP loss calls it
    deepspeed.init_distributed(dist_backend="gloo")
    parallel_state_sp.initialize_sequence_parallel(world)
    try:
        # the Trainer's evaluation: whole windows of each rank's own, unshifted labels (or none)
        with pytest.raises(FPDTHFError, match="eval_strategy='no'"):
            model(input_ids=ids, labels=labels, position_ids=torch.arange(32)[None])
        model.eval()
        with pytest.raises(FPDTHFError, match="evaluation under the Trainer's sequence parallelism"):
            model(input_ids=ids[:, :8 + 8 * rank], position_ids=torch.arange(8 + 8 * rank)[None])  # lengths differ
        model.train()
        # padding on one rank only: refused on every rank alike (no rank left waiting in a collective)
        mask = torch.ones_like(inputs["input_ids"])
        if rank == 1:
            mask[0, -3:] = 0
        with pytest.raises(FPDTHFError, match="padding"):
            model(**inputs, attention_mask=mask)
        with pytest.raises(FPDTHFError, match="positions must increase by one, or restart at 0"):
            model(**{**inputs, "position_ids": inputs["position_ids"] * 2})
        with pytest.raises(FPDTHFError, match="10 tokens is not a multiple of sp\\*num_chunks=2\\*2=4"):
            model(**_adapter_slices(ids[:, :10], labels[:, :10], rank, world))   # 10 = 2 x 5, not 2 x 2 x k
        out = model(**inputs, attention_mask=torch.ones_like(inputs["input_ids"]))   # a full mask is fine
        assert torch.isfinite(out.loss)
        assert model.config._attn_implementation == "sdpa"                           # restored after forward
    finally:
        parallel_state_sp._release_sequence_parallel_groups()


@pytest.mark.slow
def test_trainer_group_without_and_with_sequence_parallelism_on_two_ranks():
    run_distributed(_refusals_on_two_ranks, 2, timeout=120)
