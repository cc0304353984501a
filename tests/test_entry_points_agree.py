"""Every entry point accepts and refuses the same option sets: ``fpdt.model.from_config``,
``fpdt.hf.apply_fpdt``, ``fpdt-train``'s flags and its ``"fpdt"`` JSON section (parsed and
validated, no training), and ``fpdt-plan``'s :class:`Setup` and :class:`Choice`, over one table.

Each case gives ``offload``, ``checkpointing`` and ``attention_checkpoint`` explicitly: those
are the fields whose defaults differ by entry point (``fpdt-train`` and ``fpdt-plan`` take the
device's, :func:`fpdt.options.device_defaults`; ``fpdt-train`` chooses the attention checkpoint
from its memory check). :data:`CANNOT` lists what an entry point cannot run (not a validation
rule), each refused with its own message.
"""

import re

import pytest

import fpdt.hf
from fpdt import model as fm
from fpdt.cli.train import build_parser, fpdt_options
from fpdt.options import FPDTOptions, device_defaults
from fpdt.plan import GPU_PRESETS, Choice, Cluster, Setup, load_model_config, plan
from fpdt.train import preflight
from fpdt.train.config import option_key, validate
from tests.model.helpers import hf_config, hf_model

pytestmark = pytest.mark.filterwarnings("ignore")

SEQ, CHUNK = 64, 32            # u = 2 chunks
BASE = dict(offload=False, checkpointing="off", attention_checkpoint="recompute")
ON, SIM = dict(checkpointing="on"), dict(checkpointing="offload", offload=True, runtime="sim")
SAVE = dict(ON, attention_checkpoint="save")

CASES = [  # (options over BASE, None: accepted / a phrase of the one refusal)
    ({}, None),
    (ON, None),
    (SIM, None),
    (SAVE, None),
    (dict(SAVE, save_attention_layers=1), None),
    (dict(SAVE, save_attention_layers=0), None),
    (dict(SIM, attention_checkpoint="save", save_attention_layers=2), None),
    (dict(lm_head_wgrad="accumulate", backend="math", mlp_chunks=2, loss_chunks=3), None),
    (dict(SIM, nvme_path="/nvme"), None),
    (dict(SIM, attention_checkpoint="save", nvme_path="/nvme", nvme_layers=1), None),
    (dict(SIM, nvme_path="/nvme", nvme_layers=0), None),
    (dict(SIM, stream_layers=True), None),
    (dict(SIM, attention_checkpoint="save", stream_layers=True), None),
    (dict(ON, stream_layers=True), "checkpointing='offload'"),
    (dict(SIM, stream_layers=True, checkpoint_device_layers=1), "checkpoint_device_layers=0"),
    # the two the entry points used to disagree on (fpdt.model / fpdt.hf accepted them)
    (dict(attention_checkpoint="save"), "checkpointing='off' recomputes nothing"),
    (dict(ON, save_attention_layers=1), "needs attention_checkpoint='save' (now 'recompute')"),
    (dict(ON, save_attention_layers=0), "needs attention_checkpoint='save' (now 'recompute')"),
    (dict(SAVE, save_attention_layers=3), "the model's 2"),
    (dict(SAVE, save_attention_layers=-1), "must be an integer"),
    (dict(ON, checkpoint_device_layers=1), "needs checkpointing='offload' (now 'on')"),
    (dict(ON, nvme_path="/nvme"), "needs checkpointing='offload' (now 'on')"),
    (dict(SIM, nvme_layers=1), "it needs nvme_path"),
    (dict(SIM, nvme_path="/nvme", nvme_layers=3), "the model's 2"),
    (dict(SIM, nvme_path="/nvme", nvme_layers=-1), "must be an integer"),
    (dict(checkpointing="sometimes"), "checkpoint"),
    (dict(attention_checkpoint="keep"), "attention_checkpoint='keep' must be one of"),
    (dict(lm_head_wgrad="sliced"), "lm_head_wgrad='sliced' must be one of"),
    (dict(mlp_chunks=-1), "mlp_chunks=-1 must be >= 0"),
    (dict(loss_chunks=-2), "loss_chunks=-2 must be >= 0"),
    (dict(backend="fast"), "backend='fast' must be one of"),
    (dict(runtime="gpu"), "runtime='gpu' must be one of"),
    (dict(offload="yes"), "offload='yes' must be True or False"),
]

CANNOT = {  # what an entry point cannot run: (those entry points, their message)
    "checkpoint_device_layers": ({"hf"}, "fpdt.hf keeps every checkpointed layer input in one tier"),
    "unchunked": ({"plan_setup", "plan_choice"}, "the planner models the chunked MLP"),
}
EXTRA = [  # valid option sets one entry point cannot run, with that entry point's message
    (dict(SIM, checkpoint_device_layers=1), "checkpoint_device_layers"),
    (dict(mlp_chunks=0), "unchunked"),
    (dict(loss_chunks=0), "unchunked"),
]

CFG = hf_config("llama_gqa")          # 2 decoder layers
PLAN_CFG = load_model_config(CFG.to_dict())
_CONFIG_PATH = [""]       # the tiny model's config.json (the fixture writes it)
ARGV = ["--model-config", "c.json", "--data", "d", "--seq-len", str(SEQ), "--steps", "1", "--chunk-size", str(CHUNK)]


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


def _trainer(argv, section):
    o = fpdt_options(build_parser().parse_args(ARGV + argv), section)
    run = validate(o, SEQ, 1, "cpu", {})        # the run's checks before any process group
    cfg = preflight.model_source(None, _CONFIG_PATH[0]).config
    preflight.check_layer_counts(cfg, "config.json", checkpoint_device_layers=o.checkpoint_device_layers,
                                 save_attention_layers=o.save_attention_layers, nvme_layers=o.nvme_layers)
    o.model_options(run)


def _train_flags(opts):
    flags = _flags(opts)
    if flags is None:
        pytest.skip("not expressible as flags")
    _trainer(flags, None)


def _train_json(opts):
    _trainer([], {option_key(name): value for name, value in opts.items()})


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
def _config_file(tmp_path, monkeypatch):
    monkeypatch.delenv("FPDT_RUNTIME", raising=False)
    path = tmp_path / "config.json"
    CFG.to_json_file(str(path))
    _CONFIG_PATH[:] = [str(path)]


def _outcome(entry, opts):
    """None when accepted, else the error's message (argparse's refusal of a choice: its exit)."""
    try:
        ENTRIES[entry](opts)
    except SystemExit as e:
        return f"argparse refused it (exit {e.code})"
    except (ValueError, TypeError) as e:   # OptionsError, FPDTHFError, ConfigError are ValueErrors
        return str(e)
    return None


@pytest.mark.parametrize("entry", list(ENTRIES))
@pytest.mark.parametrize("opts, refusal", CASES, ids=[str(i) for i in range(len(CASES))])
def test_every_entry_point_accepts_and_refuses_alike(entry, opts, refusal, capsys):
    got = _outcome(entry, {**BASE, **opts})
    if refusal is None:
        assert got is None, f"{entry} refused {opts}: {got}"
        return
    assert got is not None, f"{entry} accepted {opts}, which the others refuse ({refusal})"
    if not got.startswith("argparse refused"):      # a flag's choices are argparse's: its own message
        assert re.search(re.escape(refusal), got), (entry, got)
    else:
        assert "invalid choice" in capsys.readouterr().err


@pytest.mark.parametrize("entry", list(ENTRIES))
@pytest.mark.parametrize("opts, what", EXTRA, ids=[w for _, w in EXTRA])
def test_what_one_entry_point_cannot_run_is_listed(entry, opts, what):
    cannot, phrase = CANNOT[what]
    got = _outcome(entry, {**BASE, **opts})
    if entry in cannot:
        assert got is not None and phrase in got, (entry, got)
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


LAYOUT_CASES = [  # (layout over chunk CHUNK, None: accepted / a phrase of the one refusal), on 4 ranks
    ({}, None),
    (dict(sp=2), None),
    (dict(cp=4), None),
    (dict(hp=2, cp=2), None),
    (dict(sp=4, hp=2, cp=2), None),
    (dict(sp=4, hp=2), None),                      # cp = sp / hp
    (dict(cp=2, inner_ring=2, placement="context_first"), None),
    (dict(sp=2, hp=2, cp=2), "sp=2 does not match hp=2 x cp=2 = 4"),
    (dict(sp=4, hp=3), "sp=4 does not match hp=3 x cp=1 = 3"),
    (dict(cp=4, inner_ring=3), "inner_ring=3 must divide cp=4"),
    (dict(cp=0), "cp=0 must be an integer >= 1"),
    (dict(chunk_size=0), "chunk_size=0 must be an integer >= 1"),
    (dict(placement="rows"), "placement='rows' must be one of"),
    (dict(chunk_size=24), "seq_len=64 is not divisible by chunk_size=24"),
    (dict(chunk_size=128), "chunk_size=128 is larger than the sequence (seq_len=64)"),
    (dict(cp=2, chunk_size=2), "seq_len=64 is not divisible by 2 x hp x cp x chunks"),
    (dict(sp=4, chunk_size=2), "seq_len=64 is not divisible by sp x chunks = 4 x 32"),
]
WORLD = 4


def _layout_trainer(argv, section):
    validate(fpdt_options(build_parser().parse_args(ARGV[:-2] + argv), section), SEQ, WORLD, "cpu", {})


LAYOUT_ENTRIES = {
    "train_flags": lambda lay: _layout_trainer(
        [a for k, v in {"chunk_size": CHUNK, **lay}.items() for a in ("--" + k.replace("_", "-"), str(v))], None),
    "train_json": lambda lay: _layout_trainer([], {"chunk_size": CHUNK, **lay}),
    "plan_setup": lambda lay: _raise(Setup.build(seq_len=SEQ, **{"chunk_size": CHUNK, **lay}, **BASE)
                                     .problems(PLAN_CFG, WORLD)),
    "plan_choice": lambda lay: _planned(plan(PLAN_CFG, Cluster(GPU_PRESETS["h100-80g"], gpus_per_node=WORLD),
                                             seq_len=SEQ, choice=Choice().fix(**{"chunk_size": CHUNK, **lay}, **BASE))),
}


def _planned(answer):
    """A plan that finds no setup says why (``reason``): that is the planner's refusal."""
    if not answer["fits"]:
        raise ValueError(answer.get("reason") or "no setup fits")


def _raise(problems):
    if problems:
        raise ValueError("; ".join(problems))


@pytest.mark.parametrize("entry", list(LAYOUT_ENTRIES))
@pytest.mark.parametrize("layout, refusal", LAYOUT_CASES, ids=[str(i) for i in range(len(LAYOUT_CASES))])
def test_trainer_and_planner_take_the_same_layouts(entry, layout, refusal, capsys):
    """The mesh degrees and the chunk (:class:`fpdt.options.LayoutOptions`) and how they cut the
    sequence (:func:`fpdt.layout.chunking_problems`) are read and refused once, by ``fpdt-train``
    (flags, JSON) and ``fpdt-plan`` (:class:`Setup`, :class:`Choice`) alike."""
    try:
        LAYOUT_ENTRIES[entry](layout)
        got = None
    except SystemExit as e:
        got = f"argparse refused it (exit {e.code})"
    except (ValueError, TypeError) as e:
        got = str(e)
    if refusal is None:
        assert got is None, f"{entry} refused {layout}: {got}"
    elif got is not None and got.startswith("argparse refused"):
        assert "invalid choice" in capsys.readouterr().err
    else:
        assert got is not None and refusal in got, (entry, got)
