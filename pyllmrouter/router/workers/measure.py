"""Measuring for the scheduler, in processes masked as the model's worker will be.

    requirement(spec, ds) ──▶ ds the model's only candidate (the load will be there):
                              its worker started, if it is not running
                          ──▶ probe cache hit? ── no ──▶ Probe in the worker of ds, or in
                                                         a short-lived one masked the same
                                                         way ──▶ bytes per device
    fit(spec, ds, grant)  ──▶ ds's worker started (the load goes there) ──▶ Fit in it
                          ──▶ Fitted (a spec and its bytes, or "no fit" with llama.cpp's reason)

Starting the device set's own worker to measure means one process start (on a
GPU, one backend initialisation) before a model's first token, not two; and a
caller that measures ahead (a Ray replica, when it starts) finds the worker up
when the first request comes, whether or not the probe cache had the bytes.
With several candidates the sets not chosen would keep workers, and their
devices' contexts, for nothing: those measure in short-lived ones.

A file never measured, probed in a worker that hosts models, is first read in a
short-lived process with no device (a host-only probe, cached like any): a file
that trips an assert in llama.cpp aborts that process, not the models beside.
Not a second process on the devices themselves: on a GPU it would be a second
context nobody counted, and an rpc-server serves one client at a time.

No state and no lock of its own: the scheduler calls it from background threads
and records the answers under its lock.  Device names are the inventory's on the
way in and out; inside, the worker's own (masked) names.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any, Callable, Mapping

from pyllmrouter.devices import HOST, Inventory
from pyllmrouter.router.policy.fitbook import Fitted
from pyllmrouter.memory import MemoryEstimate, ProbeError, cached_estimate
from pyllmrouter.protocol import ErrorKind, Failed, Fit, Probe
from pyllmrouter.spec import ModelSpec
from pyllmrouter.router.workers.handle import Launch, WorkerHandle

__all__ = ["Measurer", "worker_spec"]


_SPLIT_FLAGS = ("-ts", "--tensor-split")  # a split the user gave is theirs


def worker_spec(spec: ModelSpec, device_set: frozenset[str], local: Mapping[str, str] | None = None) -> ModelSpec:
    """The spec a worker gets: the mask decides its devices (ggml names inside
    differ), and a split over several devices is explicit, because llama.cpp's
    default split follows free memory, which changes between probe and load.  A
    draft's devices (inventory names) become the names the worker sees (``local``:
    Inventory.to_local); where there are none (emulated devices), the mask decides."""
    draft = spec.draft_devices
    if draft is not None:
        draft = tuple(local[d] for d in draft if d in local) if local else None
    spec = spec.replace(draft_devices=draft)
    n = len([d for d in device_set if d != HOST])
    if n > 1 and spec.tensor_split is None and not any(a in _SPLIT_FLAGS for a in spec.args):
        spec = spec.replace(tensor_split=(1.0,) * n)
    return spec


class Measurer:
    def __init__(self, inventory: Inventory, timeout: float,
                 running_worker: Callable[[frozenset[str]], WorkerHandle | None],
                 start_worker: Callable[[frozenset[str]], WorkerHandle] | None = None,
                 hosts_models: Callable[[frozenset[str]], bool] = lambda ds: False,
                 launch: Launch = WorkerHandle):
        """``start_worker``: starts (and keeps) the worker of a device set; None: measuring
        never starts a worker that stays.  ``hosts_models``: whether a device set's worker
        hosts models (a new file is then read in a host-only process first).  ``launch``:
        makes a short-lived worker's handle (WorkerSet's)."""
        self.inventory = inventory
        self.timeout = timeout
        self._running_worker = running_worker
        self._start_worker = start_worker
        self._hosts_models = hosts_models
        self._launch = launch

    def requirement(self, spec: ModelSpec, device_set: frozenset[str],
                    only: bool = False) -> tuple[dict[str, int], dict[str, dict], dict[str, Any]]:
        """Bytes per inventory device of ``spec`` (a worker spec) loaded masked to
        ``device_set``; its components per memory pool as the worker sees them
        (weights, kv, compute, output, cache, projector, draft, lora, checkpoints); and
        what llama-server makes of its arguments (context, slots, fit...).  ``only``:
        the device set is the model's only candidate, so a worker started for it is the
        one the load will use."""
        est = self._probe(spec, device_set, only)
        components = {d.device: {k: v for k, v in asdict(d).items() if k != "device"} for d in est.devices}
        params = dict(est.params, n_ctx=est.n_ctx, n_seq_max=est.n_seq_max)
        return self.inventory.to_inventory(device_set, est.per_device()), components, params

    def fit(self, spec: ModelSpec, device_set: frozenset[str], grant: dict[str, int]) -> Fitted:
        """``spec`` fitted into ``grant`` (layers per device, MoE experts to the host);
        a grant nothing fits into gives a Fitted without spec; other failures raise."""
        local = self.inventory.to_local(device_set)
        grants = {local[d]: n for d, n in grant.items() if d in local}
        if local:
            grants[HOST] = grant[HOST]
        else:  # no device to move layers to: the worker's host pool is what the set holds (its context)
            charged = [d for d in device_set if d != HOST]  # emulated devices share what the host runs
            grants[HOST] = min(grant[d] for d in charged) * len(charged) if charged else grant[HOST]
        self._start(device_set)
        reply = self._call(device_set, lambda rid: Fit(rid, spec, grants))
        if isinstance(reply, Failed):
            if reply.kind is ErrorKind.NO_FIT:
                return Fitted(grant, error=reply.message)
            raise RuntimeError(f"{reply.kind.value}: {reply.message}")
        v = reply.value
        to_inv = self.inventory.to_inventory
        return Fitted(grant, ModelSpec.from_dict(v["spec"]), to_inv(device_set, v["per_device"]),
                      to_inv(device_set, v["layers"]), v["experts_on_host"], tuple(v.get("to_host", ())),
                      n_ctx=v.get("n_ctx"))

    def _probe(self, spec: ModelSpec, device_set: frozenset[str], only: bool) -> MemoryEstimate:
        if only:
            self._start(device_set)
        hit = cached_estimate(spec, self.inventory.mask_env(device_set))
        if hit is not None:
            return hit
        if self._hosts_models(device_set):
            self._read_apart(spec)
        reply = self._call(device_set, lambda rid: Probe(rid, spec))
        if isinstance(reply, Failed):
            raise ProbeError(spec.path, reply.message.removeprefix(spec.path + ": "))
        return MemoryEstimate.from_dict(reply.value)

    def _read_apart(self, spec: ModelSpec) -> None:
        """``spec``'s files read by llama.cpp in a short-lived process with no device
        (skipped when that probe is cached): an abort there raises ProbeError; any
        other answer is left to the probe on the devices, which gives the real one."""
        host = spec.replace(n_gpu_layers=0, tensor_split=None, tensor_overrides=(), mmproj_offload=False,
                            draft_n_gpu_layers=0, draft_devices=None)
        if cached_estimate(host, self.inventory.mask_env(frozenset())) is not None:
            return
        reply = self._call(frozenset(), lambda rid: Probe(rid, host), temporary=True)
        if isinstance(reply, Failed) and reply.kind is ErrorKind.WORKER_DIED:
            raise ProbeError(spec.path, f"llama.cpp aborted reading it ({reply.message})")

    def _start(self, device_set: frozenset[str]) -> None:
        """The worker of ``device_set``, started and kept, where the scheduler keeps workers."""
        if self._start_worker is not None:
            self._start_worker(device_set)

    def _call(self, device_set: frozenset[str], make, temporary: bool = False) -> Any:
        """One call in the worker of ``device_set``, or in a short-lived one masked the same way."""
        worker = None if temporary else self._running_worker(device_set)
        temporary = worker is None or not worker.alive
        if temporary:
            worker = self._launch(f"probe-{'+'.join(sorted(device_set))}", device_set,
                                  self.inventory.mask_env(device_set), lambda w: None)
            worker.start()
        try:
            return worker.call(make).get(self.timeout)
        finally:
            if temporary:
                worker.stop()
