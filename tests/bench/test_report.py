"""fpdt.bench's results table (report), the planner's prediction beside a trial (planner) and the
capacity check (search), on hand-made trials."""

import pytest

from fpdt.bench import report
from fpdt.bench.fit import extrapolate
from fpdt.bench.planner import planned
from fpdt.bench.search import over_capacity
from tests.train.helpers import TINY_CONFIG


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
    strats = report.strategies([lengths, bisect])
    assert strats["alst"]["caps"] == {2: {"best": 2048, "open_ended": True}, 1: {"best": 1536, "open_ended": False}}
    md = report.markdown(strats, [lengths, bisect], "x")
    assert "longest that fits 1 GiB (measured) | longest that fits 2 GiB (measured)" in md
    assert "| alst | 1536 | >= 2048 (longest tried) | 1024.0 |" in md          # slope: 1 KiB per token
    assert "1536 (bisection at 1 GiB)" in md
    assert extrapolate(report.fit_trials(strats["alst"]["trials"]), 2 * 1024 * mib) == 2 * 1024 * 1024 - 100 * 1024


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
    md = report.markdown(report.strategies([run]), [run], "x")
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
    md = report.markdown(report.strategies([run]), [run], "x")
    assert "| fpdt | 1024 | 200.0 | 100.0 | 0.0 | 200.0 | 10.00 | 102 | 0.250 | 190.0 (0.950) | 9.00 (0.90) |" in md
    assert "allocated peaks" in md and report.markers([run]) == ("<!-- plot.py begin some-gpu -->",
                                                               "<!-- plot.py end some-gpu -->")


def test_results_table_names_the_cuda_stack():
    """A GPU results table says which torch, CUDA and cuDNN it ran on (torch's SDPA choice, and
    so the peers' attention kernel, depends on the runtime cuDNN); a CPU one has none to say."""
    gpu = {"device": "nvidia-h100", "device_type": "cuda", "commit": "abc", "date_utc": "2026-11-24",
           "software": {"torch": "2.11.0+cu130", "cuda": "13.0", "cudnn": 91501}}
    assert "abc, 2026-11-24, torch 2.11.0+cu130, CUDA 13.0, cuDNN 91501)" in report.markdown({}, [gpu], "r")
    cpu = {**gpu, "device_type": "cpu", "software": {"torch": "2.13.0+cpu", "cuda": None, "cudnn": None}}
    assert "abc, 2026-11-24)" in report.markdown({}, [cpu], "r")


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
    md = report.markdown(strats, [{"device": "nvidia-h200", "device_type": "cuda"}], "r")
    assert "fpdt-save / fpdt (saved attention outputs / recompute) step time: 131072: 0.75" in md
    assert "| fpdt | 131072 | 10.00 | 9.50 | 6.00 | 3.00 | 1.50 | 0.00 | 0.00 | 0.00 | 0.25 |" in md
    assert "| `flash_bwd` | 4.000 | 32 |" in md
    lat = {"diag_fwd_s": 0.001, "diag_bwd_s": 0.002, "full_fwd_s": 0.003, "full_bwd_s": 0.004}
    op = {"args": {"heads": 32, "kv_heads": 8, "head_dim": 64},
          "chunks": [{"chunk": 65536, "backend": "cuda_cudnn", **lat,
                      "kernels": {"sdpa": {"backend": "sdpa:cudnn", **lat}, "triton": {"error": "ImportError: no"}}}]}
    table = "\n".join(report.kernel_table(op))
    assert "one 65536-token chunk (32 query / 8 KV heads of 64)" in table
    assert "| automatic | `cuda_cudnn` | 1.0 | 2.0 | 3.0 | 4.0 |" in table
    assert "| sdpa | `sdpa:cudnn` | 1.0 | 2.0 | 3.0 | 4.0 |" in table and "| triton | failed: ImportError: no |" in table


def test_planned_peaks_swap_in_the_trials_own_states():
    """planned(): the allocated figure is the fits figure less the planner's reserve and
    fragmentation, and both hold the trial's own model states in place of the planner's."""
    from fpdt.plan import GPU_PRESETS, Cluster, evaluate, load_model_config
    from fpdt.plan.setup import Setup
    cfg = dict(TINY_CONFIG)
    kw = dict(kernel_expands_gqa=False, lm_head_wgrad="recompute")
    own = planned(cfg, "fpdt", 4096, 1024, "bf16", **kw)
    r = evaluate(load_model_config(cfg), Setup.build(seq_len=4096, chunk_size=1024, checkpointing="offload", offload=True,
                                               zero_stage=0, dtype="bf16", **kw),
                 Cluster(GPU_PRESETS["h100-80g"], gpus_per_node=1))
    assert own["planned_device_peak_bytes"] == r["device_peak_bytes"]
    assert own["planned_device_peak_bytes"] - own["planned_allocated_peak_bytes"] == r["breakdown"]["runtime_reserve"]
    assert own["planned_setup"] == {"lm_head_wgrad": "recompute", "kernel_expands_gqa": False}
    b = r["breakdown"]
    states = b["parameters"] + b["gradients"] + b["optimizer_state"]
    mine = planned(cfg, "fpdt", 4096, 1024, "bf16", states_bytes=states / 2, **kw)
    for key in ("planned_device_peak_bytes", "planned_allocated_peak_bytes"):
        assert mine[key] == pytest.approx(own[key] - states / 2)


def test_a_first_step_whose_steady_state_passes_the_device_is_out_of_memory():
    gib = 2 ** 30
    assert over_capacity(10 * gib, 12 * gib, None) is None
    assert over_capacity(10 * gib, None, None) is None                       # CPU without a capacity
    assert "--device-mem-gib 2" in over_capacity(3 * gib, 2 * gib, 2)         # the simulated capacity
    cuda = over_capacity(81.2 * gib, 79.2 * gib, None)                        # hf at 49,152 on the H100
    assert "steady-state step peak 81.200 GiB" in cuda and "79.20 GiB free" in cuda
    assert "free to tensors" in over_capacity(3 * gib, 1.5 * gib, 2)          # less free than simulated
