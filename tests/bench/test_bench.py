"""fpdt.bench: what the measurement scripts and the tests share, on hand-made inputs."""

import json

import pytest

from fpdt.bench import fit, planner, trace
from fpdt.bench.search import longest_fitting


def test_slope_is_least_squares():
    trials = [{"status": "ok", "measured": True, "seq_len": s, "device_peak_bytes": 1000 + 3 * s}
              for s in (1024, 2048, 4096)]
    trials.append({"status": "oom", "seq_len": 8192})
    assert fit.slope_per_1k(trials) == pytest.approx(3 * 1024)
    assert fit.slope_per_1k(trials[:1]) is None


@pytest.mark.parametrize("limit,lo,hi,want,tried", [
    (13, 8, 16, 13, [8, 16, 12, 14, 13]),                 # doubling, then bisection
    (20, 8, 12, 12, [8, 12]),                              # doubling stops at --max-len, which is tried
    (10, 8, 12, 10, [8, 12, 10, 11]),                      # ... and bisected below it when it fails
    (5, 8, 16, 5, [8, 4, 6, 5]),                           # below --min-len
])
def test_bisection_order(limit, lo, hi, want, tried):
    seen = []

    def fits(n):
        seen.append(n)
        return n <= limit
    assert longest_fitting(fits, 1, lo, hi, 1) == want and seen == tried


def test_planner_rates_follow_the_trials_kernel(tmp_path):
    """A trial on a named kernel is planned with that kernel's calibrated attention rate; when
    the file lacks it, the rates label says whose rate stands in (and plot.py shows no ratio)."""
    path = tmp_path / "calibration.json"
    path.write_text(json.dumps({"gemm_flops": 1e14, "attention_flops": 2e14, "attention_backend": "cuda_cudnn",
                                "attention_flops_by_kernel": {"cuda_cudnn": 2e14, "cuda_flash": 1e14}}))
    rate = lambda kernel: planner.planner_cluster(str(path), kernel)[0].rates().attention_flops   # noqa: E731
    assert rate(None) == rate("cuda_cudnn") == 2e14 and rate("cuda_flash") == 1e14
    assert planner.planner_cluster(str(path), "cuda_flash")[1] == "calibration"
    assert planner.planner_cluster(str(path), "math")[1] == "calibration, attention rate of cuda_cudnn"
    assert planner.planner_cluster(None, "math")[1] == "h100-80g datasheet"


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
    out = trace.exposed_copy_seconds(SimpleNamespace(events=lambda: events))
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
    out = trace.step_kernels(SimpleNamespace(events=lambda: events), top=3)
    assert out["gpu_busy_s"] == pytest.approx((30 + 30 + 5 + 5 + 1) * 1e-6)
    assert out["traced_s"] == pytest.approx(101e-6)
    assert out["kernel_class_s"] == pytest.approx({"attention": 45e-6, "copy_h2d_d2h": 15e-6, "gemm": 10e-6,
                                                   "other": 10e-6, "copy_device": 1e-6})
    assert [(k["name"], k["calls"]) for k in out["kernels_by_time"]] == [
        ("cudnn_generated_fort_native_sdpa_sm90_flash_bprop", 1), ("flash_fwd_kernel", 1),
        ("Memcpy DtoH (Device -> Pinned)", 1)]
    assert out["kernels_by_time"][0]["s"] == pytest.approx(30e-6)


def test_extrapolation_uses_the_growing_peak():
    """The optimizer step's constant peak does not hide the activations' growth: the line is
    fitted to the forward+backward peak with the optimizer state beside it."""
    mib = 2 ** 20
    trials = [{"status": "ok", "measured": True, "seq_len": s, "device_peak_bytes": 100 * mib,
               "fwd_bwd_peak_bytes": 10 * mib + 1024 * s, "optimizer_state_bytes": 20 * mib,
               "optimizer_peak_bytes": 100 * mib} for s in (1024, 2048, 4096)]
    # 30 MiB + 1 KiB per token reaches 1 GiB at (1024 - 30) * 1024 tokens
    assert fit.extrapolate(trials, 1024 * mib) == (1024 - 30) * 1024
    assert fit.extrapolate(trials, 50 * mib) is None          # the optimizer step alone passes it
    old = [{"status": "ok", "measured": True, "seq_len": s, "device_peak_bytes": 2 * s} for s in (1, 2)]
    assert fit.extrapolate(old, 10) == 5                     # files without the phase split
