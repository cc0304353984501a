"""The simulated runtime itself: CUDA ordering semantics, hostile data, hazards, counters, selection."""

import multiprocessing as mp

import pytest
import torch

from fpdt.offload import Role, StreamHazardError, fresh_runtime, named_runtime, resolve_runtime

K = Role("k", "k chunk 3, layer 2")
DEV = torch.device("cpu")


def _d2h(rt, stream, src, host):
    """The stash's put: wait for compute, copy, record_stream, event."""
    rt.wait_event(stream, rt.record_event(rt.current_stream(DEV)))
    rt.copy(host, src, stream, K, "d2h")
    rt.record_stream(src, stream)
    return rt.record_event(stream)


def test_lazy_copy_runs_only_when_waited_and_reads_its_source_then():
    with fresh_runtime("sim", mode="lazy") as rt:
        s = rt.new_stream(DEV, "copy")
        src, host = torch.ones(4), rt.host_empty(4, torch.float32, True)
        done = _d2h(rt, s, src, host)
        assert torch.isnan(host).all()          # issued, not run: the destination is undefined
        src.fill_(2.0)                          # overwritten before the copy ran: the copy sees 2
        assert rt.counters.copies_pending == 1
        rt.wait_event(rt.current_stream(DEV), done)
        assert torch.equal(host, torch.full((4,), 2.0)) and rt.counters.copies_pending == 0
        assert rt.counters.host_syncs == 0 and rt.counters.compute_waits == 1
        assert rt.counters.bytes_d2h == 16 and rt.counters.bytes_h2d == 0


def test_waits_order_copies_across_streams():
    """h2d waits on the d2h event: forcing the h2d copy first runs the d2h copy it depends on."""
    with fresh_runtime("sim", mode="lazy") as rt:
        d2h, h2d = rt.new_stream(DEV, "d2h"), rt.new_stream(DEV, "h2d")
        src, host = torch.arange(6.0), rt.host_empty(6, torch.float32, True)
        done = _d2h(rt, d2h, src, host)
        dev = rt.device_empty((6,), torch.float32, DEV, K)
        assert torch.isnan(dev).all()
        rt.wait_event(h2d, rt.record_event(rt.current_stream(DEV)))
        rt.wait_event(h2d, done)
        rt.copy(dev, host, h2d, K, "h2d")
        ready = rt.record_event(h2d)
        assert rt.counters.peak_copies_pending == 2
        rt.wait_event(rt.current_stream(DEV), ready)
        assert torch.equal(dev, torch.arange(6.0))
        assert rt.counters.peak_fetch_buffers == {"k": 1}
        del dev
        assert rt.counters.fetch_buffers == {"k": 0}


def test_threaded_mode_gives_the_same_data():
    with fresh_runtime("sim", mode="threaded", seed=3) as rt:
        s = rt.new_stream(DEV, "copy")
        hosts = [rt.host_empty(8, torch.float32, True) for _ in range(5)]
        srcs = [torch.full((8,), float(i)) for i in range(5)]
        events = [_d2h(rt, s, src, h) for src, h in zip(srcs, hosts)]
        rt.wait_event(rt.current_stream(DEV), events[-1])   # FIFO: the last covers all
        for i, h in enumerate(hosts):
            assert torch.equal(h, torch.full((8,), float(i)))


@pytest.mark.parametrize("mode", ["lazy", "threaded"])
def test_a_copy_frees_its_dropped_source_only_when_the_host_sees_it_complete(mode):
    """Both modes free a copied tensor the program dropped at the same point of the host
    program: the host's wait on the copy's event, never when a worker thread gets to it (that
    made the memory accountant's live bytes depend on thread timing)."""
    import gc
    import time
    import weakref

    from fpdt.memory import MemoryAccountant

    with fresh_runtime("sim", mode=mode, max_delay_s=0.0) as rt:
        s = rt.new_stream(DEV, "copy")
        host = rt.host_empty(96, torch.float32, True)
        with MemoryAccountant("cpu") as acct:
            src = torch.ones(96)
            alive = weakref.ref(src.untyped_storage())
            done = _d2h(rt, s, src, host)
            del src
            deadline = time.monotonic() + 10
            while mode == "threaded" and s.done < 1 and time.monotonic() < deadline:
                time.sleep(0.001)                           # the worker has run the copy ...
            gc.collect()
            assert alive() is not None and acct.device_live == 384    # ... but the host has not seen it
            rt.wait_event(rt.current_stream(DEV), done)
            assert alive() is None and acct.device_live == 0
        assert torch.equal(host, torch.ones(96))


def test_free_without_record_stream_is_a_hazard_naming_the_role():
    with pytest.raises(StreamHazardError, match=r"'k chunk 3, layer 2' was freed while the d2h copy"):
        with fresh_runtime("sim") as rt:
            s = rt.new_stream(DEV, "copy")
            src, host = torch.ones(4), rt.host_empty(4, torch.float32, True)
            rt.wait_event(s, rt.record_event(rt.current_stream(DEV)))
            rt.copy(host, src, s, K, "d2h")     # no record_stream
            del src
            rt.record_event(s)                  # the next runtime call sees the free


def test_free_with_record_stream_is_fine():
    with fresh_runtime("sim") as rt:
        s = rt.new_stream(DEV, "copy")
        src, host = torch.ones(4), rt.host_empty(4, torch.float32, True)
        done = _d2h(rt, s, src, host)
        del src
        rt.wait_event(rt.current_stream(DEV), done)
        assert torch.equal(host, torch.ones(4))


def test_unordered_side_streams_are_a_hazard():
    with pytest.raises(StreamHazardError, match="nothing orders the two"):
        with fresh_runtime("sim") as rt:
            d2h, h2d = rt.new_stream(DEV, "d2h"), rt.new_stream(DEV, "h2d")
            src, host = torch.ones(4), rt.host_empty(4, torch.float32, True)
            _d2h(rt, d2h, src, host)
            dev = rt.device_empty((4,), torch.float32, DEV, K)
            rt.wait_event(h2d, rt.record_event(rt.current_stream(DEV)))
            rt.copy(dev, host, h2d, K, "h2d")   # missing: h2d waits for the d2h event


def test_copy_not_ordered_after_compute_is_a_hazard():
    with pytest.raises(StreamHazardError, match="without waiting for the compute stream"):
        with fresh_runtime("sim") as rt:
            s = rt.new_stream(DEV, "copy")
            rt.record_event(rt.current_stream(DEV))
            rt.copy(rt.host_empty(4, torch.float32, True), torch.ones(4), s, K, "d2h")


@pytest.mark.parametrize("fault", ["drop_wait", "drop_record_stream"])
def test_faults_break_the_basic_pattern(fault):
    """Each fault alone turns the correct put/get pattern into wrong data or a hazard."""
    with pytest.raises(StreamHazardError):
        with fresh_runtime("sim", fault=fault) as rt:
            s = rt.new_stream(DEV, "copy")
            src, host = torch.ones(4), rt.host_empty(4, torch.float32, True)
            _d2h(rt, s, src, host)
            del src
            rt.record_event(s)
    with fresh_runtime("sim", fault=fault, checks=False) as rt:  # without checks: the data shows it
        s = rt.new_stream(DEV, "copy")
        src, host = torch.ones(4), rt.host_empty(4, torch.float32, True)
        done = _d2h(rt, s, src, host)
        rt.wait_event(rt.current_stream(DEV), done)
        if fault == "drop_wait":
            assert torch.isnan(host).all()


def test_synchronize_counts_host_syncs_and_runs_everything():
    with fresh_runtime("sim") as rt:
        s = rt.new_stream(DEV, "copy")
        host = rt.host_empty(4, torch.float32, True)
        src = torch.ones(4)
        _d2h(rt, s, src, host)
        rt.synchronize(DEV)
        assert rt.counters.host_syncs == 1 and rt.counters.copies_pending == 0 and torch.equal(host, src)


def test_selection_and_bad_names(monkeypatch):
    monkeypatch.setenv("FPDT_RUNTIME", "sim")     # the library does not read it: the option chooses
    assert resolve_runtime(None, "cpu") is named_runtime("sync") and named_runtime("sync").name == "sync"
    assert resolve_runtime("sim", "cpu") is named_runtime("sim") and named_runtime("sim").name == "sim"
    with fresh_runtime("sync") as rt:
        assert resolve_runtime(rt, "cpu") is rt and rt is not named_runtime("sync")
    with pytest.raises(ValueError, match="unknown device runtime 'gpu': use one of sim, sync, cuda"):
        named_runtime("gpu")
    with pytest.raises(ValueError, match="FPDT_SIM_MODE='eager' must be one of lazy, threaded"):
        with fresh_runtime("sim", mode="eager"):
            pass
    with pytest.raises(ValueError, match="FPDT_SIM_FAULT='drop_all' must be one of drop_wait, drop_record_stream"):
        with fresh_runtime("sim", fault="drop_all"):
            pass


def _child_runtime(queue):
    from fpdt.offload import named_runtime
    rt = named_runtime("sim")
    queue.put((rt.name, rt.mode, rt.fault))


@pytest.mark.slow
def test_spawned_ranks_inherit_the_simulator_options(monkeypatch):
    monkeypatch.setenv("FPDT_SIM_MODE", "threaded")
    monkeypatch.setenv("FPDT_SIM_FAULT", "drop_wait")
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    p = ctx.Process(target=_child_runtime, args=(queue,))
    p.start()
    try:
        assert queue.get(timeout=120) == ("sim", "threaded", "drop_wait")
    finally:
        p.join(timeout=30)


def test_trainer_allows_cpu_offload_only_on_an_explicit_cpu_runtime():
    from fpdt.train.config import ConfigError, TrainerOptions, validate
    opts = TrainerOptions(offload=True, checkpointing="offload")
    with pytest.raises(ConfigError, match="set FPDT_RUNTIME=sim"):
        validate(opts, 64, 1, "cpu", {})
    for name in ("sim", "sync"):
        assert validate(TrainerOptions(offload=True, checkpointing="offload", runtime=name),
                        64, 1, "cpu", {}).num_chunks == 1


def test_the_named_sim_runtime_follows_its_sim_options(monkeypatch):
    """A sim runtime made under FPDT_SIM_FAULT does not outlive the variable: named_runtime
    gives a clean one once it is unset, and the same instance while the options stay."""
    monkeypatch.setenv("FPDT_SIM_FAULT", "drop_record_stream")
    faulty = named_runtime("sim")
    assert faulty.fault == "drop_record_stream" and named_runtime("sim") is faulty
    monkeypatch.delenv("FPDT_SIM_FAULT")
    clean = named_runtime("sim")
    assert clean.fault is None and clean is not faulty and named_runtime("sim") is clean
