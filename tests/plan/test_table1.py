"""Validation (b): the planner on the FPDT paper's hardware against FPDT Table 1.

Hardware (FPDT, arXiv 2408.16978, Table 1): A100 40G / 80G, 4 GPUs per node, 1 TB host per node, PCIe 32 GB/s,
ZeRO-3, checkpoint offload of every layer input (as FPDT ran: no ``checkpoint_device_layers``),
attention offload, global chunks of 64K, bf16, one sequence over every GPU. A cell passes when the
planner's longest length is within a factor of
two of the paper's; ``8M+`` cells need >= 4M; ``-`` cells need "does not fit" or < 64K.

Cells the planner does not reproduce are listed in ``DEVIATIONS`` with the reason; they
are strict xfails, so a model change that makes them pass (or breaks another) fails here.
"""

import pytest

from fpdt.plan import GPU_PRESETS, Choice, Cluster, load_model_config, max_seq_len

K, M = 1024, 1024 * 1024
COLUMNS = [("a100-40g", 1), ("a100-40g", 2), ("a100-40g", 4), ("a100-40g", 8),
           ("a100-80g", 4), ("a100-80g", 8), ("a100-80g", 16), ("a100-80g", 32)]
PLUS = "8M+"
TABLE = {   # FPDT Table 1; None = "-" (does not run)
    "gpt-2.7b": [128 * K, 512 * K, 2 * M, 4 * M, 4 * M, PLUS, PLUS, PLUS],
    "llama-3-8b": [None, None, None, 1 * M, 2 * M, 4 * M, PLUS, PLUS],
    "gpt-13b": [None, None, None, 256 * K, 512 * K, 3 * M, 4 * M, PLUS],
    "gpt-30b": [None] * 5 + [1 * M, 3 * M, 4 * M],
    "llama-3-70b": [None] * 6 + [1 * M, 4 * M],
}

_STATES = ("ZeRO-3 model states alone (16 B/param: bf16 weights and grads, fp32 master and moments) "
           "leave no room")
_LIGHT = ("this implementation's layer in flight is lighter than the paper's (lean RMSNorm, final dq delivered "
          "at once, chunked MLP within half a chunk, residual gradients accumulated in place, o_proj inside the "
          "attention pipeline, the input norm inside the attention: 3 Nd full-length "
          "beside the attention's chunk buffers, "
          "tests/memory/test_model_budget.py), "
          "so the planner fits more than the paper ran")
DEVIATIONS = {
    ("gpt-2.7b", "a100-40g", 1): _STATES + ": 2.67B x 16 B = 39.8 GiB of the card's 40 GiB before the CUDA "
                                  "context, workspaces and any activation; the paper's run cannot have held the "
                                  "full optimizer state on the GPU",
    ("llama-3-8b", "a100-40g", 4): ("the paper's caption reads '-' as 'the model itself cannot fit', but at 16 B/param "
                                    "8.03B / 4 GPUs is 32.1 GB of states on a 40 GiB card; what is left holds 384K "
                                    "here"),
    ("gpt-2.7b", "a100-40g", 2): _LIGHT + ": 1408K against the paper's 512K",
    ("gpt-2.7b", "a100-40g", 4): _LIGHT + ": 4736K against the paper's 2M",
    ("gpt-2.7b", "a100-40g", 8): _LIGHT + ": ~9.4M (9600K) against the paper's 4M",
    ("llama-3-8b", "a100-40g", 8): _LIGHT + ": 4.1M (4224K) against the paper's 1M",
    ("gpt-13b", "a100-40g", 8): _LIGHT + ": 1.75M against the paper's 256K",
    ("gpt-13b", "a100-80g", 4): _LIGHT + ": 1.94M against the paper's 512K",
    ("gpt-30b", "a100-80g", 8): _LIGHT + ": 2.1M (2176K) against the paper's 1M",
    ("gpt-30b", "a100-80g", 32): _LIGHT + ": 9.5M against the paper's 4M",
}

CELLS = [(m, gpu, n, want) for m, row in TABLE.items() for (gpu, n), want in zip(COLUMNS, row)]


def paper_cluster(gpu: str, n: int) -> Cluster:
    return Cluster(GPU_PRESETS[gpu], gpus_per_node=min(4, n), nodes=max(1, n // 4), host_mem_bytes=1e12)


def predicted(model: str, gpu: str, n: int, device_layers: int | None = 0) -> int:
    """The planner's longest length with the paper's settings: every layer input offloaded
    (``device_layers=0``, as FPDT ran); None lets the planner keep some on the GPU."""
    # the paper's schedule: layers not streamed (fpdt.model.streaming goes further)
    choice = Choice().fix(chunk_size=64 * K, checkpoint_device_layers=device_layers, stream_layers=False)
    return max_seq_len(load_model_config(model), paper_cluster(gpu, n), choice)["max_seq_len"]


def agrees(want, got: int) -> bool:
    if want is None:
        return got < 64 * K
    if want == PLUS:
        return got >= 4 * M
    return want / 2 <= got <= want * 2


@pytest.mark.parametrize("model,gpu,n,want", [
    pytest.param(*c, marks=[pytest.mark.xfail(strict=True, reason=DEVIATIONS[c[:3]])] if c[:3] in DEVIATIONS else [],
                 id=f"{c[0]}-{c[1]}x{c[2]}") for c in CELLS])
def test_table1_cell(model, gpu, n, want):
    got = predicted(model, gpu, n)
    assert agrees(want, got), f"{model} on {n} x {gpu}: planner {got / K:.0f}K, paper {want}"


def test_host_limits_the_longest_runs():
    """8B on 4 x 80G stops at 2M because of the host (1 TB): at 4M the offloaded layer
    inputs alone are 32 layers x 1M tokens x 4096 x 2 B x 4 GPUs = 1 TiB per node."""
    from fpdt.plan import plan
    out = plan("llama-3-8b", paper_cluster("a100-80g", 4), seq_len=4 * M, choice=Choice(chunk_size=64 * K))
    assert not out["fits"]
    assert out["breakdown"]["checkpoints_host"] == 32 * M * 4096 * 2 * 4
    assert out["host_peak_bytes"] > 1e12


def test_70b_on_16_gpus_fits_1m_class_lengths_only_with_the_recomputed_head_gradient():
    """70.6 GB of states leave ~9 GB per 80 GiB GPU: the loss's fp32 [V, hidden] LM-head
    accumulator (4.2 GB) is what decides. The planner picks "recompute" where it must."""
    cfg, cluster = load_model_config("llama-3-70b"), paper_cluster("a100-80g", 16)
    best = max_seq_len(cfg, cluster, Choice(chunk_size=64 * K))
    assert best["max_seq_len"] >= 512 * K and best["setup"]["lm_head_wgrad"] == "recompute"
    assert best["recommended"]["lm_head_wgrad"] == "recompute"
    accumulate = max_seq_len(cfg, cluster, Choice().fix(chunk_size=64 * K, lm_head_wgrad="accumulate"))
    assert accumulate["max_seq_len"] < 512 * K


@pytest.mark.parametrize("model,seq_len", [("llama-3-8b", 1 * M), ("gpt-13b", 256 * K)])
def test_the_faster_lm_head_mode_that_fits_is_chosen(model, seq_len):
    """"recompute" costs one more LM-head GEMM; "accumulate" reads and writes the fp32
    [V, hidden] accumulator once per loss chunk. Where both fit, the planner takes one its
    time model puts within 1% of the faster (ties go to less device memory, then to the
    listed order), and says so in ``recommended``. A case where recompute wins by more:
    tests/plan/test_wgrad_traffic.py."""
    from fpdt.plan import plan
    cluster = paper_cluster("a100-80g", 8)
    out = plan(model, cluster, seq_len=seq_len, choice=Choice(chunk_size=64 * K))
    modes = {w: plan(model, cluster, seq_len=seq_len, choice=Choice().fix(chunk_size=64 * K, lm_head_wgrad=w))
             for w in ("accumulate", "recompute")}
    assert all(r["fits"] for r in modes.values())
    fastest = min(r["step_time_s"] for r in modes.values())
    assert out["step_time_s"] <= 1.01 * fastest
    assert out["setup"]["lm_head_wgrad"] == out["recommended"]["lm_head_wgrad"]
    rec, acc = modes["recompute"]["step_time_split_s"], modes["accumulate"]["step_time_split_s"]
    assert rec["gemms"] > acc["gemms"] and rec["wgrad_accumulation"] < acc["wgrad_accumulation"]
    assert modes["recompute"]["device_peak_bytes"] <= modes["accumulate"]["device_peak_bytes"]


@pytest.mark.parametrize("model,gpu,n", [("llama-3-8b", "a100-80g", 4), ("llama-3-70b", "a100-80g", 32),
                                         ("gpt-13b", "a100-80g", 16)])
def test_keeping_some_layer_inputs_on_the_gpu_goes_further_where_the_host_stops_fpdt(model, gpu, n):
    """Beyond the paper: where 1 TB of host is what stops a cell, keeping the last layers'
    inputs on the GPU (the planner's choice when free) trains longer, never shorter."""
    cluster = paper_cluster(gpu, n)
    paper = max_seq_len(load_model_config(model), cluster, Choice().fix(chunk_size=64 * K, checkpoint_device_layers=0))
    tiered = max_seq_len(load_model_config(model), cluster, Choice(chunk_size=64 * K))
    assert tiered["max_seq_len"] > paper["max_seq_len"] and tiered["setup"]["checkpoint_device_layers"] > 0
    assert tiered["fits"] and tiered["device_peak_bytes"] <= cluster.gpu.mem_bytes
