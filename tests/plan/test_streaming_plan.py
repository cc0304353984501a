"""``stream_layers`` in the planner and in ``fpdt-train``'s memory check: chosen only when the
device does not hold the run otherwise and does with it."""

import pytest

from fpdt.plan import Choice, Cluster, GPU_PRESETS, plan
from fpdt.plan.memory_model import MemoryEstimate
from fpdt.plan.trainer_run import stream_layers

GIB = 1024 ** 3


def _est(device_gib: float) -> MemoryEstimate:
    return MemoryEstimate({}, {}, device_gib * GIB, device_gib * GIB, 0.0)


@pytest.mark.parametrize("requested, unstreamed, streamed, capacity, chosen", [
    (None, 100, 50, 80, True),      # does not fit, fits streamed
    (None, 70, 50, 80, False),      # fits as it is
    (None, 100, 90, 80, False),     # streaming does not make it fit
    (None, 100, None, 80, False),   # no streamed run (not valid)
    (False, 100, 50, 80, False),    # refused
    (True, 70, 50, 80, True),       # asked for
    (None, 100, 50, None, False),   # no device capacity known (the CPU)
])
def test_trainer_streams_only_when_it_makes_the_run_fit(requested, unstreamed, streamed, capacity, chosen):
    got, why = stream_layers(requested, _est(unstreamed), lambda: None if streamed is None else _est(streamed),
                             None if capacity is None else capacity * GIB)
    assert got is chosen
    assert (why is not None) == (chosen and requested is None)
    if why:
        assert f"{unstreamed:.1f} GiB without it, {streamed:.1f} GiB with it, of {capacity:.1f} GiB" in why


def test_planner_streams_a_single_gpu_run_only_past_what_fits_unstreamed():
    """Llama-3-8B on one H100 with parameters and optimizer on the host (ALST's set-up): 1M tokens
    fit unstreamed, 2.5M only streamed (unstreamed stops at 2.06M), with the device far from full."""
    cluster = Cluster(GPU_PRESETS["h100-80g"], gpus_per_node=1, host_mem_bytes=1900 * GIB)
    choice = Choice(offload_optimizer=True, offload_param=True)
    short = plan("llama-3-8b", cluster, seq_len=2 ** 20, choice=choice)
    long = plan("llama-3-8b", cluster, seq_len=5 * 2 ** 19, choice=choice)
    unstreamed = plan("llama-3-8b", cluster, seq_len=5 * 2 ** 19, choice=choice.fix(stream_layers=False))
    assert short["fits"] and not short["setup"]["stream_layers"]
    assert not unstreamed["fits"] and unstreamed["limited_by"] == "device"
    assert long["fits"] and long["setup"]["stream_layers"] and long["recommended"]["stream_layers"]
    assert long["device_peak_bytes"] < 0.5 * long["device_capacity_bytes"]
