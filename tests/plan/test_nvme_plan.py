"""The planner's NVMe tier (``docs/nvme.md``, ``docs/plan.md``): capacity tiering GPU -> host ->
NVMe, the host bytes each layer on disk frees, the drive's capacity, and whether its I/O hides
under compute."""

import pytest

from fpdt.layout import hidden_bytes
from fpdt.offload.nvme import ALIGN
from fpdt.plan import Cluster, Setup, load_model_config, plan
from fpdt.plan.cli import main
from fpdt.plan.hardware import GB, GIB, GPU_PRESETS, NVME_PRESETS, NVMeSpec, nvme_from_args
from fpdt.plan.memory_model import (NVME_STAGED_INPUTS, NVME_STAGED_SAVED, NVME_STAGED_STREAMED, estimate_memory,
                                    saved_attention_bytes)
from fpdt.plan.planner import Choice, evaluate

CFG = load_model_config("llama-3-8b")
S = 6 * 2 ** 20             # past the 4.29M that 1 TiB of host holds on 8 x H100


def _cluster(nvme=None):
    return Cluster(GPU_PRESETS["h100-80g"], gpus_per_node=8, host_mem_bytes=1024 * GIB, nvme=nvme)


def _setup(**options):
    return Setup.build(seq_len=S, chunk_size=2 ** 16, hp=8, nvme_path="/nvme", **options)


@pytest.mark.parametrize("stream,save", [(False, False), (False, True), (True, False)])
def test_each_layer_on_disk_frees_its_host_bytes(stream, save):
    """Host peak and NVMe bytes against nvme_layers: each layer past the staging buffers frees one
    layer input (and saved output) per rank; the disk holds every one of them."""
    opts = dict(stream_layers=stream, attention_checkpoint="save" if save else "recompute")
    mem = {k: estimate_memory(CFG, _setup(nvme_layers=k, **opts), 8, 8) for k in (0, 10, 20)}
    nd = hidden_bytes(S // 8, CFG.hidden_size, 2)
    # each saved output's two files per chunk padded to the store's alignment (fpdt.model.layer_checkpoints.nvme_bytes)
    per_saved = saved_attention_bytes(CFG, _setup(**opts)) + 2 * (S // 2 ** 16) * ALIGN if save else 0
    staged = (NVME_STAGED_STREAMED if stream else NVME_STAGED_INPUTS) * nd + (NVME_STAGED_SAVED * per_saved)
    assert mem[0].nvme_bytes == 0
    assert mem[10].nvme_bytes == 8 * 10 * (nd + per_saved)
    assert mem[0].host_peak_bytes - mem[10].host_peak_bytes == pytest.approx(8 * (10 * (nd + per_saved) - staged))
    assert mem[10].host_peak_bytes - mem[20].host_peak_bytes == pytest.approx(8 * 10 * (nd + per_saved))
    assert mem[0].device_peak_bytes == mem[20].device_peak_bytes        # the tier frees no device memory
    every = estimate_memory(CFG, _setup(**opts), 8, 8)                  # None: every offloaded layer
    assert every.nvme_bytes == 8 * (CFG.num_layers - (1 if stream else 0)) * (nd + per_saved)


def test_planner_tiers_by_capacity():
    """At 6M on 8 x H100 with 1 TiB host: without the tier the host does not hold the checkpoints;
    with a node's drives the planner moves the fewest first layers there that make it fit."""
    fixed = dict(stream_layers=False, checkpoint_device_layers=0, attention_checkpoint="recompute")
    without = plan(CFG, _cluster(), seq_len=S, choice=Choice().fix(**fixed))
    assert not without["fits"] and without["limited_by"] == "host"
    r = plan(CFG, _cluster(NVME_PRESETS["gen5-x8"]), seq_len=S, choice=Choice().fix(**fixed))
    assert r["fits"] and r["host_peak_bytes"] <= 1024 * GIB
    k = r["setup"]["nvme_layers"]
    assert 0 < k < CFG.num_layers and r["nvme"]["layers"] == k
    assert r["nvme"]["bytes_per_node"] <= NVME_PRESETS["gen5-x8"].capacity_bytes
    fewer = plan(CFG, _cluster(NVME_PRESETS["gen5-x8"]), seq_len=S,
                 choice=Choice().fix(chunk_size=r["setup"]["chunk_size"], hp=8, nvme_layers=k - 1, **fixed))
    assert not fewer["fits"] and fewer["limited_by"] == "host"
    assert r["recommended"]["nvme_layers"] > 0
    free = plan(CFG, _cluster(NVME_PRESETS["gen5-x8"]), seq_len=S)     # everything left to choose
    assert free["fits"] and free["setup"]["nvme_layers"] > 0


def test_drive_capacity_binds():
    small = NVMeSpec("small", 100 * GIB, 10 * GB, 10 * GB)
    r = evaluate(CFG, _setup(), _cluster(small))             # every layer on disk: the host holds the rest
    assert not r["fits"] and r["limited_by"] == "nvme"
    assert r["nvme"]["bytes_per_node"] > r["nvme"]["capacity_bytes"] == 100 * GIB


def test_io_hides_under_compute_or_not():
    """Writes against the forward's compute, reads against backward's: hidden on fast drives (only
    the first layer's read exposed), exposed on one slow enough."""
    s = _setup(nvme_layers=20)
    fast = evaluate(CFG, s, _cluster(NVME_PRESETS["gen5-x8"]))
    n = fast["nvme"]
    assert n["hidden"] and n["write_s"] < n["forward_s"] and n["read_s"] < n["backward_s"]
    assert fast["step_time_split_s"]["nvme_io"] == pytest.approx(n["read_s"] / 20)
    assert n["write_s"] == pytest.approx(n["bytes_per_node"] / (26 * GB))
    slow = evaluate(CFG, s, _cluster(NVMeSpec("slow", 1e15, 0.05 * GB, 0.02 * GB)))
    m = slow["nvme"]
    assert not m["hidden"] and m["write_s"] > m["forward_s"]
    assert slow["step_time_split_s"]["nvme_io"] == pytest.approx(
        m["write_s"] - m["forward_s"] + max(0.0, m["read_s"] - m["backward_s"]) + m["read_s"] / 20)
    assert slow["step_time_s"] > fast["step_time_s"]


def test_nvme_flags(capsys):
    assert nvme_from_args(None) is None
    spec = nvme_from_args("gen5-x8", gbps="40,20")
    assert (spec.read_bytes_s, spec.write_bytes_s, spec.capacity_bytes) == (40 * GB, 20 * GB, 8 * 3.84e12)
    assert nvme_from_args(None, gib=100).capacity_bytes == 100 * GIB
    base = ["--model", "llama-3-8b", "--gpu", "h100-80g", "--seq-len", str(S), "--no-stream-layers"]
    for bad, phrase in ((["--nvme-gbps", "fast"], "--nvme-gbps 'fast' must be READ or READ,WRITE"),
                        (["--nvme", "floppy"], "unknown NVMe preset 'floppy'"),
                        (["--nvme-gib", "0"], "--nvme-gib 0.0 must be > 0")):
        assert main(base + bad) == 2
        err = capsys.readouterr().err
        assert phrase in err and err.count("\n") == 1, err
    assert main(base + ["--nvme", "gen5-x8"]) == 0
    out = capsys.readouterr().out
    assert "nvme " in out and "hidden under compute" in out and "--nvme-path NVME_DIR --nvme-layers" in out


@pytest.mark.long
@pytest.mark.slow
def test_docs_predictions_are_the_planners():
    """docs/plan.md's NVMe table: the longest lengths fpdt-plan finds (six searches, ~30 s)."""
    import os

    from fpdt.plan.hardware import nvme_from_args
    eight = Cluster(GPU_PRESETS["h100-80g"], gpus_per_node=8, host_mem_bytes=1024 * GIB,
                    nvme=nvme_from_args("gen5-x8"))
    one = Cluster(GPU_PRESETS["h100-80g"], gpus_per_node=1, host_mem_bytes=512 * GIB,
                  nvme=nvme_from_args("gen4", gib=7450))
    big = Cluster(GPU_PRESETS["h100-80g"], gpus_per_node=8, host_mem_bytes=2048 * GIB, nvme=nvme_from_args("gen5-x8"))
    off = dict(offload_optimizer=True, offload_param=True)
    got = {(name, stream): plan(CFG, cluster, choice=Choice(**(off if name == "one" else {})).fix(stream_layers=stream),
                                search_max=True)["max_seq_len"]
           for name, cluster in (("eight", eight), ("one", one), ("big", big)) for stream in (False, True)}
    assert got == {("eight", False): 13631488, ("eight", True): 8912896,
                   ("one", False): 2162688, ("one", True): 3473408,
                   ("big", False): 14155776, ("big", True): 18153472}
    with open(os.path.join(os.path.dirname(__file__), "..", "..", "docs", "plan.md")) as f:
        doc = f.read()
    assert "| **13M** | 8.5M |" in doc and "| 2.06M | **3.31M** |" in doc and "| 13.5M | **17.3M** |" in doc


def test_fewest_layers_on_disk_once_saved_outputs_have_their_layers(monkeypatch):
    """At 5.5M on 8 x H100 with 1 TiB host, the plan saves attention outputs and keeps more layer
    inputs on the device for them, which frees host memory: the layers on disk are counted after
    that, so K is the fewest (K - 1 does not fit the host), where counting them before overshot."""
    from fpdt.plan import planner
    cluster = _cluster(NVME_PRESETS["gen5-x8"])
    choice = Choice().fix(stream_layers=False, chunk_size=2 ** 16, hp=8)
    S = 11 * 2 ** 19    # at 6M the plan recomputes attention: saving beside the loss (3 Nd, docs/plan.md) no longer fits
    r = plan(CFG, cluster, seq_len=S, choice=choice)
    s, k = r["setup"], r["setup"]["nvme_layers"]
    assert r["fits"] and s["attention_checkpoint"] == "save" and s["checkpoint_device_layers"] > 0 and k > 0
    tiers = dict(checkpoint_device_layers=s["checkpoint_device_layers"], attention_checkpoint="save",
                 save_attention_layers=s["save_attention_layers"])
    assert plan(CFG, cluster, seq_len=S, choice=choice.fix(nvme_layers=k, **tiers))["fits"]
    fewer = plan(CFG, cluster, seq_len=S, choice=choice.fix(nvme_layers=k - 1, **tiers))
    assert not fewer["fits"] and fewer["limited_by"] == "host"
    monkeypatch.setattr(planner, "_fewest_nvme_layers", lambda cfg, s, r, cluster: (s, r))   # counted before
    before = plan(CFG, cluster, seq_len=S, choice=choice)["setup"]
    assert before["nvme_layers"] > k and {n: before[n] for n in tiers} == tiers
