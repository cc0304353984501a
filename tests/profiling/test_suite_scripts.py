"""The measurement suite (profiling/) run as its users run it, ``python -m profiling.<name>`` in a
fresh process, at CPU smoke sizes: JSON fields, plots and the results table. Trials run in the
script's process (``--in-process``) except where a test says otherwise. What the scripts share
(fits, the results table, the search, traces) is tested in tests/bench.
"""

import json
import os
import subprocess
import sys

import pytest
import torch

from tests.profiling.helpers import ROOT, read_json, run_script

pytestmark = pytest.mark.slow

TRIAL_FIELDS = {"status", "measured", "strategy", "seq_len", "step_s", "fwd_bwd_s", "optimizer_s", "counted_step_s",
                "tokens_per_s", "mfu",
                "device_peak_bytes", "fwd_bwd_peak_bytes", "optimizer_peak_bytes", "optimizer_state_bytes",
                "first_step_device_peak_bytes", "device_reserved_peak_bytes", "host_peak_bytes", "host_rss_peak_bytes"}


def _refused(name: str, *argv) -> str:
    """``python -m profiling.<name> argv``, which must stop with an error: its stderr."""
    proc = subprocess.run([sys.executable, "-m", f"profiling.{name}", *map(str, argv)], capture_output=True, text=True,
                          cwd=ROOT, timeout=300, env={**os.environ, "PYTHONPATH": ROOT})
    assert proc.returncode != 0, proc.stdout[-2000:]
    return proc.stderr


def _max_seqlen(out_dir, *argv) -> dict:
    run_script("max_seqlen", "--tiny", "--out-dir", out_dir, *argv)
    return read_json(os.path.join(out_dir, "max_seqlen.json"))


@pytest.fixture(scope="module")
def lengths_run(tmp_path_factory):
    """Every strategy at 64 and 128 tokens, in one results directory (shared by the plot test)."""
    out_dir = tmp_path_factory.mktemp("results")
    return out_dir, _max_seqlen(out_dir, "--in-process", "--lengths", "64", "128")


@pytest.mark.long
def test_max_seqlen_every_strategy(lengths_run):
    _, saved = lengths_run
    out = saved
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


@pytest.mark.long
def test_named_attention_backend(tmp_path):
    """--attention-backend and --no-timed-step reach the fpdt trials, here in a fresh process each
    (the scripts' default), and the planner's GQA expansion follows that kernel; a kernel that
    cannot run here stops before any trial."""
    out = _max_seqlen(tmp_path, "--strategies", "fpdt", "--lengths", "64", "--chunk-size", "64",
                      "--attention-backend", "math", "--no-timed-step")
    t = out["strategies"]["fpdt"]["trials"][0]
    assert t["status"] == "ok" and TRIAL_FIELDS <= set(t)
    assert not t["timed_step"] and t["step_s"] == t["counted_step_s"]
    assert t["attention_kernel"] == "math" and t["planned_setup"]["kernel_expands_gqa"]
    run_script("plot", tmp_path, "--readme", "")
    table = (tmp_path / "results.md").read_text()     # a named kernel's trials are rows of their own
    assert "| fpdt [math] | 64 |" in table and "- attention kernel: fpdt [math] `math`" in table
    assert "--attention-backend cuda_flash: attention backend 'cuda_flash' is not available here" in _refused(
        "max_seqlen", "--tiny", "--in-process", "--strategies", "fpdt", "--lengths", "64", "--attention-backend",
        "cuda_flash", "--out-dir", tmp_path)


@pytest.mark.long
def test_bisection_and_simulated_capacity(tmp_path):
    out = _max_seqlen(tmp_path, "--in-process", "--strategies", "hf", "--max-len", "256")
    entry = out["strategies"]["hf"]
    assert entry["max_seq_len"] == 256 and [t["seq_len"] for t in entry["trials"]] == [64, 128, 256]
    small = entry["trials"][0]["device_peak_bytes"] / 2 ** 30
    capped = _max_seqlen(tmp_path, "--in-process", "--strategies", "hf", "--max-len", "256", "--device-mem-gib",
                         small * 0.999)
    first = capped["strategies"]["hf"]["trials"][0]
    assert first["status"] == "oom" and "--device-mem-gib" in first["error"]
    assert capped["strategies"]["hf"]["max_seq_len"] == 0
    # bisection stops a trial at the allocation that passes the capacity, as a GPU would
    half = _max_seqlen(tmp_path, "--in-process", "--strategies", "hf", "--max-len", "256", "--device-mem-gib",
                       small * 0.6)
    first = half["strategies"]["hf"]["trials"][0]
    assert first["status"] == "oom" and "during the step" in first["error"] and not first.get("measured")
    # fixed lengths run to the end and are measured (the slopes use them), marked out of memory
    fixed = _max_seqlen(tmp_path, "--in-process", "--strategies", "hf", "--lengths", "64", "--device-mem-gib",
                        small * 0.6)
    t = fixed["strategies"]["hf"]["trials"][0]
    assert t["status"] == "oom" and t["measured"] and t["device_peak_bytes"] == entry["trials"][0]["device_peak_bytes"]


def test_refusals_before_any_trial(tmp_path):
    """A --step that is not whole fpdt chunks, and a --calibration file that does not exist."""
    assert "--step 96 must be a multiple of --chunk-size 64" in _refused(
        "max_seqlen", "--tiny", "--in-process", "--strategies", "fpdt", "--chunk-size", "64", "--step", "96",
        "--out-dir", tmp_path)
    line = _refused("max_seqlen", "--tiny", "--in-process", "--strategies", "fpdt", "--lengths", "64", "--out-dir",
                    tmp_path, "--calibration", tmp_path / "missing.json")
    assert "no such file (run profiling/op_latency.py first" in line
    assert not (tmp_path / "max_seqlen.json").exists()


@pytest.mark.long
def test_chunk_sweep_op_latency_and_plots(lengths_run):
    tmp_path = lengths_run[0]
    run_script("chunk_sweep", "--tiny", "--in-process", "--chunks", "64", "128", "--out-dir", tmp_path)
    sweep = read_json(tmp_path / "chunk_sweep.json")
    assert [r["chunk_size"] for r in sweep["rows"]] == [64, 128]
    for r in sweep["rows"]:
        assert r["status"] == "ok" and r["activation_bytes"] > 0
        assert r["model_states_bytes"] == 2 * r["param_bytes"] + r["optimizer_state_bytes"]
        assert r["first_step_device_peak_bytes"] == r["counted_device_peak_bytes"] > r["param_bytes"]   # CPU: counted
        assert r["device_reserved_peak_bytes"] is None and r["host_peak_bytes"] > 0           # fpdt offloads
        assert r.get("exposed_copy_s") is None          # CUDA only
    run_script("op_latency", "--tiny", "--out-dir", tmp_path, "--backends", "all", "cuda_flash")
    lat = read_json(tmp_path / "op_latency.json")
    assert [r["chunk"] for r in lat["chunks"]] == [64, 128]
    assert all(r["full_fwd_s"] > 0 and r["full_bwd_s"] > 0 and r["all_to_all_s"] is None for r in lat["chunks"])
    for r in lat["chunks"]:      # --backends: every kernel that runs here, torch's SDPA, and a named one that cannot
        assert list(r["kernels"]) == ["cpu", "sdpa", "cuda_flash"] and r["backend"] == "cpu"
        assert r["kernels"]["cpu"]["backend"] == "cpu" and r["kernels"]["sdpa"]["backend"].startswith("sdpa:")
        for name in ("cpu", "sdpa"):
            assert all(r["kernels"][name][f"{b}_{d}_s"] > 0 for b in ("diag", "full") for d in ("fwd", "bwd"))
        assert "is not available here" in r["kernels"]["cuda_flash"]["error"]
    assert "unknown kernel" in _refused("op_latency", "--tiny", "--out-dir", tmp_path / "x", "--backends", "flash4")
    from fpdt.plan import load_calibration
    cal = load_calibration(tmp_path / "calibration.json")
    assert cal["gemm_flops"] > 0 and cal["attention_flops"] > 0 and cal["h2d_bytes_s"] > 0
    assert cal["memory_bytes_s"] > 0
    # the automatic kernel's attention rate, and every kernel timed with --backends
    assert cal["attention_backend"] == "cpu" and set(cal["attention_flops_by_kernel"]) == {"cpu", "sdpa"}
    assert cal["attention_flops"] == cal["attention_flops_by_kernel"]["cpu"]
    # the planner's step time from this machine's rates
    run = _max_seqlen(tmp_path / "calibrated", "--in-process", "--strategies", "fpdt", "--lengths", "64",
                      "--calibration", tmp_path / "calibration.json")
    t = run["strategies"]["fpdt"]["trials"][0]
    assert t["planned_rates"] == "calibration" and t["planned_step_s"] > 0
    assert t["planned_step_s"] == pytest.approx(sum(t["planned_step_split_s"].values()))
    readme = tmp_path / "README.md"
    readme.write_text("# Benchmarks\n\nkept\n\n<!-- plot.py begin -->\nold\n<!-- plot.py end -->\ntail\n")
    written = [line.removeprefix("wrote ") for line in run_script("plot", tmp_path, "--readme", readme)
               .stdout.splitlines() if line.startswith("wrote ")]
    names = {os.path.basename(p) for p in written}
    assert {"chunk_sweep.png", "op_latency.png", "memory_vs_length.png", "results.md"} <= names
    for p in written:
        assert os.path.getsize(p) > 0
    text = readme.read_text()
    assert "kept" in text and "tail" in text and "old" not in text
    assert "fpdt / hf step time" in text and "| fpdt | 128 |" in text
    assert "fpdt / hf fwd+bwd device slope" in text and "planned allocated MiB (/ measured)" in text
    assert "- attention kernel: fpdt `cpu`; fpdt-no-offload `cpu`; hf `sdpa:" in text


def test_a_piece_stopped_by_its_budget_keeps_what_it_measured(tmp_path):
    """op_latency.py rewrites its files after each chunk size: stopped (SIGTERM, as run_suite.sh's
    time budget stops a piece) while it times a long chunk, it leaves the short chunk's row and a
    calibration from it (on the H100 a piece stopped part-way had left nothing, and the next
    piece's --calibration pointed at a missing file)."""
    import signal
    import time

    from fpdt.plan import load_calibration
    proc = subprocess.Popen([sys.executable, "-m", "profiling.op_latency", "--chunks", "64", "8192", "--heads", "4",
                             "--kv-heads", "2", "--head-dim", "16", "--dtype", "fp32", "--warmup", "0", "--iters", "2",
                             "--bandwidth-sizes-mib", "0.25", "--gemm-size", "256", "--memory-mib", "1",
                             "--out-dir", str(tmp_path)],
                            cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT}, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)

    def chunks():
        try:
            return [r["chunk"] for r in read_json(tmp_path / "op_latency.json")["chunks"]]
        except (OSError, ValueError, KeyError):       # not written yet, or being written
            return []
    try:
        deadline = time.monotonic() + 300
        while chunks() != [64]:                       # the 8192-token chunk takes seconds more on the CPU
            assert proc.poll() is None, f"op_latency.py ended before it could be stopped: {proc.stderr.read()[-2000:]}"
            assert time.monotonic() < deadline, "no chunk was written in 300 s"
            time.sleep(0.1)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=60)
    assert chunks() == [64]
    assert load_calibration(tmp_path / "calibration.json")["attention_flops"] > 0


@pytest.mark.long
def test_lm_head_wgrad_script_fields(tmp_path):
    """Both modes measured on the same inputs; the fp32 run's peaks are equal-sized
    (recompute's [V, hidden] gradient is fp32 too), the bf16 run's recompute peak is lower."""
    run_script("lm_head_wgrad", "--shape", "32", "1000", "64", "--dtype", "bf16", "--repeats", "1", "--out-dir", tmp_path)
    data = json.loads((tmp_path / "lm_head_wgrad.json").read_text())
    (row,) = data["rows"]
    assert set(row["modes"]) == {"accumulate", "recompute"} and data["dtype"] == "bfloat16"
    assert all(m["time_s"] > 0 and m["device_peak_bytes"] > 0 for m in row["modes"].values())
    assert row["peak_saved_bytes"] > 0 and row["peak_ratio"] < 1
    assert row["accumulator_bytes"] == 1000 * 32 * 4 and row["gemm_ratio_model"] == pytest.approx(4 / 3)
    assert row["planner_rates"] == "h100-80g datasheet" and set(row["planner_time_s"]) == {"accumulate", "recompute"}
    assert row["planner_time_ratio"] == pytest.approx(row["planner_time_s"]["recompute"]
                                                      / row["planner_time_s"]["accumulate"])


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
