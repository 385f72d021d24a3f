"""Exact memory estimates: what loading a ModelSpec allocates, per device, and the
cache of them.  Plain data and JSON: the router process reads estimates here
without llama.cpp; engine/probe.py makes them.

Rows come per backend buffer type, straight from llama.cpp's own
``llama_get_memory_breakdown`` plus the host output (logits) buffer it leaves
out.  ``MemoryEstimate.devices`` folds them into memory pools: a host buffer
type (CPU, CUDA_Host, ...) lives in system memory, pool "CPU"; any other lives
on its device ("CUDA0", "RPC1", ...).

A cache entry is keyed by the model files' identity (path, size, mtime, inode),
the spec, the llama.cpp version and the device masks.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping

from pyllmrouter.devices import MASK_VARS
from pyllmrouter.spec import ModelSpec

__all__ = [
    "BufferUse",
    "DeviceUse",
    "ModelFacts",
    "MemoryEstimate",
    "ProbeError",
    "cached_estimate",
    "aggregate",
    "cache_dir",
    "files_of",
    "llama_args",
    "HOST",
]

HOST = "CPU"  # the pool name of system memory, as ggml names the CPU device
_SHARD = re.compile(r"-(\d{5})-of-(\d{5})\.gguf$")


class ProbeError(RuntimeError):
    """A model could not be probed; ``path`` and ``reason`` say which and why."""

    def __init__(self, path: str, reason: str):
        super().__init__(f"{path}: {reason}")
        self.path = path
        self.reason = reason


@dataclass(frozen=True)
class BufferUse:
    """Bytes of one ggml backend buffer type."""

    buffer_type: str
    device: str
    host: bool
    model: int = 0
    context: int = 0
    compute: int = 0
    output: int = 0
    cache: int = 0  # the engine's host prompt cache, at its cap (llama-server's --cache-ram)
    projector: int = 0  # the multimodal projector (mmproj): weights and compute
    checkpoints: int = 0  # llama-server's context checkpoints of every slot, at their cap (host)
    component: str = "model"  # "model" (the model and its context), "draft" (the draft's), "projector", "lora"

    @property
    def pool(self) -> str:
        return HOST if self.host else self.device

    @property
    def total(self) -> int:
        return self.model + self.context + self.compute + self.output + self.cache + self.projector + self.checkpoints


@dataclass(frozen=True)
class DeviceUse:
    """Bytes one model needs in one memory pool (a device, or host memory)."""

    device: str
    weights: int = 0
    kv: int = 0
    compute: int = 0
    output: int = 0
    cache: int = 0  # host prompt cache cap
    projector: int = 0  # multimodal projector
    draft: int = 0  # the draft model: its weights, KV, compute and output together
    lora: int = 0  # LoRA adapters' weights
    checkpoints: int = 0  # context checkpoints (SWA, hybrid and recurrent models), at their cap

    @property
    def total(self) -> int:
        return (self.weights + self.kv + self.compute + self.output + self.cache + self.projector + self.draft
                + self.lora + self.checkpoints)


@dataclass(frozen=True)
class ModelFacts:
    architecture: str
    name: str
    n_layer: int
    n_ctx_train: int
    n_embd: int
    n_head: int
    n_expert: int
    n_vocab: int
    n_params: int
    model_size: int
    file_size: int
    devices: tuple[str, ...] = ()


_WHOLE = {"draft": 6, "lora": 7}  # components folded whole into DeviceUse.draft, DeviceUse.lora


def aggregate(buffers: Iterable[BufferUse]) -> tuple[DeviceUse, ...]:
    """Fold buffer rows into one row per pool: devices by name (CUDA2 before CUDA10), host last."""
    sums: dict[str, list[int]] = {}
    for b in buffers:
        s = sums.setdefault(b.pool, [0, 0, 0, 0, 0, 0, 0, 0, 0])
        if (whole := _WHOLE.get(b.component)) is not None:  # counted as one part, whatever its buffers
            s[whole] += b.total
            continue
        s[0] += b.model
        s[1] += b.context
        s[2] += b.compute
        s[3] += b.output
        s[4] += b.cache
        s[5] += b.projector
        s[8] += b.checkpoints
    def key(name: str) -> tuple:
        stem = name.rstrip("0123456789")
        return stem, int(name[len(stem):] or -1)

    order = sorted((d for d in sums if d != HOST), key=key) + ([HOST] if HOST in sums else [])
    return tuple(DeviceUse(d, *sums[d]) for d in order)


@dataclass(frozen=True)
class MemoryEstimate:
    """What loading ``spec`` allocates, per buffer type and per device."""

    spec: ModelSpec
    facts: ModelFacts
    buffers: tuple[BufferUse, ...]
    n_ctx: int
    n_seq_max: int
    # what llama-server made of the spec's arguments (_native.server_params): its context,
    # slots, cache types, fit... as plain values
    params: dict[str, Any] = field(default_factory=dict, compare=False)
    cached: bool = field(default=False, compare=False)

    @property
    def devices(self) -> tuple[DeviceUse, ...]:
        return aggregate(self.buffers)

    def per_device(self) -> dict[str, int]:
        """Total bytes per pool: the figure admission compares with free memory."""
        return {d.device: d.total for d in self.devices}

    @property
    def total(self) -> int:
        return sum(b.total for b in self.buffers)

    def to_dict(self) -> dict[str, Any]:
        d = {
            "spec": self.spec.to_dict(),
            "facts": asdict(self.facts),
            "buffers": [asdict(b) for b in self.buffers],
            "n_ctx": self.n_ctx,
            "n_seq_max": self.n_seq_max,
            "params": self.params,
        }
        d["devices"] = [dict(asdict(u), total=u.total) for u in self.devices]
        d["total"] = self.total
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any], cached: bool = False) -> "MemoryEstimate":
        facts = dict(d["facts"])
        facts["devices"] = tuple(facts.get("devices", ()))
        return cls(
            spec=ModelSpec.from_dict(d["spec"]),
            facts=ModelFacts(**facts),
            buffers=tuple(BufferUse(**b) for b in d["buffers"]),
            n_ctx=d["n_ctx"],
            n_seq_max=d["n_seq_max"],
            params=dict(d.get("params", {})),
            cached=cached,
        )


# -- files ------------------------------------------------------------------

def _shards(path: str) -> list[str]:
    """All files of a model: the path itself, or every shard of a split GGUF."""
    m = _SHARD.search(path)
    if not m:
        return [path]
    n = int(m.group(2))
    stem = path[: m.start()]
    return [f"{stem}-{i:05d}-of-{n:05d}.gguf" for i in range(1, n + 1)]


def check_file(path: str) -> list[os.stat_result]:
    """Stat every file of the model; raise ProbeError for what llama.cpp would choke on."""
    stats = []
    for p in _shards(path):
        try:
            st = os.stat(p)
        except FileNotFoundError:
            raise ProbeError(p, "file not found") from None
        except OSError as e:
            raise ProbeError(p, f"cannot read: {e.strerror}") from None
        if not os.path.isfile(p):
            raise ProbeError(p, "not a regular file")
        if st.st_size == 0:
            raise ProbeError(p, "empty file")
        stats.append(st)
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise ProbeError(path, f"not a GGUF file (starts with {magic!r}, expected b'GGUF')")
    return stats


# -- cache ------------------------------------------------------------------

def cache_dir() -> Path:
    root = os.environ.get("PYLLMROUTER_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "pyllmrouter")
    return Path(root)


@functools.cache
def _installation() -> tuple[str, tuple[str, ...]]:
    """The llama.cpp build and the GPUs of this machine (fixed while a process lives)."""
    gpus_dir = "/proc/driver/nvidia/gpus"
    gpus = tuple(sorted(os.listdir(gpus_dir))) if os.path.isdir(gpus_dir) else ()
    import importlib.metadata  # noqa: PLC0415 - here: its import is most of an idle ``import pyllmrouter``

    return importlib.metadata.version("llama-cpp-python"), gpus


def _environment(env: Mapping[str, str]) -> dict[str, Any]:
    """What decides which devices llama.cpp sees, and the arguments it reads from the
    environment (LLAMA_ARG_*), readable without loading it."""
    masks = {k: env.get(k) for k in MASK_VARS}
    version, gpus = _installation()
    return {"llama_cpp": version, "masks": masks, "gpus": gpus, "args": llama_args(env)}


def _file_id(st: os.stat_result) -> tuple[int, int, int]:
    """What changes when a file is rewritten: size, modification time, inode."""
    return st.st_size, st.st_mtime_ns, st.st_ino


def _file_id_of(path: str) -> tuple[int, int, int] | None:
    try:
        return _file_id(os.stat(path))
    except OSError:  # a missing file: the probe names it
        return None


def files_of(spec: ModelSpec, env: Mapping[str, str] | None = None) -> list[tuple[str, tuple[int, int, int] | None]]:
    """Every file a load of ``spec`` reads, each with what changes when it is rewritten:
    the model's shards, then the files its arguments name (a projector, a draft, adapters,
    a template...) and those llama.cpp's LLAMA_ARG_* variables in ``env`` name, each with
    its shards; a missing one as None."""
    named = [*spec.files(), *(v for v in llama_args(env or {}).values() if os.path.isfile(v))]
    paths = [*_shards(spec.path), *(p for f in named for p in _shards(f))]
    return [(os.path.realpath(p), _file_id_of(p)) for p in dict.fromkeys(paths)]


def llama_args(env: Mapping[str, str]) -> dict[str, str]:
    """The arguments llama.cpp reads from the environment (LLAMA_ARG_*)."""
    return {k: v for k, v in env.items() if k.startswith("LLAMA_ARG_")}


def cache_path(spec: ModelSpec, stats: list[os.stat_result], env: Mapping[str, str]) -> Path:
    ident = {
        "path": os.path.realpath(spec.path),
        "files": [_file_id(st) for st in stats],
        "spec": spec.to_dict(),
        "env": _environment(env),
        # the files the arguments and LLAMA_ARG_* name, loaded beside the model: a projector,
        # a draft, adapters... (llama.cpp says which argument is which: here, any that is a file)
        "beside": files_of(spec, env)[len(stats):],
    }
    key = hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:40]
    return cache_dir() / "probes" / f"{key}.json"


def cached_estimate(spec: ModelSpec, env: Mapping[str, str]) -> MemoryEstimate | None:
    """The cached probe of ``spec`` as a process with environment ``env`` made it.

    Never loads llama.cpp: the router process uses this for masked devices.
    """
    try:
        stats = check_file(spec.path)
    except ProbeError:
        return None
    return cache_read(cache_path(spec, stats, env))


def cache_read(path: Path) -> MemoryEstimate | None:
    try:
        return MemoryEstimate.from_dict(json.loads(path.read_text()), cached=True)
    except (OSError, ValueError, KeyError, TypeError):
        return None


def cache_write(path: Path, est: MemoryEstimate) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps(est.to_dict()))
        os.replace(tmp, path)
    except OSError:
        pass  # a read-only cache costs speed, never correctness
