"""Device inventory: what memory each device has, learned without a GPU context.

The router process never initialises a GPU backend, so it reads devices from
outside: system memory from ``/proc/meminfo``, NVIDIA GPUs through NVML
(``nvidia-ml-py``, optional).  Emulated devices (``GPU0=24GiB``) stand in for
GPUs on machines without one: they are executed by the CPU backend, and the
bytes the CPU probe measures are charged to them.

An inventory also says how a worker for a *device set* is masked (the
environment set before llama.cpp is imported) and how the pools a masked probe
reports ("CUDA0" inside a worker that sees only the host's CUDA2, say) map back
to inventory names.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Mapping, Protocol

__all__ = [
    "Device",
    "Inventory",
    "SystemInventory",
    "EmulatedInventory",
    "RpcInventory",
    "RPC_ENV",
    "parse_size",
    "parse_budgets",
    "HOST",
    "MASK_VARS",
]

HOST = "CPU"
# the rpc-servers a worker attaches as its devices ("host:port,...")
RPC_ENV = "PYLLMROUTER_RPC_SERVERS"
# every variable that decides which devices a ggml process sees
MASK_VARS = ("CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES", "GGML_VK_VISIBLE_DEVICES",
             RPC_ENV)
_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kb": 1 << 10, "kib": 1 << 10, "m": 1 << 20, "mb": 1 << 20, "mib": 1 << 20,
          "g": 1 << 30, "gb": 1 << 30, "gib": 1 << 30, "t": 1 << 40, "tb": 1 << 40, "tib": 1 << 40}


def parse_size(text: str) -> int:
    """'24GiB', '512M', '1.5g', '1000' (bytes) -> bytes."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"not a size: {text!r} (examples: 24GiB, 512MiB, 1000000)")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def parse_budgets(text: str) -> dict[str, int]:
    """'CUDA0=20GiB,CPU=32GiB' -> {'CUDA0': ..., 'CPU': ...}."""
    out: dict[str, int] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, sep, size = part.partition("=")
        if not sep or not name.strip():
            raise ValueError(f"not a device budget: {part!r} (expected NAME=SIZE, e.g. CUDA0=20GiB)")
        out[name.strip()] = parse_size(size)
    return out


@dataclass(frozen=True)
class Device:
    name: str  # inventory name: CPU, CUDA0, GPU1 (emulated), ...
    kind: str  # cpu | cuda | emulated
    total: int
    index: int = 0  # index within its kind (CUDA ordinal)


class Inventory(Protocol):
    def devices(self) -> list[Device]: ...

    def free(self) -> dict[str, int]:
        """Free bytes per device now (other programs' use included)."""

    def mask_env(self, device_set: frozenset[str]) -> dict[str, str]:
        """Environment for a worker that may touch only ``device_set``."""

    def to_inventory(self, device_set: frozenset[str], pools: Mapping[str, int]) -> dict[str, int]:
        """Map a masked probe's pools (worker-local names) to inventory devices."""

    def process_usage(self, pid: int) -> dict[str, int]:
        """Device bytes a process holds (its GPU context included), where known."""

    def worker_overhead(self, device_set: frozenset[str]) -> dict[str, int]:
        """Device bytes a worker of ``device_set`` holds before any model, where known
        without measuring (emulated devices: as configured); real ones are measured."""

    def to_local(self, device_set: frozenset[str]) -> dict[str, str]:
        """Inventory name -> the name a worker masked to ``device_set`` sees (only the
        devices llama.cpp really offloads to: none for emulated devices)."""


def _meminfo() -> tuple[int, int]:
    """(total, available) system memory in bytes."""
    values = {}
    with open("/proc/meminfo") as f:
        for line in f:
            key, _, rest = line.partition(":")
            values[key] = int(rest.split()[0]) * 1024
    return values["MemTotal"], values.get("MemAvailable", values["MemFree"])


def _cuda_order(device_set: frozenset[str]) -> list[str]:
    """The CUDA devices of a set in ordinal order: inside a worker masked to the set,
    the i-th of them is CUDAi."""
    return sorted((d for d in device_set if d.startswith("CUDA")), key=lambda d: int(d[4:]))


def _hide_all_gpus() -> dict[str, str]:
    # "-1" is an invalid ordinal: CUDA then sees no device (an empty string is
    # read as "unset" by some runtimes); no rpc-server is attached.  CUDA numbers its
    # devices fastest first unless told otherwise, NVML (our names: CUDA0, CUDA1...) by
    # PCI bus: on a box of unlike GPUs "CUDA_VISIBLE_DEVICES=1" would then be another
    # card than NVML's device 1, so CUDA is told to number them as NVML does
    return {**{v: "-1" for v in MASK_VARS if v != RPC_ENV}, RPC_ENV: "", "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}


class _NVML:
    """NVIDIA devices through NVML: no CUDA context is created."""

    def __init__(self):
        import pynvml  # noqa: PLC0415 - optional dependency

        pynvml.nvmlInit()
        self.nvml = pynvml
        self.handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]

    def memory(self, i: int) -> tuple[int, int]:
        info = self.nvml.nvmlDeviceGetMemoryInfo(self.handles[i])
        return int(info.total), int(info.free)

    def process_usage(self, pid: int) -> dict[str, int]:
        out = {}
        for i, h in enumerate(self.handles):
            for p in self.nvml.nvmlDeviceGetComputeRunningProcesses(h):
                if p.pid == pid and p.usedGpuMemory:
                    out[f"CUDA{i}"] = int(p.usedGpuMemory)
        return out


class SystemInventory:
    """The real machine: system memory, plus NVIDIA GPUs when NVML is available."""

    def __init__(self):
        try:
            self._nvml: _NVML | None = _NVML()
        except Exception:  # noqa: BLE001 - no driver, no library: no NVIDIA GPU
            self._nvml = None

    def devices(self) -> list[Device]:
        out = [Device(HOST, "cpu", _meminfo()[0])]
        if self._nvml:
            out += [Device(f"CUDA{i}", "cuda", self._nvml.memory(i)[0], i) for i in range(len(self._nvml.handles))]
        return out

    def free(self) -> dict[str, int]:
        out = {HOST: _meminfo()[1]}
        if self._nvml:
            for i in range(len(self._nvml.handles)):
                out[f"CUDA{i}"] = self._nvml.memory(i)[1]
        return out

    def mask_env(self, device_set: frozenset[str]) -> dict[str, str]:
        env = _hide_all_gpus()
        cuda = _cuda_order(device_set)
        if cuda:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(d[4:] for d in cuda)
        return env

    def process_usage(self, pid: int) -> dict[str, int]:
        return self._nvml.process_usage(pid) if self._nvml else {}

    def worker_overhead(self, device_set: frozenset[str]) -> dict[str, int]:
        return {}  # measured: NVML's view of the worker's process

    def to_local(self, device_set: frozenset[str]) -> dict[str, str]:
        cuda = _cuda_order(device_set)
        return {d: f"CUDA{i}" for i, d in enumerate(cuda)}

    def to_inventory(self, device_set: frozenset[str], pools: Mapping[str, int]) -> dict[str, int]:
        cuda = _cuda_order(device_set)
        out: dict[str, int] = {}
        for pool, n in pools.items():
            name = cuda[int(pool[4:])] if pool.startswith("CUDA") and pool[4:].isdigit() else pool
            out[name] = out.get(name, 0) + n
        return out


class EmulatedInventory:
    """Virtual devices of given sizes, executed by the CPU backend.

    ``EmulatedInventory({"GPU0": 24 << 30, "GPU1": 24 << 30})``.  Nothing else
    uses them, so their free memory is their size; the bytes a model needs on
    one are what the CPU probe measures for it.  The host keeps its real size
    unless ``host`` gives one.
    """

    def __init__(self, sizes: Mapping[str, int], host: int | None = None, worker_overhead: int = 0):
        """``worker_overhead``: bytes a worker holds on each emulated device of its set before
        any model, as a GPU context would (0: none)."""
        if HOST in sizes:
            raise ValueError(f"{HOST} is the host; give its size as host=")
        self._sizes = dict(sizes)
        self._host = host
        self._overhead = worker_overhead

    @classmethod
    def parse(cls, text: str, worker_overhead: int = 0) -> "EmulatedInventory":
        sizes = parse_budgets(text)
        host = sizes.pop(HOST, None)
        return cls(sizes, host, worker_overhead)

    def devices(self) -> list[Device]:
        host = self._host if self._host is not None else _meminfo()[0]
        return [Device(HOST, "cpu", host)] + [
            Device(n, "emulated", s, i) for i, (n, s) in enumerate(self._sizes.items())
        ]

    def free(self) -> dict[str, int]:
        total, available = _meminfo()
        host = available if self._host is None else min(self._host, available)
        return {HOST: host, **self._sizes}

    def mask_env(self, device_set: frozenset[str]) -> dict[str, str]:
        return _hide_all_gpus()

    def process_usage(self, pid: int) -> dict[str, int]:
        return {}  # emulated devices hold nothing outside what the probe measures and the worker's overhead

    def worker_overhead(self, device_set: frozenset[str]) -> dict[str, int]:
        return {d: self._overhead for d in device_set if d in self._sizes and self._overhead}

    def to_local(self, device_set: frozenset[str]) -> dict[str, str]:
        return {}  # run by the CPU backend: there is no device to move layers off

    def to_inventory(self, device_set: frozenset[str], pools: Mapping[str, int]) -> dict[str, int]:
        emulated = sorted(d for d in device_set if d != HOST)
        if not emulated:
            return dict(pools)
        # executed on the CPU, charged to the emulated devices (split evenly)
        total = sum(pools.values())
        share, rest = divmod(total, len(emulated))
        return {d: share + (rest if i == 0 else 0) for i, d in enumerate(emulated)}


class RpcInventory:
    """ggml rpc-servers as devices: ``RPC0``, ``RPC1``... in the order given.

    ``RpcInventory({"127.0.0.1:50052": 8 << 30, ...})``.  A worker's mask is
    the set of endpoints it attaches (``PYLLMROUTER_RPC_SERVERS``), so inside it
    its own first server is ``RPC0`` whatever its inventory name.  An
    rpc-server backed by a CPU reports the memory of its whole host, so each
    device's size is given here (the budget it may use).
    """

    def __init__(self, servers: Mapping[str, int], host: int | None = None):
        self._endpoints = list(servers)
        self._sizes = {f"RPC{i}": size for i, size in enumerate(servers.values())}
        self._host = host

    @classmethod
    def parse(cls, text: str) -> "RpcInventory":
        """'127.0.0.1:50052=8GiB,127.0.0.1:50053=8GiB[,CPU=16GiB]'."""
        servers, host = {}, None
        for part in filter(None, (p.strip() for p in text.split(","))):
            endpoint, sep, size = part.rpartition("=")
            if not sep or not endpoint:
                raise ValueError(f"not an rpc device: {part!r} (expected HOST:PORT=SIZE)")
            if endpoint == HOST:
                host = parse_size(size)
            else:
                servers[endpoint] = parse_size(size)
        return cls(servers, host)

    def endpoint(self, name: str) -> str:
        return self._endpoints[int(name[3:])]

    def devices(self) -> list[Device]:
        host = self._host if self._host is not None else _meminfo()[0]
        return [Device(HOST, "cpu", host)] + [Device(n, "rpc", s, i) for i, (n, s) in enumerate(self._sizes.items())]

    def free(self) -> dict[str, int]:
        available = _meminfo()[1]
        return {HOST: available if self._host is None else min(self._host, available), **self._sizes}

    def _attached(self, device_set: frozenset[str]) -> list[str]:
        return sorted((d for d in device_set if d.startswith("RPC")), key=lambda d: int(d[3:]))

    def mask_env(self, device_set: frozenset[str]) -> dict[str, str]:
        return {**_hide_all_gpus(), RPC_ENV: ",".join(self.endpoint(d) for d in self._attached(device_set))}

    def to_inventory(self, device_set: frozenset[str], pools: Mapping[str, int]) -> dict[str, int]:
        attached = self._attached(device_set)
        out: dict[str, int] = {}
        for pool, n in pools.items():
            name = attached[int(pool[3:])] if pool.startswith("RPC") and pool[3:].isdigit() else pool
            out[name] = out.get(name, 0) + n
        return out

    def process_usage(self, pid: int) -> dict[str, int]:
        return {}

    def worker_overhead(self, device_set: frozenset[str]) -> dict[str, int]:
        return {}

    def to_local(self, device_set: frozenset[str]) -> dict[str, str]:
        return {d: f"RPC{i}" for i, d in enumerate(self._attached(device_set))}
