"""Messages between the router and a worker, over a multiprocessing pipe.

    router ──LoadModel / UnloadModel / Run / Cancel / Probe / Stats / Shutdown──▶ worker
    router ◀──Ready / Loaded / Unloaded / Chunk / Result / Failed──────── worker

Every request carries a ``req_id``; every reply names the request it answers.
A request is finished by exactly one Result, Failed, Loaded or Unloaded (a
stream sends Chunks first, then its Result).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .spec import ModelSpec

__all__ = [
    "LoadModel", "UnloadModel", "Run", "Cancel", "Probe", "Fit", "Stats", "Shutdown",
    "Ready", "Loaded", "Unloaded", "Chunk", "Result", "Failed", "Batch", "FINAL",
]


# -- router -> worker -------------------------------------------------------

@dataclass(frozen=True)
class LoadModel:
    req_id: int
    name: str
    spec: ModelSpec
    llama_kwargs: dict[str, Any] = field(default_factory=dict)  # chat_format, seed...


@dataclass(frozen=True)
class UnloadModel:
    req_id: int
    name: str


@dataclass(frozen=True)
class Run:
    req_id: int
    name: str
    method: str  # "chat" | "complete" | "embed"
    kwargs: dict[str, Any]
    stream: bool = False


@dataclass(frozen=True)
class Cancel:
    req_id: int


@dataclass(frozen=True)
class Probe:
    req_id: int
    spec: ModelSpec


@dataclass(frozen=True)
class Fit:
    req_id: int
    spec: ModelSpec
    grants: dict[str, int]  # worker-local device names (and "CPU") -> bytes


@dataclass(frozen=True)
class Stats:
    """Answered at once by the worker's main thread: a Result with the counters of
    each batched model it hosts (model name -> EngineStats.as_dict())."""

    req_id: int


@dataclass(frozen=True)
class Shutdown:
    pass


# -- worker -> router -------------------------------------------------------

@dataclass(frozen=True)
class Ready:
    pid: int
    overhead: dict[str, int]  # bytes the idle worker holds, per pool (worker-local names)


@dataclass(frozen=True)
class Loaded:
    req_id: int
    name: str
    pools: dict[str, int]  # live breakdown + output buffer, per pool
    seconds: float


@dataclass(frozen=True)
class Unloaded:
    req_id: int
    name: str


@dataclass(frozen=True)
class Chunk:
    req_id: int
    value: Any


@dataclass(frozen=True)
class Result:
    req_id: int
    value: Any


@dataclass(frozen=True)
class Failed:
    req_id: int
    kind: str  # exception class name
    message: str


@dataclass(frozen=True)
class Batch:
    """Several replies in one pipe message (a decode step's chunks): one pickle, one write."""

    messages: list[Any]


FINAL = (Loaded, Unloaded, Result, Failed)
