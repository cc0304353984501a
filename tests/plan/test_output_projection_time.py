"""fpdt-plan's step time with o_proj reading its input back from the attention stash
(checkpointing="off" with offload, fpdt.attention.output_projection): one more fetch of the
attention output per layer, and one more all-to-all of it with hp > 1."""

import pytest

from fpdt.plan import GPU_PRESETS, Cluster, load_model_config
from fpdt.plan import time_model
from fpdt.plan.setup import Setup
from fpdt.plan.time_model import estimate_time, o_proj_refetch

CFG = load_model_config("llama-3-8b")
NODE = Cluster(GPU_PRESETS["h100-80g"], gpus_per_node=8, host_mem_bytes=1024 * 2 ** 30)


def _setup(**kw) -> Setup:
    return Setup.build(**{"seq_len": 2 ** 18, "chunk_size": 32768, "hp": 8, "checkpointing": "off",
                          "offload": True, **kw})


def test_refetch_counts_the_output_once_more_with_the_first_chunk_exposed():
    rates = NODE.rates()
    s = _setup()
    u, qd, local = s.num_chunks, CFG.num_heads * CFG.head_dim, 2 ** 18 // 8
    fetch = local * qd * 2 / rates.h2d_bytes_s
    wgrad = 2 * local * qd * CFG.hidden_size / rates.gemm_flops
    seconds, a2a = o_proj_refetch(CFG, s, rates)
    assert u == 8 and seconds == pytest.approx(fetch / u + max(0.0, fetch - wgrad) * (u - 1) / u)
    assert a2a == local * qd * 2 * 7 // 8
    for other in (_setup(offload=False), _setup(checkpointing="on"), _setup(checkpointing="offload")):
        assert o_proj_refetch(CFG, other, rates) == (0.0, 0.0)
    assert o_proj_refetch(CFG, _setup(hp=1), rates)[1] == 0.0      # no all-to-all on one rank


def test_step_time_adds_the_refetch(monkeypatch):
    """Taking the term out (as if o_proj kept its input) changes the copies by l times its
    seconds, and the all-to-all time by what its bytes add."""
    s = _setup()
    with_refetch = estimate_time(CFG, s, NODE)
    seconds, _ = o_proj_refetch(CFG, s, NODE.rates())
    monkeypatch.setattr(time_model, "o_proj_refetch", lambda *a: (0.0, 0.0))
    without = estimate_time(CFG, s, NODE)
    assert with_refetch["h2d_d2h"] - without["h2d_d2h"] == pytest.approx(CFG.num_layers * seconds)
    assert with_refetch["all_to_all"] > without["all_to_all"]
    assert seconds > 0
