"""Each rule has one home, and every entry point that applies it says the same words: the layer
counts against the model, the position ids under sequence parallelism, the window's inputs
(``prepare_inputs``), the trainer's option checks, the planner's meshes and ``--doc-len``, a
resolved layout's degrees, the Gated DeltaNet refusals; and no private state is read by index."""

import re

import pytest

import fpdt.hf
from fpdt import model as fm
from fpdt.options import LAYER_COUNTS, in_flag_terms, layer_count_problems
from fpdt.plan import load_model_config
from fpdt.plan.setup import Setup
from fpdt.train import preflight
from tests.model.helpers import hf_config, hf_model

pytestmark = pytest.mark.filterwarnings("ignore")

CFG = hf_config("llama_gqa")                      # 2 decoder layers
SAVE = dict(checkpointing="on", attention_checkpoint="save")
OFFLOAD = dict(checkpointing="offload", offload=True, runtime="sim")
LAYER_CASES = [  # (the count over the model's 2 layers, the options it needs)
    ("checkpoint_device_layers", OFFLOAD),
    ("save_attention_layers", SAVE),
    ("nvme_layers", dict(OFFLOAD, nvme_path="/nvme")),
]


def _message(call) -> str:
    with pytest.raises(ValueError) as e:
        call()
    return str(e.value)


@pytest.mark.parametrize("name, needs", LAYER_CASES, ids=[n for n, _ in LAYER_CASES])
def test_one_layer_count_check(name, needs, tmp_path):
    """fpdt.model, fpdt.hf, fpdt-train's preflight and fpdt-plan's setups refuse a count above the
    model's layers with the words of :func:`fpdt.options.layer_count_problems`."""
    assert set(LAYER_COUNTS) == {n for n, _ in LAYER_CASES}
    opts = {**needs, name: 3}
    (want,) = layer_count_problems(2, **{name: 3})
    assert want.startswith(f"{name}=3 is more than the model's 2 decoder layers; use at most 2")
    assert _message(lambda: fm.from_config(CFG.to_dict(), num_chunks=2, **opts)) == want
    model = fm.from_config(CFG.to_dict(), num_chunks=2, **needs)
    assert _message(lambda: model.configure(**{name: 3})) == want
    if name != "checkpoint_device_layers":          # fpdt.hf keeps one tier (its own refusal)
        assert _message(lambda: fpdt.hf.apply_fpdt(hf_model("llama_gqa"), num_chunks=2, **opts)) == want
    path = str(tmp_path / "config.json")
    CFG.to_json_file(path)
    cfg = preflight.model_source(None, path).config
    assert _message(lambda: preflight.check_layer_counts(cfg, path, **{name: 3})) == f"{path}: {want}"
    problems = Setup.build(seq_len=64, chunk_size=32, **opts).problems(load_model_config(CFG.to_dict()), 1)
    assert problems == [want]
    flag = in_flag_terms(want)                       # both command lines word it in their flags
    assert flag.startswith("--" + name.replace("_", "-") + " 3 is more than the model's 2 decoder layers")
    assert layer_count_problems(2, **{name: 2}) == layer_count_problems(2, **{name: None}) == []
    assert layer_count_problems(2, **{name: -1}) == []          # FPDTOptions.problems' to report


def test_one_position_ids_rule(monkeypatch):
    """A forward without ``position_ids`` under sequence parallelism is refused by
    :func:`fpdt.model.inputs.require_position_ids` for fpdt.model and fpdt.hf alike, each naming
    its own ``prepare_inputs`` (the ranks' sizes stand in for a 2-rank group)."""
    import torch
    from fpdt.hf.settings import HFSettings
    from fpdt.model.inputs import require_position_ids

    ids = torch.randint(0, CFG.vocab_size, (1, 8))
    words = {}
    for prepare in ("fpdt.model.prepare_inputs", "fpdt.hf.prepare_inputs"):
        with pytest.raises(ValueError) as e:
            require_position_ids(None, 2, prepare)
        words[prepare] = str(e.value)
        require_position_ids(None, 1, prepare)
        require_position_ids(torch.arange(8)[None], 2, prepare)
    assert words["fpdt.model.prepare_inputs"].startswith("position_ids are required with sequence parallelism (sp=2)")
    model = fm.from_config(CFG.to_dict(), num_chunks=1)
    monkeypatch.setattr(model, "sp_rank_size", lambda: (0, 2))
    assert _message(lambda: model(ids)) == words["fpdt.model.prepare_inputs"]
    hf = fpdt.hf.apply_fpdt(hf_model("llama_gqa"), num_chunks=1)
    monkeypatch.setattr(HFSettings, "rank_size", lambda self: (0, 2))
    with pytest.raises(fpdt.hf.FPDTHFError) as e:
        hf(input_ids=ids)
    assert str(e.value) == words["fpdt.hf.prepare_inputs"]


def test_no_private_attribute_read_by_index():
    """A private attribute holding a tuple read by position (``layers[0]._fpdt_checkpoint[2]``)
    breaks silently when the tuple changes: fpdt reads such state by name."""
    import pathlib
    import re

    pattern = re.compile(r"\._[A-Za-z]\w*\[-?\d+\]|getattr\([^()]*[\"']_\w+[\"'][^()]*\)\[")
    package = pathlib.Path(__file__).resolve().parent.parent / "fpdt"
    found = [f"{path}:{n}: {line.strip()}" for path in sorted(package.rglob("*.py"))
             for n, line in enumerate(path.read_text().splitlines(), 1) if pattern.search(line)]
    assert not found, "\n".join(found)


@pytest.mark.parametrize("fixed, sp, meshes", [
    ({}, 4, [(1, 4), (2, 2), (4, 1)]),
    (dict(hp=2), 4, [(2, 2)]),
    (dict(cp=4), 4, [(1, 4)]),
    (dict(hp=3), 4, []),                 # 3 does not divide 4 ranks
    (dict(hp=2, cp=2), 4, [(2, 2)]),
    (dict(hp=2, cp=2), 8, []),           # not 8 ranks
])
def test_planner_meshes_are_read_as_the_trainer_reads_them(fixed, sp, meshes):
    """The planner's search tries the meshes :meth:`LayoutOptions.degrees` gives for what the
    caller fixed, the function ``fpdt-train`` resolves its flags with."""
    from fpdt.options import LayoutOptions
    from fpdt.plan.planner import Choice, _meshes

    assert _meshes(Choice().fix(**fixed), sp) == meshes
    if fixed and meshes:
        assert meshes == [LayoutOptions(sp=sp, **fixed).degrees()]


def test_one_prepare_inputs_signature():
    """fpdt.model.prepare_inputs, the model's method and fpdt.hf.prepare_inputs take the window
    by the same keywords (names, order, defaults, keyword-only); they differ only in where the
    layout comes from (explicit, the model) and fpdt.hf's Transformers ``attention_mask``."""
    import inspect

    import torch

    def window(fn, skip):
        params = list(inspect.signature(fn).parameters.values())[skip:]
        return [(p.name, p.kind, p.default) for p in params]

    core = window(fm.prepare_inputs, 1)
    shared = core[:5]
    assert [n for n, _, _ in shared] == ["labels", "position_ids", "doc_ids", "cu_seqlens", "shift"]
    assert all(kind is inspect.Parameter.KEYWORD_ONLY for _, kind, _ in core)
    assert [n for n, _, _ in core[5:]] == ["sp_size", "rank", "num_chunks", "mesh"]
    assert window(fm.FPDTForCausalLM.prepare_inputs, 2) == shared
    assert window(fpdt.hf.prepare_inputs, 2) == shared + [("attention_mask", inspect.Parameter.KEYWORD_ONLY, None)]
    # and the same tensors for the same window, shifted or not
    ids = torch.randint(0, CFG.vocab_size, (2, 16))
    pos = torch.cat([torch.arange(6), torch.arange(10)]).expand(2, 16)
    model = fm.from_config(CFG.to_dict(), num_chunks=2)
    hf = fpdt.hf.apply_fpdt(hf_model("llama_gqa"), num_chunks=2)
    for shift in (True, False):
        want = fm.prepare_inputs(ids, labels=ids.flip(1), position_ids=pos, shift=shift, sp_size=1, rank=0,
                                 num_chunks=2)
        got = model.prepare_inputs(ids, labels=ids.flip(1), position_ids=pos, shift=shift)
        theirs = fpdt.hf.prepare_inputs(hf, ids, labels=ids.flip(1), position_ids=pos, shift=shift)
        assert all(torch.equal(want[k], got[k]) for k in want) and want.keys() == got.keys()
        assert torch.equal(theirs.pop("shift_labels"), want.pop("labels"))
        assert theirs.keys() == want.keys() and all(torch.equal(want[k], theirs[k]) for k in want)


def test_trainer_options_validated_once(monkeypatch):
    """``fpdt-train`` reads its options (flags, the JSON section: :func:`merge_options`, which
    refuses only unknown keys) and checks them once, in :func:`validate`, with the device
    defaults resolved: the layout's problems and the model options' problems each run once."""
    from fpdt.cli.train import build_parser, fpdt_options
    from fpdt.options import FPDTOptions, LayoutOptions
    from fpdt.train.config import ConfigError, merge_options, validate

    calls = {"layout": 0, "options": 0}

    def counted(name, method):
        def run(self):
            calls[name] += 1
            return method(self)
        return run

    monkeypatch.setattr(LayoutOptions, "layout_problems", counted("layout", LayoutOptions.layout_problems))
    monkeypatch.setattr(FPDTOptions, "problems", counted("options", FPDTOptions.problems))
    argv = ["--model-config", "c.json", "--data", "d", "--seq-len", "64", "--steps", "1", "--checkpoint", "on"]
    opts = fpdt_options(build_parser().parse_args(argv), {"lm_head_wgrad": "sliced", "cp": 0})
    assert calls == {"layout": 0, "options": 0}        # read, not checked
    with pytest.raises(ConfigError, match="cp=0 must be an integer >= 1"):
        validate(opts, 64, 1, "cpu", {})
    with pytest.raises(ConfigError, match="fpdt option lm_head_wgrad='sliced' must be one of"):
        validate(merge_options({}, {"lm_head_wgrad": "sliced"}), 64, 1, "cpu", {})
    calls.update(layout=0, options=0)
    validate(merge_options({}, {"checkpoint": "on"}), 64, 1, "cpu", {})
    assert calls == {"layout": 1, "options": 1}


def test_run_layout_computes_what_it_derives():
    """``fpdt-train``'s :class:`RunLayout` and ``fpdt-plan``'s :class:`Setup` resolve their
    mesh by the one rule (:meth:`LayoutOptions.degrees`, through :meth:`LayoutOptions.resolved`), and
    ``sp``, the run's ``dp`` and ``num_chunks`` are computed from the degrees, the world size and the
    chunking: neither class stores them, so no copy has to forget one."""
    from dataclasses import fields, replace

    from fpdt.options import LayoutOptions
    from fpdt.train.config import RunLayout, TrainerOptions, validate

    run = validate(TrainerOptions(hp=2, chunk_size=16), 64, 4, "cpu", {})
    assert (run.sp, run.hp, run.cp, run.dp, run.num_chunks, run.placement) == (2, 2, 1, 2, 4, "head_first")
    for cls in (RunLayout, Setup):
        assert not {"sp", "dp", "num_chunks"} & {f.name for f in fields(cls)}, cls
    wider = replace(run, world_size=8, chunk_size=32, cp=2)
    assert (wider.sp, wider.dp, wider.num_chunks) == (4, 2, 2)
    for given in (dict(sp=4), dict(hp=2, cp=2), dict(sp=4, cp=2), dict(cp=4)):
        run = RunLayout(world_size=8, seq_len=64, mlp_chunks=None, **LayoutOptions(**given, chunk_size=16).resolved())
        setup = Setup.build(64, 16, **given)
        assert (run.sp, run.hp, run.cp, run.placement) == (setup.sp, setup.hp, setup.cp, setup.placement)
        assert run.sp == 4 and run.dp == 2 and setup.num_chunks == run.num_chunks == 4
        assert setup.updated(hp=1).sp == setup.cp and setup.updated(sp=8, cp=1).hp == 8
    with pytest.raises(ValueError, match="sp=4 does not match hp=2 x cp=1"):
        Setup.build(64, 16, sp=4, hp=2, cp=1)


@pytest.mark.parametrize("doc_len", [0, -3, 2.5, True, "8"])
def test_one_doc_len_check(doc_len):
    """``fpdt-plan``'s search (:func:`plan`) and a :class:`Setup` refuse a mean document length
    with the words of :func:`fpdt.plan.setup.doc_len_problems`."""
    from fpdt.plan import GPU_PRESETS, Choice, Cluster, plan
    from fpdt.plan.setup import doc_len_problems

    (want,) = doc_len_problems(doc_len)
    assert want.startswith(f"--doc-len {doc_len!r} must be a whole number of tokens, at least 1")
    assert doc_len_problems(None) == doc_len_problems(4) == []
    cfg = load_model_config(CFG.to_dict())
    assert want in Setup(seq_len=64, chunk_size=32, doc_len=doc_len).problems(cfg, 1)
    with pytest.raises(ValueError, match=re.escape(want)):
        plan(cfg, Cluster(GPU_PRESETS["h100-80g"], gpus_per_node=1), seq_len=64, choice=Choice().fix(doc_len=doc_len))


def test_one_gated_deltanet_refusal():
    """What a model with Gated DeltaNet layers cannot run is refused by
    :func:`fpdt.model.apply.token_mixer_problems` in fpdt.model and fpdt.hf alike."""
    import dataclasses

    from fpdt.comm import SequenceMesh
    from fpdt.hf.model import _check_gated_deltanet
    from fpdt.model.apply import token_mixer_problems
    from fpdt.model.llama import check_token_mixers
    from fpdt.options import FPDTOptions
    from tests.model.qwen35 import qwen35_model

    streamed = dict(stream_layers=True, checkpointing="offload", offload=True)
    assert token_mixer_problems(True, FPDTOptions(**streamed)) == []       # streamed layers run them
    mesh = SequenceMesh.__new__(SequenceMesh)        # only its degrees are read
    mesh.hp, mesh.cp = 1, 2
    ring = dataclasses.replace(FPDTOptions(), mesh=mesh)
    (want,) = token_mixer_problems(True, ring)
    assert want.startswith("a context-parallel ring (cp=2) is not implemented for Gated DeltaNet layers")
    model = qwen35_model()
    assert _message(lambda: check_token_mixers(fm.ModelConfig.from_hf(model.config), ring)) == want
    assert _message(lambda: _check_gated_deltanet(list(model.model.layers), ring)) == want
    assert token_mixer_problems(False, ring) == token_mixer_problems(True, FPDTOptions()) == []


@pytest.mark.parametrize("name, needs", LAYER_CASES, ids=[n for n, _ in LAYER_CASES])
def test_fpdt_train_says_the_layer_count_check_in_flags(name, needs, tmp_path, capsys, monkeypatch):
    """``fpdt-train``'s own path (``main``) refuses the count with the one check's words, in flags."""
    from fpdt.cli.train import main
    from fpdt.train.config import option_key
    from tests.train.helpers import write_fixture

    monkeypatch.setenv("FPDT_RUNTIME", "sim")
    cfg_path, data = write_fixture(str(tmp_path))
    layers = preflight.model_source(None, cfg_path).config.num_layers
    given = {k: v for k, v in {**needs, name: layers + 1}.items() if k not in ("runtime", "offload")}
    flags = [a for k, v in given.items() for a in ("--" + option_key(k).replace("_", "-"), str(v))]
    flags += ["--offload"] if needs.get("offload") else []
    assert main(["--model-config", cfg_path, "--data", data, "--seq-len", "64", "--steps", "1", *flags]) == 2
    (want,) = layer_count_problems(layers, **{name: layers + 1})
    assert capsys.readouterr().err.strip().endswith(in_flag_terms(f"{cfg_path}: {want}"))
