"""Messages between the router and a worker, over a multiprocessing pipe.

    router ──LoadModel / UnloadModel / StartServices / Call / Cancel / Probe / Fit / Ping / Shutdown──▶ worker
    router ◀──Ready / Loaded / Unloaded / Chunk / Result / Failed──────── worker

Every request carries a ``req_id``; every reply names the request it answers.
A request is finished by exactly one Result, Failed, Loaded or Unloaded (a
stream sends Chunks first, then its Result).  A ``Call`` (a llama-server
request for one model's engine) is answered by ``Result(HttpReply)``, or for a
stream by ``Chunk(HttpReply)`` (status and headers), ``Chunk(bytes)`` per
chunk llama.cpp's handler yields, then ``Result(None)``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from pyllmrouter.spec import ModelSpec

__all__ = [
    "LoadModel", "UnloadModel", "StartServices", "SERVICES", "Call", "HttpReply", "Cancel", "Probe", "Fit", "Ping", "Shutdown",
    "Ready", "Loaded", "Unloaded", "Progress", "Chunk", "Result", "Failed", "ErrorKind", "Batch", "FINAL",
]


# -- router -> worker -------------------------------------------------------

@dataclass(frozen=True)
class LoadModel:
    req_id: int
    name: str
    spec: ModelSpec
    keep_dir: str | None = None  # where the router saves slot states (its own calls only)
    restore: tuple[str, ...] = ()  # slot state files to restore (paths: in RAM or on disk), one per slot
    stream_interval: float = 0.0  # seconds at least between two sends of the model's stream chunks
    alias: str | None = None  # what replies call the model, where not ``name`` (an extra instance's model)


@dataclass(frozen=True)
class UnloadModel:
    req_id: int
    name: str
    keep: bool = False  # save each slot's state into the model's keep_dir first
    budget: int | None = None  # the most bytes those states may take (the router's RAM for them)
    directory: str | None = None  # where to save them instead of keep_dir (the disk directory: RAM is short)


# the name a Call gives to reach llama-server's services (no model is named "")
SERVICES = ""


@dataclass(frozen=True)
class StartServices:
    """llama-server's services beside its models (/tools, /cors-proxy), from the router's
    llama-server arguments: answered by Result(None) once started (the MCP servers too)."""

    req_id: int
    args: tuple[str, ...]


@dataclass(frozen=True)
class Call:
    """One request for a model's llama.cpp server engine, as llama-server receives it."""

    req_id: int
    name: str
    method: str  # GET | POST
    path: str  # /v1/chat/completions, /slots/0...
    body: bytes = b""
    query: dict[str, str] = field(default_factory=dict)
    headers: dict[str, str] = field(default_factory=dict)
    # a multipart request's files, as llama-server's HTTP layer hands them over (its fields
    # are the body, as JSON): field name -> (filename, content type, bytes)
    files: dict[str, tuple[str, str, bytes]] = field(default_factory=dict)


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
class Ping:
    """The heartbeat: answered at once by the worker's main thread with Result(None) (its
    engines decode on threads of their own, so a busy worker answers too)."""

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
    restored: dict[str, int] = field(default_factory=dict)  # kept state file -> tokens now in its slot
    refused: dict[str, str] = field(default_factory=dict)  # kept state file -> why llama.cpp refused it


@dataclass(frozen=True)
class Unloaded:
    req_id: int
    name: str
    kept: tuple[tuple[str, int, int], ...] = ()  # saved slot states: (file name, tokens, bytes)
    hits: int = 0  # slots restored at load whose state a request then took tokens from


@dataclass(frozen=True)
class Progress:
    """A load under way: llama-server's loading state ({stages, current, value}), as its
    child tells its router."""

    req_id: int
    value: dict[str, Any]


@dataclass(frozen=True)
class Chunk:
    req_id: int
    value: Any


@dataclass(frozen=True)
class Result:
    req_id: int
    value: Any


@dataclass(frozen=True)
class HttpReply:
    """llama-server's reply to a Call: its status, content type, headers and body
    (a stream's: its first chunk, the rest follows as Chunk(bytes) messages)."""

    status: int
    content_type: str
    headers: dict[str, str]
    body: bytes = b""
    stream: bool = False

    def json(self) -> Any:
        """The body as JSON (ValueError where it is not)."""
        return json.loads(self.body)


class ErrorKind(str, Enum):
    """Why a request failed, as typed on the pipe (``Failed.kind``)."""

    LOAD_FAILED = "load_failed"  # the model could not be loaded: file, arguments, llama.cpp
    PROBE_FAILED = "probe_failed"  # the probe could not read or build the model
    NO_FIT = "no_fit"  # nothing fits the grant
    NOT_LOADED = "not_loaded"  # the model is not (or no longer) in this worker
    WORKER_DIED = "worker_died"  # the worker process is gone
    INTERNAL = "internal"  # an unexpected exception: a bug (the worker logs its traceback)


@dataclass(frozen=True)
class Failed:
    req_id: int
    kind: ErrorKind
    message: str


@dataclass(frozen=True)
class Batch:
    """Several replies in one pipe message (the chunks of a decode step): one pickle, one write."""

    messages: list[Any]


FINAL = (Loaded, Unloaded, Result, Failed)
