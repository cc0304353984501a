"""One way to apply FPDT: ``FPDTForCausalLM.configure`` and ``fpdt.hf.apply_fpdt`` run the same steps of
:mod:`fpdt.model.apply`, in the same order, with the same decisions, each through its own adapter."""

import pytest
import torch

import fpdt.hf
from fpdt import model as fm
from fpdt.hf.apply_steps import TransformersAdapter
from fpdt.model.apply import (ATTENTION_FIELDS, DecoderAdapter, apply_all, loss_chunks_for, mlp_chunks_for,
                              norm_chunks)
from fpdt.model.layer_checkpoints import LayerCheckpoints
from fpdt.model.llama import FPDTAdapter, RMSNorm
from fpdt.model.loss import default_loss_chunks
from fpdt.model.mlp import default_mlp_chunks
from fpdt.options import FPDTOptions
from tests.model.helpers import compare, fpdt_from_hf, hf_config, hf_model, tokens

pytestmark = pytest.mark.filterwarnings("ignore")

SET_METHODS = ("start_attention", "set_attention", "set_norm_chunks", "set_mlp_chunks", "set_layer_checkpoints",
               "set_loss_chunks")
OPTIONS = [
    dict(),
    dict(num_chunks=2, offload=True, checkpointing="offload", mlp_chunks=0, loss_chunks=3, backend="math"),
    dict(num_chunks=4, checkpointing="on", attention_checkpoint="save", save_attention_layers=1, loss_chunks=0),
]


def _summary(method, args):
    """What a step asked of the adapter, without the modules (which differ between the two models)."""
    if method in ("start_attention", "set_attention"):
        return method, tuple(getattr(args[-1], f) for f in ATTENTION_FIELDS), args[-1].checkpointing
    if method == "set_layer_checkpoints":
        c = args[0]
        return method, c.mode, c.num_layers, c.on_host, c.saving
    return method, args[-1]


@pytest.fixture
def recorded(monkeypatch):
    """Each adapter class's calls, as :func:`_summary` rows, while the test runs."""
    calls = {FPDTAdapter: [], TransformersAdapter: []}
    for cls, log in calls.items():
        for method in SET_METHODS:
            original = getattr(cls, method)

            def spy(self, *args, _original=original, _method=method, _log=log):
                _log.append(_summary(_method, args))
                return _original(self, *args)
            monkeypatch.setattr(cls, method, spy)
    return calls


@pytest.mark.parametrize("options", OPTIONS, ids=["defaults", "offload", "save"])
def test_both_entry_points_compute_the_same_step(recorded, options, monkeypatch):
    """The same weights through fpdt.model and through apply_fpdt: the chunk counts the chunked
    MLP and RMSNorm functions are called with while the models run (what each adapter did with
    the step it was given, not only that it was asked), and what the two models compute (loss and
    every gradient, fp32 within 1e-5) agree with each other and with the options."""
    import fpdt.model.llama
    import fpdt.model.mlp

    seen = []
    # one MLP and one norm function for both models: apply_fpdt puts fpdt.model's modules in place
    for module, name, what in ((fpdt.model.mlp, "swiglu_of_linears", "mlp"), (fpdt.model.llama, "rms_norm", "norm")):
        def spy(*args, _original=getattr(module, name), _what=what, _at=4 if what == "mlp" else 3, **kwargs):
            if args[_at]:                    # 0: unchunked (fpdt.model's plain path, Transformers' own MLP)
                seen[-1].add((_what, args[_at]))
            return _original(*args, **kwargs)
        monkeypatch.setattr(module, name, spy)
    cfg = hf_config("llama_gqa")
    hf = hf_model("llama_gqa")
    ours = fpdt_from_hf(hf, **options)
    fpdt.hf.apply_fpdt(hf, **options)
    steps = recorded[FPDTAdapter]
    assert steps == recorded[TransformersAdapter]
    layers = cfg.num_hidden_layers
    assert [row[0] for row in steps] == (["start_attention"] + ["set_attention"] * layers
                                         + ["set_norm_chunks"] * (2 * layers + 1) + ["set_mlp_chunks"] * layers
                                         + ["set_layer_checkpoints", "set_loss_chunks"])
    ids, labels = tokens(cfg.vocab_size, 2, 32)
    results = []
    for model, prepare in ((ours, ours.prepare_inputs), (hf, lambda i, labels: fpdt.hf.prepare_inputs(hf, i, labels=labels))):
        seen.append(set())
        loss = model(**prepare(ids, labels=labels))
        loss = loss if isinstance(loss, torch.Tensor) else loss.loss
        loss.backward()
        results.append((loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}))
    (loss, grads), (ref_loss, ref_grads) = results
    compare(loss, grads, ref_loss, ref_grads, f"fpdt.model vs apply_fpdt {options}")
    opts = FPDTOptions(**options)
    mlp = mlp_chunks_for(opts, cfg)
    assert seen[0] == seen[1] == {("norm", 2 * opts.num_chunks)} | ({("mlp", mlp)} if mlp else set()), seen


def test_configure_runs_the_steps_again(recorded):
    model = fm.from_config(hf_config("llama_gqa").to_dict())
    del recorded[FPDTAdapter][:]
    model.configure(num_chunks=2, checkpointing="offload")
    assert ("set_mlp_chunks", model.mlp_chunks) in recorded[FPDTAdapter]
    assert ("set_norm_chunks", 4) in recorded[FPDTAdapter]
    assert model._checkpoints.mode == "offload"


@pytest.mark.parametrize("options", OPTIONS, ids=["defaults", "offload", "save"])
def test_configure_and_apply_fpdt_give_the_same_chunk_counts(options):
    cfg = hf_config("llama_gqa")
    model = fm.from_config(cfg.to_dict(), **options)
    hf = fpdt.hf.apply_fpdt(hf_model("llama_gqa"), **options).fpdt
    opts = FPDTOptions(**options)
    assert (model.mlp_chunks, model.loss_chunks) == (hf.mlp_chunks, hf.loss_chunks)
    assert model.mlp_chunks == (default_mlp_chunks(cfg.hidden_size, cfg.intermediate_size, opts.num_chunks)
                                if opts.mlp_chunks is None else opts.mlp_chunks)
    assert model.loss_chunks == (default_loss_chunks(cfg.vocab_size, cfg.hidden_size, opts.num_chunks)
                                 if opts.loss_chunks is None else opts.loss_chunks)
    for layer in model.model.layers:
        assert layer.mlp.num_chunks == model.mlp_chunks
        assert {f: getattr(layer.self_attn, f) for f in ATTENTION_FIELDS} == {f: getattr(opts, f)
                                                                              for f in ATTENTION_FIELDS}
    norms = [m for m in model.modules() if isinstance(m, RMSNorm)]
    assert len(norms) == 2 * cfg.num_hidden_layers + 1
    assert {m.num_chunks for m in norms} == {norm_chunks(opts.num_chunks)} == {2 * opts.num_chunks}


class _Recorder(DecoderAdapter):
    """A model of two layers that only records what each step asks."""

    def __init__(self):
        self.config = hf_config("llama_gqa")
        self.layers = ["layer 0", "layer 1"]
        self.calls = []

    def norms(self):
        return ["norm a", "norm b"]

    def start_attention(self, options):
        self.calls.append(("start_attention",))

    def set_attention(self, layer, options):
        self.calls.append(("set_attention", layer))

    def set_norm_chunks(self, norm, num_chunks):
        self.calls.append(("set_norm_chunks", norm, num_chunks))

    def set_mlp_chunks(self, layer, num_chunks):
        self.calls.append(("set_mlp_chunks", layer, num_chunks))

    def set_layer_checkpoints(self, checkpoints):
        self.calls.append(("set_layer_checkpoints", checkpoints.mode))

    def set_loss_chunks(self, num_chunks):
        self.calls.append(("set_loss_chunks", num_chunks))


def test_apply_all_runs_the_steps_in_the_documented_order():
    adapter = _Recorder()
    options = FPDTOptions(num_chunks=3, checkpointing="on", loss_chunks=7)
    applied = apply_all(adapter, options)
    mlp = mlp_chunks_for(options, adapter.config)
    assert adapter.calls == [
        ("start_attention",), ("set_attention", "layer 0"), ("set_attention", "layer 1"),
        ("set_norm_chunks", "norm a", 6), ("set_norm_chunks", "norm b", 6),
        ("set_mlp_chunks", "layer 0", mlp), ("set_mlp_chunks", "layer 1", mlp),
        ("set_layer_checkpoints", "on"), ("set_loss_chunks", 7)]
    assert (applied.mlp_chunks, applied.loss_chunks, applied.norm_chunks) == (mlp, 7, 6)
    assert isinstance(applied.checkpoints, LayerCheckpoints) and applied.checkpoints.num_layers == 2
    assert loss_chunks_for(FPDTOptions(num_chunks=3), adapter.config) == \
        default_loss_chunks(adapter.config.vocab_size, adapter.config.hidden_size, 3)
