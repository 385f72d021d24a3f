"""The shapes of what the Python API returns (``Router.chat``, ``complete``, ``embed``,
``status``...): llama-server's JSON, typed for an editor and a type checker.  Every reply
is a plain ``dict`` at run time, as llama-server wrote it; these TypedDicts name the keys
a caller reads most, and llama.cpp may add more."""

from __future__ import annotations

from typing import Any, Literal, TypedDict

__all__ = ["Message", "ChatCompletion", "ChatCompletionChunk", "Completion", "CompletionChunk", "Embeddings",
           "Usage", "Status", "ModelStatus", "DeviceStatus", "WorkerStatus"]


class Message(TypedDict, total=False):
    role: Literal["system", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None
    reasoning_content: str
    tool_calls: list[dict[str, Any]]
    tool_call_id: str
    name: str


class Usage(TypedDict, total=False):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: dict[str, int]


class _ChatChoice(TypedDict, total=False):
    index: int
    message: Message
    finish_reason: str | None
    logprobs: dict[str, Any] | None


class ChatCompletion(TypedDict, total=False):
    """``POST /v1/chat/completions``'s reply."""

    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[_ChatChoice]
    usage: Usage
    timings: dict[str, float]


class _ChunkChoice(TypedDict, total=False):
    index: int
    delta: Message
    finish_reason: str | None


class ChatCompletionChunk(TypedDict, total=False):
    """One event of a streamed chat completion."""

    id: str
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    choices: list[_ChunkChoice]
    usage: Usage
    timings: dict[str, float]


class _TextChoice(TypedDict, total=False):
    index: int
    text: str
    finish_reason: str | None
    logprobs: dict[str, Any] | None


class Completion(TypedDict, total=False):
    """``POST /v1/completions``'s reply (and, streamed, each event's)."""

    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[_TextChoice]
    usage: Usage
    timings: dict[str, float]


CompletionChunk = Completion


class _Embedding(TypedDict):
    index: int
    object: Literal["embedding"]
    embedding: list[float]


class Embeddings(TypedDict, total=False):
    """``POST /v1/embeddings``'s reply."""

    object: Literal["list"]
    model: str
    data: list[_Embedding]
    usage: Usage


class ModelStatus(TypedDict, total=False):
    """One model in ``Router.status()``: its state and what it holds."""

    state: Literal["unloaded", "loading", "loaded", "unloading"]
    aliases: list[str]
    leases: int  # requests in flight
    devices: list[str]  # where it is loaded
    held: dict[str, int]  # bytes it holds per device (what admission counts)
    requirement: dict[str, dict[str, int]]  # probed bytes per device set ("GPU0+GPU1")
    live: dict[str, int]  # bytes the worker measured after the load
    reason: str | None  # why it is unloaded (a failed load, a dead worker)
    loads: int
    replica_of: str | None  # an extra instance's model
    kept: dict[str, int]  # prompt states kept across eviction: bytes in RAM and on disk, files
    idle_seconds: float | None
    waiting: dict[str, Any]  # requests waiting for it, and why
    ttl: float | None  # seconds idle before it is unloaded: a client's keep_alive, else its config's (None: never)
    context: dict[str, Any] | None  # n_ctx (the fit's, or as probed), n_ctx_train, slots...
    projector: bool  # it has a multimodal projector


class DeviceStatus(TypedDict, total=False):
    """One device in ``Router.status()``: what admission sees of it, in bytes."""

    kind: str
    total: int
    free: int | None  # what the device (or the host) reports free
    capacity: int  # what models may hold there: its size (or budget) less the margin
    held: int  # what our models, workers and kept states hold
    available: int | None  # what a new model may take now
    overhead: int  # our workers' own bytes
    kept: int  # kept prompt states in RAM (the host)
    external: int  # what other programs hold, erring high (what a load under way allocated counts until it settles)
    margin: int


class WorkerStatus(TypedDict, total=False):
    devices: list[str]
    pid: int | None
    alive: bool
    overhead: dict[str, int]
    idle_seconds: float | None
    stopping: bool


class Status(TypedDict, total=False):
    """``Router.status()``: every model, device and worker, the queue and the counters."""

    models: dict[str, ModelStatus]
    devices: dict[str, DeviceStatus]
    workers: list[WorkerStatus]
    counters: dict[str, int]
    queue: int  # requests waiting for a model
    kept: dict[str, Any]
    downloads: dict[str, Any]
