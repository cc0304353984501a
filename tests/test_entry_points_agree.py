"""Every entry point accepts and refuses the same option sets: ``fpdt.model.from_config``,
``fpdt.hf.apply_fpdt``, ``fpdt-train`` (its ``main``, with flags and with the ``"fpdt"`` JSON
section, on the real path up to ``deepspeed.initialize``), and ``fpdt-plan``'s :class:`Setup` and
:class:`Choice`, over one table of exact messages.

Each case gives ``offload``, ``checkpointing`` and ``attention_checkpoint`` explicitly: those
are the fields whose defaults differ by entry point (``fpdt-train`` and ``fpdt-plan`` take the
device's, :func:`fpdt.options.device_defaults`; ``fpdt-train`` chooses the attention checkpoint
from its memory check). :data:`CANNOT` lists what an entry point cannot run (not a validation
rule), each refused with its own message.

``fpdt-train`` runs in this process: an accepted run stops where DeepSpeed's engine would be
built (every check of fpdt's is behind it), a refused one exits with its one line on stderr.
"""

import json
import os

import numpy as np
import pytest
import torch.distributed as dist

import fpdt.hf
from fpdt import model as fm
from fpdt.cli.train import build_parser, fpdt_options, main
from fpdt.options import FPDTOptions, device_defaults
from fpdt.plan import GPU_PRESETS, Choice, Cluster, Setup, load_model_config, plan
from fpdt.train.config import option_key, validate
from tests.model.helpers import hf_config, hf_model

pytestmark = pytest.mark.filterwarnings("ignore")

SEQ, CHUNK = 64, 32            # u = 2 chunks
BASE = dict(offload=False, checkpointing="off", attention_checkpoint="recompute")
ON, SIM = dict(checkpointing="on"), dict(checkpointing="offload", offload=True, runtime="sim")
SAVE = dict(ON, attention_checkpoint="save")
NVME = "nvme"                  # a directory in the test's working directory
BACKENDS = "('flash_attn3', 'flash_attn', 'cuda_flash', 'cuda_cudnn', 'cuda_efficient', 'cpu', 'math')"
RUNTIMES = ("('sim', 'sync', 'cuda') (\"sim\": simulated CUDA streams on the CPU), a fpdt.offload.Runtime, or None "
            "(automatic: cuda on a CUDA device, else sync)")
LAYERS_OVER = "{name} {n} is more than the model's 2 decoder layers; use at most 2, or leave it out ({rest})"
NVME_REST = "every offloaded layer; fpdt-train chooses the fewest the host needs"
PLANNER_CHUNKS = ("{name}={n}: the planner models the chunked MLP and loss; give at least 1 chunk (0, unchunked, "
                  "is a trainer option the planner does not model)")


def _negative_chunks(name, n):
    """A negative ``mlp_chunks`` / ``loss_chunks``: the planner adds that it models chunks, first or last."""
    own = f"{name}={n} must be >= 0 (0 = unchunked) or None (default)"
    planner = PLANNER_CHUNKS.format(name=name, n=n)
    return (dict({name: n}), own, {"train": "--" + name.replace("_", "-") + " " + own[len(name) + 1:],
                                   "plan_setup": f"{own}; {planner}", "plan_choice": f"{planner}; {own}"})


def _argparse(flag, value, choices):
    return f"argparse: argument {flag}: invalid choice: '{value}' (choose from {choices})"


# (options over BASE, None: accepted / the library's message, {entry: its own message where it words it otherwise})
# "train" is fpdt-train's stderr line after "fpdt-train: error: " (flags and JSON), "flags" overrides it for flags
# (argparse's refusal of a choice), "plan" is fpdt-plan's Setup and Choice.
CASES = [
    ({}, None, {}),
    (ON, None, {}),
    (SIM, None, {}),
    (SAVE, None, {}),
    (dict(SAVE, save_attention_layers=1), None, {}),
    (dict(SAVE, save_attention_layers=0), None, {}),
    (dict(SIM, attention_checkpoint="save", save_attention_layers=2), None, {}),
    (dict(lm_head_wgrad="accumulate", backend="math", mlp_chunks=2, loss_chunks=3), None, {}),
    (dict(SIM, nvme_path=NVME), None, {}),
    (dict(SIM, attention_checkpoint="save", nvme_path=NVME, nvme_layers=1), None, {}),
    (dict(SIM, nvme_path=NVME, nvme_layers=0), None, {}),
    (dict(SIM, stream_layers=True), None, {}),
    (dict(SIM, attention_checkpoint="save", stream_layers=True), None, {}),
    (dict(ON, stream_layers=True),
     "stream_layers=True keeps each layer's input in host memory as its checkpoint: set checkpointing='offload' "
     "(now 'on')",
     {"train": "--stream-layers keeps each layer's input in host memory as its checkpoint: pass --checkpoint offload "
               "(now on)",
      "plan": "stream_layers=True keeps each layer's input in host memory as its checkpoint: set "
              "checkpointing='offload' (now 'on'); stream_layers=True keeps the attention's chunks in host memory "
              "too: set offload=True"}),
    (dict(SIM, stream_layers=True, checkpoint_device_layers=1),
     "stream_layers=True keeps no layer input on the device: set checkpoint_device_layers=0 (now 1)",
     {"train": "--stream-layers keeps no layer input on the device: pass --checkpoint-device-layers 0 (now 1)"}),
    # the two the entry points used to disagree on (fpdt.model / fpdt.hf accepted them)
    (dict(attention_checkpoint="save"),
     "attention_checkpoint='save' keeps each checkpointed layer's attention output for its recompute, and "
     "checkpointing='off' recomputes nothing: set checkpointing='on' or 'offload', or "
     "attention_checkpoint='recompute'",
     {"train": "--attention-checkpoint save keeps each checkpointed layer's attention output for its recompute, and "
               "--checkpoint off recomputes nothing: pass --checkpoint on or 'offload', or --attention-checkpoint "
               "recompute"}),
    (dict(ON, save_attention_layers=1),
     "save_attention_layers=1 counts the layers that save their attention output: it needs "
     "attention_checkpoint='save' (now 'recompute'); set attention_checkpoint='save', or drop save_attention_layers",
     {"train": "--save-attention-layers 1 counts the layers that save their attention output: it needs "
               "--attention-checkpoint save (now recompute); pass --attention-checkpoint save, or drop "
               "--save-attention-layers"}),
    (dict(ON, save_attention_layers=0),
     "save_attention_layers=0 counts the layers that save their attention output: it needs "
     "attention_checkpoint='save' (now 'recompute'); set attention_checkpoint='save', or drop save_attention_layers",
     {"train": "--save-attention-layers 0 counts the layers that save their attention output: it needs "
               "--attention-checkpoint save (now recompute); pass --attention-checkpoint save, or drop "
               "--save-attention-layers"}),
    (dict(SAVE, save_attention_layers=3),
     LAYERS_OVER.format(name="save_attention_layers=", n=3, rest="every layer").replace("= ", "="),
     {"train": "config.json: " + LAYERS_OVER.format(name="--save-attention-layers", n=3, rest="every layer")}),
    (dict(SAVE, save_attention_layers=-1),
     "save_attention_layers=-1 must be an integer >= 0, or None (every layer)",
     {"train": "--save-attention-layers -1 must be an integer >= 0, or None (every layer)"}),
    (dict(ON, checkpoint_device_layers=1),
     "checkpoint_device_layers=1 keeps some offloaded layer inputs on the device: it needs checkpointing='offload' "
     "(now 'on')",
     {"train": "--checkpoint-device-layers 1 keeps some offloaded layer inputs on the device: it needs --checkpoint "
               "offload (now on)"}),
    (dict(ON, nvme_path=NVME),
     "nvme_path='nvme' holds the host-offloaded layer checkpoints: it needs checkpointing='offload' (now 'on'); "
     "set checkpointing='offload', or drop nvme_path",
     {"train": "--nvme-path nvme holds the host-offloaded layer checkpoints: it needs --checkpoint offload (now on); "
               "pass --checkpoint offload, or drop --nvme-path"}),
    (dict(SIM, nvme_layers=1),
     "nvme_layers=1 counts the layers whose checkpoints go to the NVMe tier: it needs nvme_path (a directory on a "
     "local drive); set nvme_path, or drop nvme_layers",
     {"train": "--nvme-layers 1 counts the layers whose checkpoints go to the NVMe tier: it needs --nvme-path (a "
               "directory on a local drive); pass --nvme-path, or drop --nvme-layers"}),
    (dict(SIM, nvme_path=NVME, nvme_layers=3),
     LAYERS_OVER.format(name="nvme_layers=", n=3, rest=NVME_REST).replace("= ", "="),
     {"train": "config.json: " + LAYERS_OVER.format(name="--nvme-layers", n=3, rest=NVME_REST)}),
    (dict(SIM, nvme_path=NVME, nvme_layers=-1),
     "nvme_layers=-1 must be an integer >= 0, or None (every offloaded layer)",
     {"train": "--nvme-layers -1 must be an integer >= 0, or None (every offloaded layer)"}),
    (dict(checkpointing="sometimes"),
     "checkpointing='sometimes' must be one of ('off', 'on', 'offload')",
     {"train": "--checkpoint sometimes must be one of ('off', 'on', 'offload')",
      "flags": _argparse("--checkpoint", "sometimes", "'off', 'on', 'offload'")}),
    (dict(attention_checkpoint="keep"),
     "attention_checkpoint='keep' must be one of ('recompute', 'save')",
     {"train": "--attention-checkpoint keep must be one of ('recompute', 'save')",
      "flags": _argparse("--attention-checkpoint", "keep", "'recompute', 'save'")}),
    (dict(lm_head_wgrad="sliced"),
     "lm_head_wgrad='sliced' must be one of ('accumulate', 'recompute')",
     {"train": "--lm-head-wgrad sliced must be one of ('accumulate', 'recompute')",
      "flags": _argparse("--lm-head-wgrad", "sliced", "'accumulate', 'recompute'")}),
    _negative_chunks("mlp_chunks", -1),
    _negative_chunks("loss_chunks", -2),
    (dict(backend="fast"),
     f"backend='fast' must be one of {BACKENDS}, or None (automatic)",
     {"train": f"--attention-backend fast must be one of {BACKENDS}, or None (automatic)",
      "flags": _argparse("--attention-backend", "fast", BACKENDS[1:-1])}),
    (dict(runtime="gpu"),
     f"runtime='gpu' must be one of {RUNTIMES}",
     {"train": f"--runtime gpu must be one of {RUNTIMES}",
      "flags": _argparse("--runtime", "gpu", "'sim', 'sync', 'cuda'")}),
    (dict(offload="yes"),
     "offload='yes' must be True or False",
     {"train": "--offload must be True or False"}),            # flags: --offload / --no-offload cannot say "yes"
]

CANNOT = {  # what an entry point cannot run: (those entry points, their message)
    "checkpoint_device_layers": ({"hf"}, "checkpoint_device_layers=1: fpdt.hf keeps every checkpointed layer input "
                                         "in one tier; use checkpointing='on' (device) or 'offload' (host), or "
                                         "fpdt.model, which tiers them"),
    "unchunked": ({"plan_setup", "plan_choice"}, PLANNER_CHUNKS),
}
EXTRA = [  # valid option sets one entry point cannot run, with that entry point's message
    (dict(SIM, checkpoint_device_layers=1), "checkpoint_device_layers"),
    (dict(mlp_chunks=0), "unchunked"),
    (dict(loss_chunks=0), "unchunked"),
]

CFG = hf_config("llama_gqa")          # 2 decoder layers
PLAN_CFG = load_model_config(CFG.to_dict())
ARGV = ["--model-config", "config.json", "--data", "tokens.npy", "--seq-len", str(SEQ), "--steps", "1",
        "--chunk-size", str(CHUNK)]
REACHED = "fpdt-train: error: ReachedTheEngine: deepspeed.initialize (unexpected; rerun with --debug or FPDT_DEBUG=1 " \
          "for the traceback)"


class ReachedTheEngine(Exception):
    """Raised in place of ``deepspeed.initialize``: fpdt-train's every check passed."""


def _model(opts):
    fm.from_config(CFG.to_dict(), num_chunks=SEQ // CHUNK, **opts)


def _hf(opts):
    fpdt.hf.apply_fpdt(hf_model("llama_gqa"), num_chunks=SEQ // CHUNK, **opts)


def _flags(opts):
    out = []
    for name, value in opts.items():
        flag = "--" + option_key(name).replace("_", "-")
        if name in ("offload", "stream_layers"):
            if not isinstance(value, bool):
                return None                     # --offload / --no-offload: a flag cannot say "yes"
            out.append(flag if value else flag.replace("--", "--no-"))
        else:
            out += [flag, str(value)]
    return out


class Refused(Exception):
    """An entry point's refusal, as its message."""


def _fpdt_train(argv, reached=REACHED):
    """``fpdt-train``'s ``main`` on ``argv`` (after ``ARGV``) in this process: returns when it stopped
    with the line ``reached`` (see the ``_run_here`` fixture); raises :class:`Refused` with the one
    line it printed otherwise (exit 2, after ``fpdt-train: error: ``)."""
    import contextlib
    import io
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            status = main(argv if argv[:1] == ["--model-config"] else ARGV + argv)
    except SystemExit:                 # argparse: a flag's choices are its own
        raise Refused("argparse: " + err.getvalue().strip().splitlines()[-1].removeprefix("fpdt-train: error: "))
    line = err.getvalue().strip().splitlines()[-1] if err.getvalue().strip() else ""
    if (status, line) != (1, reached):
        raise Refused(line.removeprefix("fpdt-train: error: ") if status == 2 else f"exit {status}: {line}")


def _train_flags(opts):
    flags = _flags(opts)
    if flags is None:
        pytest.skip("not expressible as flags")
    _fpdt_train(flags)


def _train_json(opts):
    with open("ds.json", "w") as f:
        json.dump({"train_micro_batch_size_per_gpu": 1, "fpdt": {option_key(k): v for k, v in opts.items()}}, f)
    _fpdt_train(["--deepspeed", "ds.json"])


def _plan_setup(opts):
    problems = Setup.build(seq_len=SEQ, chunk_size=CHUNK, **opts).problems(PLAN_CFG, 1)
    if problems:
        raise ValueError("; ".join(problems))


def _plan_choice(opts):
    cluster = Cluster(GPU_PRESETS["h100-80g"], gpus_per_node=1)
    plan(PLAN_CFG, cluster, seq_len=SEQ, choice=Choice().fix(chunk_size=CHUNK, hp=1, cp=1, **opts))


ENTRIES = {"model": _model, "hf": _hf, "train_flags": _train_flags, "train_json": _train_json,
           "plan_setup": _plan_setup, "plan_choice": _plan_choice}


@pytest.fixture(autouse=True)
def _run_here(tmp_path, monkeypatch):
    """In ``tmp_path``: the tiny model's config.json, tokens.npy and the nvme/ directory. fpdt-train
    stops at ``deepspeed.initialize``; the 1-process group it starts (and DeepSpeed's view of it) and
    the launcher variables it sets are undone after the test."""
    import deepspeed
    import deepspeed.comm.comm as ds_comm

    monkeypatch.delenv("FPDT_RUNTIME", raising=False)
    monkeypatch.chdir(tmp_path)
    CFG.to_json_file("config.json")
    np.save("tokens.npy", (np.arange(8 * SEQ) % CFG.vocab_size).astype(np.int32))
    os.mkdir(NVME)

    def reached(*args, **kwargs):
        raise ReachedTheEngine("deepspeed.initialize")
    monkeypatch.setattr(deepspeed, "initialize", reached)
    had_group, env = dist.is_initialized(), dict(os.environ)
    yield
    if dist.is_initialized() and not had_group:
        dist.destroy_process_group()
        ds_comm.cdb = None
    os.environ.clear()
    os.environ.update(env)


def _outcome(entry, opts):
    """None when accepted, else the error's message."""
    try:
        ENTRIES[entry](opts)
    except Refused as e:
        return str(e)
    except (ValueError, TypeError) as e:   # OptionsError, FPDTHFError, ConfigError are ValueErrors
        return str(e)
    return None


def _expected(entry, message, own):
    if message is None:
        return None
    for key in (entry, "train" if entry.startswith("train") else "plan" if entry.startswith("plan") else None):
        if key in own:
            return own[key]
    return message


@pytest.mark.parametrize("entry", list(ENTRIES))
@pytest.mark.parametrize("opts, message, own", CASES, ids=[str(i) for i in range(len(CASES))])
def test_every_entry_point_accepts_and_refuses_alike(entry, opts, message, own):
    own = {**own, "train_flags": own["flags"]} if "flags" in own else own
    assert _outcome(entry, {**BASE, **opts}) == _expected(entry, message, own)


@pytest.mark.parametrize("entry", list(ENTRIES))
@pytest.mark.parametrize("opts, what", EXTRA, ids=[w for _, w in EXTRA])
def test_what_one_entry_point_cannot_run_is_listed(entry, opts, what):
    cannot, message = CANNOT[what]
    got = _outcome(entry, {**BASE, **opts})
    if entry in cannot:
        name, n = next((k, v) for k, v in opts.items() if k not in BASE and k not in SIM)
        assert got == message.format(name=name, n=n), (entry, got)
    else:
        assert got is None, (entry, got)


def test_one_device_default_rule():
    """The library's defaults are the CPU's on every device; fpdt-train and fpdt-plan take the device's."""
    o = FPDTOptions()
    assert (o.offload, o.checkpointing) == device_defaults("cpu") == (False, "off")
    assert device_defaults("cuda", 1) == (False, "offload") and device_defaults("cuda", 2) == (True, "offload")
    trainer = fpdt_options(build_parser().parse_args(ARGV), None)
    for device in ("cpu", "cuda"):
        run = validate(trainer, SEQ, 1, device, {})
        assert (run.offload, run.checkpoint) == device_defaults(device, run.num_chunks)
    s = Setup(seq_len=SEQ, chunk_size=CHUNK).options
    assert (s.offload, s.checkpointing) == device_defaults("cuda", SEQ // CHUNK)


LAYOUTS = "sp is hp x cp (give sp alone for plain Ulysses, or hp and cp; one of them with sp makes the other sp " \
          "divided by it)"
RING = "it is the ranks of one inner ring (e.g. NICs per node)"
LAYOUT_CASES = [  # (layout over chunk CHUNK on 4 ranks, None: accepted / a phrase of the planner's refusal,
    #               fpdt-train's exact line after "fpdt-train: error: ")
    ({}, None, None),
    (dict(sp=2), None, None),
    (dict(cp=4), None, None),
    (dict(hp=2, cp=2), None, None),
    (dict(sp=4, hp=2, cp=2), None, None),
    (dict(sp=4, hp=2), None, None),                      # cp = sp / hp
    (dict(cp=2, inner_ring=2, placement="context_first"), None, None),
    (dict(sp=2, hp=2, cp=2), "sp=2 does not match hp=2 x cp=2 = 4",
     f"--sp 2 does not match --hp 2 x --cp 2 = 4: {LAYOUTS}"),
    (dict(sp=4, hp=3), "sp=4 does not match hp=3 x cp=1 = 3", f"--sp 4 does not match --hp 3 x --cp 1 = 3: {LAYOUTS}"),
    (dict(cp=4, inner_ring=3), "inner_ring=3 must divide cp=4", f"--inner-ring 3 must divide --cp 4: {RING}"),
    (dict(cp=0), "cp=0 must be an integer >= 1", "--cp 0 must be an integer >= 1"),
    (dict(chunk_size=0), "chunk_size=0 must be an integer >= 1", "--chunk-size 0 must be an integer >= 1"),
    (dict(placement="rows"), "placement='rows' must be one of",
     "--placement rows must be one of ('head_first', 'context_first')"),
    (dict(chunk_size=24), "seq_len=64 is not divisible by chunk_size=24",
     "--seq-len 64 is not divisible by --chunk-size 24; pick a chunk size that divides the sequence length"),
    (dict(chunk_size=128), "chunk_size=128 is larger than the sequence (seq_len=64)",
     "--chunk-size 128 is larger than the sequence (--seq-len 64); use a chunk size <= 64 that divides it"),
    (dict(cp=2, chunk_size=2), "seq_len=64 is not divisible by 2 x hp x cp x chunks",
     "--seq-len 64 is not divisible by 2 x hp x cp x chunks = 2 x 1 x 2 x 32 = 128; each chunk of 2 tokens is cut "
     "into 2 x cp zigzag pieces split over hp ranks: use a chunk size that is a multiple of 4"),
    (dict(sp=4, chunk_size=2), "seq_len=64 is not divisible by sp x chunks = 4 x 32",
     "--seq-len 64 is not divisible by sp x chunks = 4 x 32 = 128; each chunk of 2 tokens must split evenly over 4 "
     "ranks: use a chunk size that is a multiple of 4"),
]
WORLD = 4


class ReachedTheGroup(Exception):
    """Raised in place of ``torch.distributed.init_process_group``: the layout's checks passed."""


def _layout_trainer(monkeypatch, argv):
    """fpdt-train's ``main`` as rank 0 of ``WORLD``, up to its process group (every layout check is
    before it): raises :class:`Refused` with its line."""
    def reached(*args, **kwargs):
        raise ReachedTheGroup("init_process_group")
    monkeypatch.setattr(dist, "init_process_group", reached)
    monkeypatch.setenv("WORLD_SIZE", str(WORLD))         # as a launcher starts rank 0 of WORLD
    monkeypatch.setenv("RANK", "0")
    _fpdt_train(ARGV[:-2] + argv, REACHED.replace("ReachedTheEngine: deepspeed.initialize",
                                                  "rank 0: ReachedTheGroup: init_process_group"))


def _layout_json(monkeypatch, lay):
    with open("ds.json", "w") as f:
        json.dump({"train_micro_batch_size_per_gpu": 1, "fpdt": {"chunk_size": CHUNK, **lay}}, f)
    _layout_trainer(monkeypatch, ["--deepspeed", "ds.json"])


LAYOUT_ENTRIES = {
    "train_flags": lambda mp, lay: _layout_trainer(
        mp, [a for k, v in {"chunk_size": CHUNK, **lay}.items() for a in ("--" + k.replace("_", "-"), str(v))]),
    "train_json": _layout_json,
    "plan_setup": lambda mp, lay: _raise(Setup.build(seq_len=SEQ, **{"chunk_size": CHUNK, **lay}, **BASE)
                                         .problems(PLAN_CFG, WORLD)),
    "plan_choice": lambda mp, lay: _planned(plan(PLAN_CFG, Cluster(GPU_PRESETS["h100-80g"], gpus_per_node=WORLD),
                                                 seq_len=SEQ,
                                                 choice=Choice().fix(**{"chunk_size": CHUNK, **lay}, **BASE))),
}


def _planned(answer):
    """A plan that finds no setup says why (``reason``): that is the planner's refusal."""
    if not answer["fits"]:
        raise ValueError(answer.get("reason") or "no setup fits")


def _raise(problems):
    if problems:
        raise ValueError("; ".join(problems))


@pytest.mark.parametrize("entry", list(LAYOUT_ENTRIES))
@pytest.mark.parametrize("layout, refusal, train", LAYOUT_CASES, ids=[str(i) for i in range(len(LAYOUT_CASES))])
def test_trainer_and_planner_take_the_same_layouts(entry, layout, refusal, train, monkeypatch):
    """The mesh degrees and the chunk (:class:`fpdt.options.LayoutOptions`) and how they cut the
    sequence (:func:`fpdt.layout.chunking_problems`) are read and refused once, by ``fpdt-train``
    (flags, JSON: its exact line) and ``fpdt-plan`` (:class:`Setup`, :class:`Choice`: the problem
    among the planner's) alike."""
    try:
        LAYOUT_ENTRIES[entry](monkeypatch, layout)
        got = None
    except Refused as e:
        got = str(e)
    except (ValueError, TypeError) as e:
        got = str(e)
    if refusal is None:
        assert got is None, f"{entry} refused {layout}: {got}"
    elif entry == "train_flags" and "placement" in layout:
        assert got == "argparse: argument --placement: invalid choice: 'rows' (choose from 'head_first', " \
                      "'context_first')"
    elif entry.startswith("train"):
        assert got == train
    else:
        assert got is not None and refusal in got, (entry, got)
