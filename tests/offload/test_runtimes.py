"""The offload parity suite under every CPU runtime: ``sync``, ``sim`` lazy and ``sim`` threaded.

Re-runs the offloading cases of the attention (sp 1/2/4), layer (sp 1/2/4), model
(``checkpointing="offload"``, sp 1/2) and trainer parity tests with unchanged tolerances,
each inside ``use_runtime(...)`` on every rank (or ``FPDT_RUNTIME`` for the trainer, as a
user would run it). Under ``sim`` the copies run late (or on worker threads after random
delays) into NaN-filled destinations, so a missing wait shows as wrong numbers or a
StreamHazardError. The fault tests show that each injected fault is caught.
"""

import os

import pytest
import torch

from fpdt.offload import StreamHazardError, use_runtime
from tests.attention import test_fpdt_attention as attention_tests
from tests.attention import test_module as layer_tests
from tests.distributed import run_distributed
from tests.model.test_parity import run_case

RUNTIMES = {"sync": ("sync", {}), "sim-lazy": ("sim", {"mode": "lazy"}),
            "sim-threaded": ("sim", {"mode": "threaded", "seed": 1})}


def _attention_and_layer(rank, world, runtime):
    name, opts = RUNTIMES[runtime]
    with use_runtime(name, **opts):
        for case in attention_tests._cases(world):
            if case["offload"]:
                attention_tests.check_case(rank, world, **case)
        for n, case in enumerate(layer_tests._cases(world)):
            if case["offload"]:
                layer_tests.check_layer(rank, world, seed=n, **case)


@pytest.mark.parametrize("runtime", list(RUNTIMES))
@pytest.mark.parametrize("world", [1, 2, 4])
def test_attention_offload_parity(world, runtime):
    if world == 1:
        _attention_and_layer(0, 1, runtime)
    else:
        run_distributed(_attention_and_layer, world, args=(runtime,), timeout=240)


def _model(rank, world, runtime):
    name, opts = RUNTIMES[runtime]
    with use_runtime(name, **opts):
        run_case("llama_gqa", rank, world, num_chunks=2, mlp_chunks=3, loss_chunks=5, offload=True,
                 checkpointing="offload")


@pytest.mark.parametrize("runtime", list(RUNTIMES))
@pytest.mark.parametrize("world", [1, 2])
def test_model_checkpoint_offload_parity(world, runtime):
    if world == 1:
        _model(0, 1, runtime)
    else:
        run_distributed(_model, world, args=(runtime,), timeout=240)


# --- each fault is caught by the parity tests ------------------------------------------

def _faulty(rank, world, fault, checks, what):
    with use_runtime("sim", fault=fault, checks=checks):
        if what == "attention":
            attention_tests.check_case(rank, world, B=2, H=6, H_kv=2, D=8, u=4, offload=True)
        elif what == "layer":
            layer_tests.check_layer(rank, world, B=2, hidden=24, H=6, H_kv=2, D=8, u=4, offload=True, bias=True)
        else:
            run_case("llama_gqa", rank, world, num_chunks=2, mlp_chunks=3, loss_chunks=5, offload=True,
                     checkpointing="offload")


@pytest.mark.parametrize("what", ["attention", "layer", "model"])
@pytest.mark.parametrize("fault", ["drop_wait", "drop_record_stream"])
def test_injected_fault_is_caught(fault, what):
    """With the hazard checks the fault raises a StreamHazardError naming the data."""
    with pytest.raises(StreamHazardError, match=r"chunk \d|layer input"):
        _faulty(0, 1, fault, True, what)


@pytest.mark.parametrize("what", ["attention", "model"])
def test_dropped_waits_give_wrong_numbers_without_the_checks(what):
    """The hostile data alone catches dropped waits: NaN reaches the parity comparison."""
    with pytest.raises(AssertionError, match="non-finite|rel"):
        _faulty(0, 1, "drop_wait", False, what)


def _faulty_ranks(rank, world, fault):
    with pytest.raises(StreamHazardError):
        _faulty(rank, world, fault, True, "attention")


@pytest.mark.parametrize("fault", ["drop_wait", "drop_record_stream"])
def test_injected_fault_is_caught_on_two_ranks(fault):
    run_distributed(_faulty_ranks, 2, args=(fault,), timeout=120)
