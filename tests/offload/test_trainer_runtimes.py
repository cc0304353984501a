"""fpdt-train with attention offload and offloaded activation checkpoints, on 2 gloo ranks
(sp=2, ZeRO-3), under ``FPDT_RUNTIME=sync``, ``sim`` (lazy) and ``sim`` (threaded) --
selected through the environment (``--runtime``'s default), as a user would. Each step's loss must match the
single-process fp32 reference within the trainer parity tolerance (1e-4 relative), and
the run does exactly the loop's two host syncs per step, whatever the chunk count."""

from __future__ import annotations

import os

import pytest

from tests.distributed import run_distributed
from tests.train.helpers import (SGD, SGD_CLIP, check_memory_fields, ds_config, logged_losses, quiet, reference_losses,
                                write_fixture, write_json)
from tests.train.test_parity import RTOL, SEQ_LEN, STEPS, _train

ENVS = {"sync": {"FPDT_RUNTIME": "sync"},
        "sim-lazy": {"FPDT_RUNTIME": "sim", "FPDT_SIM_MODE": "lazy"},
        "sim-threaded": {"FPDT_RUNTIME": "sim", "FPDT_SIM_MODE": "threaded", "FPDT_SIM_SEED": "2"}}


def _body(rank, world_size, tmp, env, chunks):
    quiet()
    os.environ.update(env)  # this rank only: forked from the fork server, not from pytest
    from fpdt.offload import named_runtime
    counters = named_runtime(env["FPDT_RUNTIME"]).counters   # the instance fpdt-train's --runtime default names
    for chunk in chunks:
        counters.reset()
        _train(rank, tmp, f"sgd_{chunk}", sp=2, chunk=chunk, extra=["--offload", "--checkpoint", "offload"])
        assert counters.bytes_d2h > 0 and counters.bytes_h2d > 0, "nothing was offloaded"
        assert counters.host_syncs == 2 * STEPS, (chunk, counters.host_syncs)  # the loop's timing syncs only


@pytest.mark.slow
@pytest.mark.parametrize("runtime", list(ENVS))
def test_trainer_with_offload_matches_the_reference(runtime, tmp_path):
    tmp = str(tmp_path)
    cfg_path, data_path = write_fixture(tmp)
    chunks = (32, 16) if runtime == "sim-lazy" else (32,)   # u = 2 and u = 4 per rank
    for chunk in chunks:
        write_json(os.path.join(tmp, f"sgd_{chunk}.json"), ds_config(SGD, SGD_CLIP))
    run_distributed(_body, world_size=2, args=(tmp, ENVS[runtime], chunks), timeout=240)
    ref = reference_losses(cfg_path, data_path, SEQ_LEN, STEPS, 1, SGD, SGD_CLIP)
    for chunk in chunks:
        got = logged_losses(os.path.join(tmp, f"sgd_{chunk}.jsonl"))
        rel = [abs(g - r) / abs(r) for g, r in zip(got, ref)]
        assert len(got) == STEPS and max(rel) < RTOL, f"{runtime} chunk={chunk}: {got} vs {ref} ({rel})"
        check_memory_fields(os.path.join(tmp, f"sgd_{chunk}.jsonl"), offload=True)
