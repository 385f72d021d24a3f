"""An idle worker gives its device back: an empty worker is a resident admission may stop
(before any model), and it stops by itself once empty past the idle timeout."""

from __future__ import annotations

import os
import time

import pytest

from pyllmrouter import ModelConfig, ModelSpec, Router, probe
from pyllmrouter.devices import EmulatedInventory, RpcInventory

pytestmark = pytest.mark.slow  # real worker processes

SHARE_PROBE_CACHE = True
MiB = 1 << 20
O = 4 * MiB  # what a worker holds on each of its devices before any model (a GPU context, emulated)


def wait_for(predicate, timeout: float = 30.0, what: str = "a condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if value := predicate():
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def workers(r: Router) -> dict[str, dict]:
    return {"+".join(w["devices"]): w for w in r.status()["workers"]}


def test_a_model_gets_in_by_stopping_an_empty_worker_of_another_device_set(tiny):
    small = ModelSpec(tiny["tiny-llama"], ("-np", "1"), n_ctx=512)
    big = ModelSpec(tiny["tiny-llama"], ("-np", "1"), n_ctx=8192)
    n_small, n_big = probe(small).total, probe(big).total
    assert n_big - n_small > O  # the small one fits beside two contexts, the big one beside one only
    gpu0 = n_big + O + O // 2
    models = [ModelConfig("a", small, devices=("GPU0",)), ModelConfig("b", small, devices=("GPU0", "GPU1")),
              ModelConfig("big", big, devices=("GPU0",))]
    inv = EmulatedInventory({"GPU0": gpu0, "GPU1": 1 << 30}, worker_overhead=O)
    with Router(models, inventory=inv, margin=0, worker_idle_timeout=-1) as r:
        r.load("b")  # the worker of {GPU0, GPU1}
        r.unload("b")
        r.load("a")  # the worker of {GPU0}
        r.unload("a")
        assert set(workers(r)) == {"GPU0", "GPU0+GPU1"}
        held = r.status()["devices"]["GPU0"]["held"]
        assert held == 2 * O  # two contexts on GPU0 and no model: held for good, before
        r.load("big")  # it needs GPU0 but one context: the empty worker of the other set goes
        assert set(workers(r)) == {"GPU0"}  # its own worker stays: it serves it
        stopping = [e for e in r.scheduler.bus.recent() if e.event == "worker-stopping"]
        assert [(e.devices, e.data["reason"], e.data["newcomer"]) for e in stopping] == [("GPU0+GPU1", "room", "big")]
        after = r.status()["devices"]["GPU0"]["held"]
        assert after == held - O + n_big  # the stopped worker's context freed, the model in
        assert r.status()["counters"]["workers_stopped_for_room"] == 1
        print(f"held on GPU0: {held} bytes before (two empty workers), {after} after (one worker and the model)")


def test_an_empty_worker_stops_after_the_idle_timeout_and_its_bytes_go(tiny):
    spec = ModelSpec(tiny["tiny-llama"], ("-np", "1"), n_ctx=512)
    inv = EmulatedInventory({"GPU0": 1 << 30}, worker_overhead=O)
    with Router([ModelConfig("a", spec)], inventory=inv, margin=0, worker_idle_timeout=1.0) as r:
        r.complete("a", "hi", max_tokens=2)
        pid = workers(r)["GPU0"]["pid"]
        r.unload("a")
        assert r.status()["devices"]["GPU0"]["held"] == O
        idle = wait_for(lambda: (workers(r).get("GPU0") or {}).get("idle_seconds") is not None, what="idle time")
        assert idle
        wait_for(lambda: not workers(r), 10, "the worker to stop")
        assert r.status()["devices"]["GPU0"]["held"] == 0 and not alive(pid)
        stopped = [e for e in r.scheduler.bus.recent() if e.event == "worker-stopping"]
        assert [e.data["reason"] for e in stopped] == ["idle"]
        assert r.status()["counters"]["workers_stopped_idle"] == 1
        r.complete("a", "hi", max_tokens=2)  # and the next request starts one again


def test_a_worker_is_never_stopped_while_it_serves_or_loads_and_the_one_that_measured_serves(tiny):
    spec = ModelSpec(tiny["tiny-llama"], ("-np", "1"), n_ctx=512)
    inv = EmulatedInventory({"GPU0": 1 << 30}, worker_overhead=O)
    with Router([ModelConfig("a", spec)], inventory=inv, margin=0, worker_idle_timeout=0) as r:
        # measuring, then loading: one process (the worker that measured is the one that loads)
        r.complete("a", "hi", max_tokens=2)
        started = [e for e in r.scheduler.bus.recent() if e.event == "worker-started"]
        assert len(started) == 1
        stream = r.complete("a", "tell me a long story", max_tokens=40, stream=True)
        next(stream)
        assert r.scheduler.reap_workers() == []  # a lease: not empty
        list(stream)
        assert r.scheduler.reap_workers() == []  # a loaded model: not empty
        pid = workers(r)["GPU0"]["pid"]
        r.unload("a")  # empty now: with a timeout of 0, it goes at once
        wait_for(lambda: not workers(r), 10, "the worker to stop")
        assert not alive(pid)


def test_on_rpc_servers_the_idle_worker_lets_go_of_its_servers(rpc_servers, tiny):
    spec = ModelSpec(tiny["tiny-llama"], ("-np", "1"), n_ctx=512)
    inv = RpcInventory({rpc_servers[0]: 1 << 30})
    with Router([ModelConfig("a", spec, devices=("RPC0",))], inventory=inv, margin=0, worker_idle_timeout=1.0) as r:
        assert r.complete("a", "hi", max_tokens=2)["choices"]
        pid = workers(r)["RPC0"]["pid"]
        r.unload("a")
        wait_for(lambda: not workers(r), 10, "the worker to stop")
        assert not alive(pid)
        assert r.complete("a", "hi", max_tokens=2)["choices"]  # the server takes a new worker


def test_a_gpu_workers_mask_numbers_devices_as_nvml_does():
    """Inventory names come from NVML's order (PCI bus); CUDA's own order is fastest first
    unless CUDA_DEVICE_ORDER says otherwise: without it, on a box of unlike GPUs, a model
    pinned to CUDA1 would run on another card than the one admission counted."""
    from pyllmrouter.devices import EmulatedInventory, SystemInventory

    env = SystemInventory().mask_env(frozenset({"CUDA1", "CUDA3"}))
    assert env["CUDA_VISIBLE_DEVICES"] == "1,3" and env["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
    hidden = EmulatedInventory({"GPU0": 1 << 30}).mask_env(frozenset({"GPU0"}))
    assert hidden["CUDA_VISIBLE_DEVICES"] == "-1" and hidden["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
