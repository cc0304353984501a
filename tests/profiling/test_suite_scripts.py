"""CPU smoke tests of the measurement suite (profiling/): tiny sizes, JSON fields, plots.

Trials run in-process here (``--in-process``) to keep the suite fast; one test runs a
trial in a fresh subprocess, the way the scripts do by default.
"""

import json
import os

import pytest
import torch

from profiling import bench_common as bc
from profiling import chunk_sweep as cs
from profiling import lm_head_wgrad as lw
from profiling import max_seqlen as ms
from profiling import op_latency as ol
from profiling import plot
from profiling import strategies as st

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TRIAL_FIELDS = {"status", "measured", "strategy", "seq_len", "step_s", "fwd_bwd_s", "optimizer_s", "counted_step_s",
                "tokens_per_s", "mfu",
                "device_peak_bytes", "fwd_bwd_peak_bytes", "optimizer_peak_bytes", "optimizer_state_bytes",
                "first_step_device_peak_bytes", "device_reserved_peak_bytes", "host_peak_bytes", "host_rss_peak_bytes"}


@pytest.fixture(scope="module")
def lengths_run(tmp_path_factory):
    """Every strategy at 64 and 128 tokens, in one results directory (shared by the plot test)."""
    out_dir = tmp_path_factory.mktemp("results")
    return out_dir, ms.main(["--tiny", "--in-process", "--lengths", "64", "128", "--out-dir", str(out_dir)])


def test_max_seqlen_every_strategy(lengths_run):
    tmp_path, out = lengths_run
    saved = json.loads((tmp_path / "max_seqlen.json").read_text())
    assert saved["mode"] == "lengths" and set(saved["strategies"]) == {"fpdt", "fpdt-no-offload", "hf", "alst"}
    from importlib.metadata import version
    assert saved["software"] == {"torch": torch.__version__, "cuda": None, "cudnn": None,      # CPU: no CUDA
                                 "transformers": version("transformers"), "deepspeed": version("deepspeed"),
                                 "flash_attn": None}
    for name, entry in out["strategies"].items():
        assert entry["status"] == "ran", (name, entry)
        for t in entry["trials"]:
            assert t["status"] == "ok" and TRIAL_FIELDS <= set(t), (name, t)
            assert t["device_peak_bytes"] > t["param_bytes"] > 0 and t["mfu"] > 0
            assert t["first_step_device_peak_bytes"] == t["counted_device_peak_bytes"]
            assert t["device_reserved_peak_bytes"] is None
            # AdamW: two fp32 moments per parameter (fp32 run) and a scalar step count per tensor
            assert 0 < t["optimizer_state_bytes"] - 2 * t["param_bytes"] <= 4 * 64
            # the optimizer step holds parameters, gradients and both moments at once
            assert t["optimizer_peak_bytes"] >= 4 * t["param_bytes"]
            assert t["fwd_bwd_peak_bytes"] > t["param_bytes"]
            assert t["first_step_device_peak_bytes"] == max(t["fwd_bwd_peak_bytes"], t["optimizer_peak_bytes"])
            assert t["device_peak_bytes"] == max(t["fwd_bwd_peak_bytes"] + t["optimizer_state_bytes"],
                                                 t["optimizer_peak_bytes"])
            assert 0 < t["fwd_bwd_s"] < t["step_s"] and t["timed_step"] and t["counted_step_s"] > 0
        assert entry["max_completed_len"] == 128 and entry["slope_device_bytes_per_1k_tokens"] is not None
        # activations grow with the length, whatever the optimizer step does
        assert entry["slope_fwd_bwd_device_bytes_per_1k_tokens"] > 0, name
    by = {n: e["trials"][-1] for n, e in out["strategies"].items()}
    assert by["fpdt"]["host_peak_bytes"] > 0 and by["fpdt-no-offload"]["host_peak_bytes"] == 0
    assert by["alst"]["host_peak_bytes"] > 0          # DeepSpeed's offload, hooked on the CPU
    assert by["hf"]["host_peak_bytes"] == 0
    assert "planned_device_peak_bytes" in by["fpdt"] and "planned_device_peak_bytes" not in by["hf"]
    # the kernel each ran: fpdt's automatic choice on the CPU, and torch's SDPA dispatch for the peers
    from fpdt.attention.kernels.torch_cuda import sdpa_choice
    sdpa = f"sdpa:{sdpa_choice(torch.device('cpu'), torch.float32, 4, 2, 16)}"
    assert {n: t["attention_kernel"] for n, t in by.items()} == {"fpdt": "cpu", "fpdt-no-offload": "cpu", "hf": sdpa,
                                                               "alst": sdpa}
    assert by["fpdt"]["planned_setup"]["kernel_expands_gqa"] is True      # the CPU kernel repeats KV heads


def test_named_attention_backend(tmp_path):
    """--attention-backend reaches the fpdt trials (also in a fresh process) and the planner's
    GQA expansion follows that kernel; a kernel that cannot run here stops before any trial."""
    out = ms.main(["--tiny", "--in-process", "--strategies", "fpdt", "--lengths", "64", "--attention-backend", "math",
                   "--out-dir", str(tmp_path)])
    t = out["strategies"]["fpdt"]["trials"][0]
    assert t["status"] == "ok" and t["attention_kernel"] == "math" and t["planned_setup"]["kernel_expands_gqa"]
    args = ms.build_parser().parse_args(["--tiny", "--chunk-size", "64", "--dtype", "fp32", "--attention-backend", "math"])
    assert ms.trial_argv(args, "fpdt", 64)[-3:-1] == ["--attention-backend", "math"]
    plot.main([str(tmp_path), "--readme", ""])
    table = (tmp_path / "results.md").read_text()     # a named kernel's trials are rows of their own
    assert "| fpdt [math] | 64 |" in table and "- attention kernel: fpdt [math] `math`" in table
    with pytest.raises(SystemExit, match="--attention-backend cuda_flash: attention backend 'cuda_flash' is not "
                                         "available here"):
        ms.main(["--tiny", "--in-process", "--strategies", "fpdt", "--lengths", "64", "--attention-backend",
                 "cuda_flash", "--out-dir", str(tmp_path)])


def test_alst_cpu_hook_restores_deepspeed():
    from deepspeed.runtime.activation_checkpointing import offload_activations as oa
    before = dict(vars(oa._ActivationOffloadEngine))
    with st.cpu_offload_hooks(oa._ActivationOffloadEngine):
        assert oa._ActivationOffloadEngine._should_skip is not before["_should_skip"]
    assert all(vars(oa._ActivationOffloadEngine)[k] is before[k] for k in before)


def test_bisection_and_simulated_capacity(tmp_path):
    out = ms.main(["--tiny", "--in-process", "--strategies", "hf", "--out-dir", str(tmp_path), "--max-len", "256"])
    entry = out["strategies"]["hf"]
    assert entry["max_seq_len"] == 256 and [t["seq_len"] for t in entry["trials"]] == [64, 128, 256]
    small = entry["trials"][0]["device_peak_bytes"] / 2 ** 30
    capped = ms.main(["--tiny", "--in-process", "--strategies", "hf", "--out-dir", str(tmp_path),
                      "--max-len", "256", "--device-mem-gib", str(small * 0.999)])
    first = capped["strategies"]["hf"]["trials"][0]
    assert first["status"] == "oom" and "--device-mem-gib" in first["error"]
    assert capped["strategies"]["hf"]["max_seq_len"] == 0
    # bisection stops a trial at the allocation that passes the capacity, as a GPU would
    half = ms.main(["--tiny", "--in-process", "--strategies", "hf", "--out-dir", str(tmp_path),
                    "--max-len", "256", "--device-mem-gib", str(small * 0.6)])
    first = half["strategies"]["hf"]["trials"][0]
    assert first["status"] == "oom" and "during the step" in first["error"] and not first.get("measured")
    # fixed lengths run to the end and are measured (the slopes use them), marked out of memory
    fixed = ms.main(["--tiny", "--in-process", "--strategies", "hf", "--out-dir", str(tmp_path),
                     "--lengths", "64", "--device-mem-gib", str(small * 0.6)])
    t = fixed["strategies"]["hf"]["trials"][0]
    assert t["status"] == "oom" and t["measured"] and t["device_peak_bytes"] == entry["trials"][0]["device_peak_bytes"]


def test_trial_runs_in_a_fresh_process(tmp_path):
    args = ms.build_parser().parse_args(["--tiny", "--chunk-size", "64", "--dtype", "fp32"])
    r = ms.run_one(args, "fpdt", 64, [])
    assert r["status"] == "ok" and TRIAL_FIELDS <= set(r)
    args.timed_step = False                  # the flag reaches the trial process
    r = ms.run_one(args, "fpdt", 64, [])
    assert r["status"] == "ok" and not r["timed_step"] and r["step_s"] == r["counted_step_s"]


def test_slope_is_least_squares():
    trials = [{"status": "ok", "measured": True, "seq_len": s, "device_peak_bytes": 1000 + 3 * s}
              for s in (1024, 2048, 4096)]
    trials.append({"status": "oom", "seq_len": 8192})
    assert ms.slope_per_1k(trials) == pytest.approx(3 * 1024)
    assert ms.slope_per_1k(trials[:1]) is None


def test_chunk_sweep_op_latency_and_plots(lengths_run):
    tmp_path = lengths_run[0]
    sweep = cs.main(["--tiny", "--in-process", "--chunks", "64", "128", "--out-dir", str(tmp_path)])
    assert [r["chunk_size"] for r in sweep["rows"]] == [64, 128]
    for r in sweep["rows"]:
        assert r["status"] == "ok" and r["activation_bytes"] > 0
        assert r["model_states_bytes"] == 2 * r["param_bytes"] + r["optimizer_state_bytes"]
        assert r["first_step_device_peak_bytes"] == r["counted_device_peak_bytes"] > r["param_bytes"]   # CPU: counted
        assert r["device_reserved_peak_bytes"] is None and r["host_peak_bytes"] > 0           # fpdt offloads
        assert r.get("exposed_copy_s") is None          # CUDA only
    lat = ol.main(["--tiny", "--out-dir", str(tmp_path), "--backends", "all", "cuda_flash"])
    assert [r["chunk"] for r in lat["chunks"]] == [64, 128]
    assert all(r["full_fwd_s"] > 0 and r["full_bwd_s"] > 0 and r["all_to_all_s"] is None for r in lat["chunks"])
    for r in lat["chunks"]:      # --backends: every kernel that runs here, torch's SDPA, and a named one that cannot
        assert list(r["kernels"]) == ["cpu", "sdpa", "cuda_flash"] and r["backend"] == "cpu"
        assert r["kernels"]["cpu"]["backend"] == "cpu" and r["kernels"]["sdpa"]["backend"].startswith("sdpa:")
        for name in ("cpu", "sdpa"):
            assert all(r["kernels"][name][f"{b}_{d}_s"] > 0 for b in ("diag", "full") for d in ("fwd", "bwd"))
        assert "is not available here" in r["kernels"]["cuda_flash"]["error"]
    with pytest.raises(SystemExit, match="unknown kernel"):
        ol.main(["--tiny", "--out-dir", str(tmp_path / "x"), "--backends", "flash4"])
    from fpdt.plan import load_calibration
    cal = load_calibration(tmp_path / "calibration.json")
    assert cal["gemm_flops"] > 0 and cal["attention_flops"] > 0 and cal["h2d_bytes_s"] > 0
    assert cal["memory_bytes_s"] > 0
    # the automatic kernel's attention rate, and every kernel timed with --backends
    assert cal["attention_backend"] == "cpu" and set(cal["attention_flops_by_kernel"]) == {"cpu", "sdpa"}
    assert cal["attention_flops"] == cal["attention_flops_by_kernel"]["cpu"]
    # the planner's step time from this machine's rates
    run = ms.main(["--tiny", "--in-process", "--strategies", "fpdt", "--lengths", "64", "--out-dir",
                   str(tmp_path / "calibrated"), "--calibration", str(tmp_path / "calibration.json")])
    t = run["strategies"]["fpdt"]["trials"][0]
    assert t["planned_rates"] == "calibration" and t["planned_step_s"] > 0
    assert t["planned_step_s"] == pytest.approx(sum(t["planned_step_split_s"].values()))
    readme = tmp_path / "README.md"
    readme.write_text("# Benchmarks\n\nkept\n\n<!-- plot.py begin -->\nold\n<!-- plot.py end -->\ntail\n")
    out = plot.main([str(tmp_path), "--readme", str(readme)])
    names = {os.path.basename(p) for p in out["written"]}
    assert {"chunk_sweep.png", "op_latency.png", "memory_vs_length.png", "results.md"} <= names
    for p in out["written"]:
        assert os.path.getsize(p) > 0
    text = readme.read_text()
    assert "kept" in text and "tail" in text and "old" not in text
    assert "fpdt / hf step time" in text and "| fpdt | 128 |" in text
    assert "fpdt / hf fwd+bwd device slope" in text and "planned allocated MiB (/ measured)" in text
    assert "- attention kernel: fpdt `cpu`; fpdt-no-offload `cpu`; hf `sdpa:" in text


def test_extrapolation_uses_the_growing_peak():
    """The optimizer step's constant peak does not hide the activations' growth: the line is
    fitted to the forward+backward peak with the optimizer state beside it."""
    mib = 2 ** 20
    trials = [{"status": "ok", "measured": True, "seq_len": s, "device_peak_bytes": 100 * mib,
               "fwd_bwd_peak_bytes": 10 * mib + 1024 * s, "optimizer_state_bytes": 20 * mib,
               "optimizer_peak_bytes": 100 * mib} for s in (1024, 2048, 4096)]
    # 30 MiB + 1 KiB per token reaches 1 GiB at (1024 - 30) * 1024 tokens
    assert plot._extrapolate(trials, 1024 * mib) == (1024 - 30) * 1024
    assert plot._extrapolate(trials, 50 * mib) is None          # the optimizer step alone passes it
    old = [{"status": "ok", "measured": True, "seq_len": s, "device_peak_bytes": 2 * s} for s in (1, 2)]
    assert plot._extrapolate(old, 10) == 5                     # files without the phase split


@pytest.mark.slow
@pytest.mark.long
@pytest.mark.timeout(960)      # its two runs' own limits (600 s + 300 s): ~3 CPU-minutes, 7 on 2 busy cores
def test_run_suite_tiny_end_to_end(tmp_path):
    """The one command of the suite, at CPU smoke sizes: every piece runs (each trial in its own
    process, as on a GPU), the JSON of every script and the plots land in --out-dir, and the
    repository's benchmarks/README.md is left alone. ``--only`` runs a subset of the pieces."""
    import subprocess
    readme = os.path.join(ROOT, "benchmarks", "README.md")
    before = open(readme).read()
    out = tmp_path / "suite"
    proc = subprocess.run(["bash", os.path.join(ROOT, "profiling", "run_suite.sh"), "--tiny", "--out-dir", str(out)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "(0 piece(s) stopped early)" in proc.stdout, proc.stdout[-2000:]
    names = set(os.listdir(out))
    assert {"op_latency.json", "calibration.json", "chunk_sweep.json", "lm_head_wgrad.json", "results.md",
            "hf_integration.json", "hf_integration.md",
            "memory_vs_length.png", "max_seqlen.png", "chunk_sweep.png", "op_latency.png"} <= names
    for s in ("fpdt", "fpdt-no-offload", "hf", "alst"):
        data = json.loads((out / f"max_seqlen-{s}.json").read_text())
        trials = data["strategies"][s]["trials"]
        assert [t["seq_len"] for t in trials] == [64, 128] and all(t["status"] == "ok" for t in trials), s
    assert open(readme).read() == before
    only = subprocess.run(["bash", os.path.join(ROOT, "profiling", "run_suite.sh"), "--tiny", "--only", "^plot$",
                           "--out-dir", str(out)], capture_output=True, text=True, timeout=300)
    assert only.returncode == 0 and "== plot" in only.stdout and "== op_latency" not in only.stdout, only.stdout


def test_step_must_be_whole_fpdt_chunks(tmp_path):
    with pytest.raises(SystemExit, match="multiple of --chunk-size"):
        ms.main(["--tiny", "--in-process", "--strategies", "fpdt", "--chunk-size", "64", "--step", "96",
                 "--out-dir", str(tmp_path)])


def test_markdown_with_two_capacities(tmp_path):
    """Fixed lengths at one capacity and a bisection at another: one measured-longest column
    per capacity; slopes and the extrapolation come from the fixed-length trials only."""
    mib = 2 ** 20

    def trial(n, ok, fb):
        return {"status": "ok" if ok else "oom", "measured": True, "seq_len": n, "step_s": 1.0,
                "device_peak_bytes": 100 * mib + fb, "fwd_bwd_peak_bytes": fb, "optimizer_state_bytes": 100 * mib,
                "optimizer_peak_bytes": 150 * mib, "host_peak_bytes": 0}
    lengths = {"mode": "lengths", "device_mem_gib": 2, "strategies": {"alst": {"status": "ran", "trials": [
        trial(1024, True, 1024 * 1024), trial(2048, True, 2048 * 1024)]}}}
    bisect = {"mode": "bisect", "device_mem_gib": 1, "strategies": {"alst": {"status": "ran", "max_seq_len": 1536,
              "trials": [trial(1024, True, 5 * mib), trial(2048, False, 9 * mib), trial(1536, True, 7 * mib)]}}}
    strats = plot._strategies([lengths, bisect])
    assert strats["alst"]["caps"] == {2: {"best": 2048, "open_ended": True}, 1: {"best": 1536, "open_ended": False}}
    md = plot.markdown(strats, [lengths, bisect], "x")
    assert "longest that fits 1 GiB (measured) | longest that fits 2 GiB (measured)" in md
    assert "| alst | 1536 | >= 2048 (longest tried) | 1024.0 |" in md          # slope: 1 KiB per token
    assert "1536 (bisection at 1 GiB)" in md
    assert plot._extrapolate(plot._fit_trials(strats["alst"]["trials"]), 2 * 1024 * mib) == 2 * 1024 * 1024 - 100 * 1024


def test_markdown_sets_only_calibrated_step_times_beside_measured():
    """The planner's step time from datasheet rates (a run without --calibration) is another
    machine's: the table leaves it out rather than print a meaningless ratio."""
    mib = 2 ** 20

    def trial(n, rates):
        return {"status": "ok", "measured": True, "seq_len": n, "step_s": 10.0, "device_peak_bytes": 200 * mib,
                "fwd_bwd_peak_bytes": 100 * mib, "host_peak_bytes": 0, "planned_device_peak_bytes": 210 * mib,
                "planned_step_s": 5.0, "planned_rates": rates}
    run = {"mode": "lengths", "device_mem_gib": 2, "strategies": {"fpdt": {"status": "ran", "trials": [
        trial(1024, "calibration"), trial(2048, "h100-80g datasheet")]}}}
    md = plot.markdown(plot._strategies([run]), [run], "x")
    assert "| fpdt | 1024 | 200.0 | 100.0 | 0.0 | 200.0 | 10.00 | 102 | - | 210.0 (1.050) | 5.00 (0.50) |" in md
    assert "| fpdt | 2048 | 200.0 | 100.0 | 0.0 | 200.0 | 10.00 | 205 | - | 210.0 (1.050) |  |" in md


def test_markdown_compares_allocated_with_allocated():
    """Beside the measured allocated peak the table sets the planner's allocated peak (states +
    activations), not its fits-in-the-GPU figure with the runtime reserve; and the MFU."""
    mib = 2 ** 20
    t = {"status": "ok", "measured": True, "seq_len": 1024, "step_s": 10.0, "device_peak_bytes": 200 * mib,
         "fwd_bwd_peak_bytes": 100 * mib, "host_peak_bytes": 0, "planned_device_peak_bytes": 2800 * mib,
         "planned_allocated_peak_bytes": 190 * mib, "planned_step_s": 9.0, "planned_rates": "calibration",
         "mfu": 0.25}
    run = {"mode": "lengths", "device": "some-gpu", "device_type": "cuda",
           "strategies": {"fpdt": {"status": "ran", "trials": [t]}}}
    md = plot.markdown(plot._strategies([run]), [run], "x")
    assert "| fpdt | 1024 | 200.0 | 100.0 | 0.0 | 200.0 | 10.00 | 102 | 0.250 | 190.0 (0.950) | 9.00 (0.90) |" in md
    assert "allocated peaks" in md and plot.markers([run]) == ("<!-- plot.py begin some-gpu -->",
                                                               "<!-- plot.py end some-gpu -->")


@pytest.mark.parametrize("limit,lo,hi,want,tried", [
    (13, 8, 16, 13, [8, 16, 12, 14, 13]),                 # doubling, then bisection
    (20, 8, 12, 12, [8, 12]),                              # doubling stops at --max-len, which is tried
    (10, 8, 12, 10, [8, 12, 10, 11]),                      # ... and bisected below it when it fails
    (5, 8, 16, 5, [8, 4, 6, 5]),                           # below --min-len
])
def test_bisection_order(monkeypatch, limit, lo, hi, want, tried):
    import types
    seen = []

    def fake(args, strategy, n, log, on_trial=None):
        seen.append(n)
        return {"status": "ok" if n <= limit else "oom"}
    monkeypatch.setattr(ms, "run_one", fake)
    args = types.SimpleNamespace(step=1, chunk_size=1, min_len=lo, max_len=hi, resolution=1)
    assert ms.bisect(args, "hf", []) == want and seen == tried


def test_lm_head_wgrad_script_fields(tmp_path):
    """Both modes measured on the same inputs; the fp32 run's peaks are equal-sized
    (recompute's [V, hidden] gradient is fp32 too), the bf16 run's recompute peak is lower."""
    assert lw.main(["--shape", "32", "1000", "64", "--dtype", "bf16", "--repeats", "1", "--out-dir", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "lm_head_wgrad.json").read_text())
    (row,) = data["rows"]
    assert set(row["modes"]) == {"accumulate", "recompute"} and data["dtype"] == "bfloat16"
    assert all(m["time_s"] > 0 and m["device_peak_bytes"] > 0 for m in row["modes"].values())
    assert row["peak_saved_bytes"] > 0 and row["peak_ratio"] < 1
    assert row["accumulator_bytes"] == 1000 * 32 * 4 and row["gemm_ratio_model"] == pytest.approx(4 / 3)
    assert row["planner_rates"] == "h100-80g datasheet" and set(row["planner_time_s"]) == {"accumulate", "recompute"}
    assert row["planner_time_ratio"] == pytest.approx(row["planner_time_s"]["recompute"]
                                                      / row["planner_time_s"]["accumulate"])


def test_pieces_stopped_by_their_budget_keep_what_they_measured(tmp_path, monkeypatch):
    """op_latency.py and chunk_sweep.py write their files after each chunk size (on the H100 a
    piece killed by its budget part-way had left nothing, and the next piece's --calibration
    pointed at a missing file); max_seqlen.py refuses a missing --calibration before any trial."""
    real = ol.attention_latency

    def dies_at_128(c, *a, **k):
        if c == 128:
            raise KeyboardInterrupt("stopped by the budget")
        return real(c, *a, **k)
    monkeypatch.setattr(ol, "attention_latency", dies_at_128)
    with pytest.raises(KeyboardInterrupt):
        ol.main(["--tiny", "--out-dir", str(tmp_path)])
    kept = json.loads((tmp_path / "op_latency.json").read_text())
    assert [r["chunk"] for r in kept["chunks"]] == [64]
    from fpdt.plan import load_calibration
    assert load_calibration(tmp_path / "calibration.json")["attention_flops"] > 0

    real_run = ms.run_one

    def sweep_dies_at_128(args, strategy, n, log, on_trial=None):
        if args.chunk_size == 128:
            raise KeyboardInterrupt("stopped by the budget")
        return real_run(args, strategy, n, log)
    monkeypatch.setattr(cs.ms, "run_one", sweep_dies_at_128)
    with pytest.raises(KeyboardInterrupt):
        cs.main(["--tiny", "--in-process", "--chunks", "64", "128", "--out-dir", str(tmp_path)])
    assert [r["chunk_size"] for r in json.loads((tmp_path / "chunk_sweep.json").read_text())["rows"]] == [64]

    with pytest.raises(SystemExit, match="no such file .*op_latency.py first"):
        ms.main(["--tiny", "--in-process", "--strategies", "fpdt", "--lengths", "64", "--out-dir", str(tmp_path),
                 "--calibration", str(tmp_path / "missing.json")])


def test_planned_peaks_swap_in_the_trials_own_states():
    """planned(): the allocated figure is the fits figure less the planner's reserve and
    fragmentation, and both hold the trial's own model states in place of the planner's."""
    from fpdt.plan import GPU_PRESETS, Cluster, evaluate, load_model_config
    from fpdt.plan.setup import Setup
    cfg = ms.load_config(ms.build_parser().parse_args(["--tiny"]))
    kw = dict(kernel_expands_gqa=False, lm_head_wgrad="recompute")
    own = ms.planned(cfg, "fpdt", 4096, 1024, "bf16", **kw)
    r = evaluate(load_model_config(cfg), Setup.build(seq_len=4096, chunk_size=1024, checkpointing="offload", offload=True,
                                               zero_stage=0, dtype="bf16", **kw),
                 Cluster(GPU_PRESETS["h100-80g"], gpus_per_node=1))
    assert own["planned_device_peak_bytes"] == r["device_peak_bytes"]
    assert own["planned_device_peak_bytes"] - own["planned_allocated_peak_bytes"] == r["breakdown"]["runtime_reserve"]
    assert own["planned_setup"] == {"lm_head_wgrad": "recompute", "kernel_expands_gqa": False}
    b = r["breakdown"]
    states = b["parameters"] + b["gradients"] + b["optimizer_state"]
    mine = ms.planned(cfg, "fpdt", 4096, 1024, "bf16", states_bytes=states / 2, **kw)
    for key in ("planned_device_peak_bytes", "planned_allocated_peak_bytes"):
        assert mine[key] == pytest.approx(own[key] - states / 2)


def test_a_first_step_whose_steady_state_passes_the_device_is_out_of_memory():
    gib = 2 ** 30
    assert ms.over_capacity(10 * gib, 12 * gib, None) is None
    assert ms.over_capacity(10 * gib, None, None) is None                       # CPU without a capacity
    assert "--device-mem-gib 2" in ms.over_capacity(3 * gib, 2 * gib, 2)         # the simulated capacity
    cuda = ms.over_capacity(81.2 * gib, 79.2 * gib, None)                        # hf at 49,152 on the H100
    assert "steady-state step peak 81.200 GiB" in cuda and "79.20 GiB free" in cuda
    assert "free to tensors" in ms.over_capacity(3 * gib, 1.5 * gib, 2)          # less free than simulated


def test_planner_rates_follow_the_trials_kernel(tmp_path):
    """A trial on a named kernel is planned with that kernel's calibrated attention rate; when
    the file lacks it, the rates label says whose rate stands in (and plot.py shows no ratio)."""
    path = tmp_path / "calibration.json"
    path.write_text(json.dumps({"gemm_flops": 1e14, "attention_flops": 2e14, "attention_backend": "cuda_cudnn",
                                "attention_flops_by_kernel": {"cuda_cudnn": 2e14, "cuda_flash": 1e14}}))
    rate = lambda kernel: bc.planner_cluster(str(path), kernel)[0].rates().attention_flops   # noqa: E731
    assert rate(None) == rate("cuda_cudnn") == 2e14 and rate("cuda_flash") == 1e14
    assert bc.planner_cluster(str(path), "cuda_flash")[1] == "calibration"
    assert bc.planner_cluster(str(path), "math")[1] == "calibration, attention rate of cuda_cudnn"
    assert bc.planner_cluster(None, "math")[1] == "h100-80g datasheet"


def test_results_table_names_the_cuda_stack():
    """A GPU results table says which torch, CUDA and cuDNN it ran on (torch's SDPA choice, and
    so the peers' attention kernel, depends on the runtime cuDNN); a CPU one has none to say."""
    gpu = {"device": "nvidia-h100", "device_type": "cuda", "commit": "abc", "date_utc": "2026-11-24",
           "software": {"torch": "2.11.0+cu130", "cuda": "13.0", "cudnn": 91501}}
    assert "abc, 2026-11-24, torch 2.11.0+cu130, CUDA 13.0, cuDNN 91501)" in plot.markdown({}, [gpu], "r")
    cpu = {**gpu, "device_type": "cpu", "software": {"torch": "2.13.0+cpu", "cuda": None, "cudnn": None}}
    assert "abc, 2026-11-24)" in plot.markdown({}, [cpu], "r")


def test_exposed_copy_time_from_a_trace():
    """FPDT Fig. 12's exposed copy time, from profiler events as a CUDA trace gives them
    (microseconds): host<->device copies minus their overlap with the union of compute
    kernels; device-to-device copies, memsets and host-side events count as neither."""
    from types import SimpleNamespace

    from torch.autograd import DeviceType

    def ev(name, start, end, device=DeviceType.CUDA):
        return SimpleNamespace(name=name, device_type=device, time_range=SimpleNamespace(start=start, end=end))
    events = [ev("ampere_bf16_gemm", 0, 10), ev("flash_fwd_kernel", 5, 20), ev("elementwise_kernel", 30, 40),
              ev("Memcpy HtoD (Pinned -> Device)", 8, 25),     # 12 of 17 under kernels
              ev("Memcpy DtoH (Device -> Pinned)", 35, 45),    # 5 of 10
              ev("Memcpy DtoD (Device -> Device)", 50, 90),    # neither copy nor compute
              ev("Memset (Device)", 60, 70), ev("cudaMemcpyAsync", 100, 200, DeviceType.CPU)]
    out = bc.exposed_copy_seconds(SimpleNamespace(events=lambda: events))
    assert out["copy_s"] == pytest.approx(27e-6) and out["exposed_copy_s"] == pytest.approx(10e-6)


def test_step_kernels_from_a_trace():
    """A traced step's kernels: busy time is the union of device spans (overlaps counted once,
    gaps not at all), classes and the ranking sum each kernel's own spans, host events count
    for nothing."""
    from types import SimpleNamespace

    from torch.autograd import DeviceType

    def ev(name, start, end, device=DeviceType.CUDA):
        return SimpleNamespace(name=name, device_type=device, time_range=SimpleNamespace(start=start, end=end))
    events = [ev("sm90_xmma_gemm_bf16bf16", 0, 10), ev("flash_fwd_kernel", 5, 20),
              ev("cudnn_generated_fort_native_sdpa_sm90_flash_bprop", 40, 70),
              ev("vectorized_elementwise_kernel", 80, 85), ev("vectorized_elementwise_kernel", 90, 95),
              ev("Memcpy DtoH (Device -> Pinned)", 15, 30), ev("Memset (Device)", 100, 101),
              ev("aten::mm", 0, 500, DeviceType.CPU)]
    out = bc.step_kernels(SimpleNamespace(events=lambda: events), top=3)
    assert out["gpu_busy_s"] == pytest.approx((30 + 30 + 5 + 5 + 1) * 1e-6)
    assert out["traced_s"] == pytest.approx(101e-6)
    assert out["kernel_class_s"] == pytest.approx({"attention": 45e-6, "copy_h2d_d2h": 15e-6, "gemm": 10e-6,
                                                   "other": 10e-6, "copy_device": 1e-6})
    assert [(k["name"], k["calls"]) for k in out["kernels_by_time"]] == [
        ("cudnn_generated_fort_native_sdpa_sm90_flash_bprop", 1), ("flash_fwd_kernel", 1),
        ("Memcpy DtoH (Device -> Pinned)", 1)]
    assert out["kernels_by_time"][0]["s"] == pytest.approx(30e-6)


def test_results_name_the_traced_time_and_every_kernel():
    """results.md: the save / recompute step ratio, a traced step's time per kernel class with its
    top kernels, and op_latency's kernels (asked for, ran, four timings; a failed one says so)."""
    prof = {"gpu_busy_s": 9.5, "traced_s": 10.0, "kernels_by_time": [{"name": "flash_bwd", "s": 4.0, "calls": 32}],
            "kernel_class_s": {"attention": 6.0, "gemm": 3.0, "copy_h2d_d2h": 1.5}}
    trial = {"status": "ok", "measured": True, "seq_len": 131072, "device_peak_bytes": 1, "host_peak_bytes": 0, "mode": "lengths",
             "cap": None}
    strats = {"fpdt": {"skipped": None, "caps": {None: {"best": 131072, "open_ended": True}},
                       "trials": [{**trial, "step_s": 20.0, "profile": prof, "exposed_copy_s": 0.25}]},
              "fpdt-save": {"skipped": None, "caps": {None: {"best": 131072, "open_ended": True}},
                            "trials": [{**trial, "step_s": 15.0}]}}
    md = plot.markdown(strats, [{"device": "nvidia-h200", "device_type": "cuda"}], "r")
    assert "fpdt-save / fpdt (saved attention outputs / recompute) step time: 131072: 0.75" in md
    assert "| fpdt | 131072 | 10.00 | 9.50 | 6.00 | 3.00 | 1.50 | 0.00 | 0.00 | 0.00 | 0.25 |" in md
    assert "| `flash_bwd` | 4.000 | 32 |" in md
    lat = {"diag_fwd_s": 0.001, "diag_bwd_s": 0.002, "full_fwd_s": 0.003, "full_bwd_s": 0.004}
    op = {"args": {"heads": 32, "kv_heads": 8, "head_dim": 64},
          "chunks": [{"chunk": 65536, "backend": "cuda_cudnn", **lat,
                      "kernels": {"sdpa": {"backend": "sdpa:cudnn", **lat}, "triton": {"error": "ImportError: no"}}}]}
    table = "\n".join(plot.kernel_table(op))
    assert "one 65536-token chunk (32 query / 8 KV heads of 64)" in table
    assert "| automatic | `cuda_cudnn` | 1.0 | 2.0 | 3.0 | 4.0 |" in table
    assert "| sdpa | `sdpa:cudnn` | 1.0 | 2.0 | 3.0 | 4.0 |" in table and "| triton | failed: ImportError: no |" in table
