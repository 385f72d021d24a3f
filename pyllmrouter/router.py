"""The Python API: ``Router`` serves OpenAI-shaped requests over the scheduler.

    app ──chat/complete/embed──▶ Router ──lease──▶ Scheduler (admission, eviction)
                                   │                   │ background: probe, load, unload
                                   └──Run──▶ WorkerHandle ──pipe──▶ worker process
                                   ◀──Chunk* Result | Failed──┘

    with Router([ModelConfig("chat", ModelSpec("chat.gguf"))]) as router:
        router.chat("chat", [{"role": "user", "content": "hi"}])
        for chunk in router.complete("chat", "Once", stream=True): ...
        router.status()   # per model state and per device requirement, used and free

Every call ends with a result or an exception (UnknownModel, NeverFits,
QueueTimeout, LoadFailed, WorkerDied, RequestFailed); a worker killed mid
request fails that request at once and the next request starts a new worker.
"""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any, AsyncIterator, Iterable

from .config import ModelConfig, RouterOptions
from .devices import Inventory, SystemInventory
from .errors import RequestFailed, RouterError, WorkerDied
from .openai_params import normalize
from .protocol import Chunk, Failed, Result, Run, Stats
from .scheduler import Record, Scheduler

__all__ = ["Router"]


class Router:
    def __init__(self, models: Iterable[ModelConfig], *, inventory: Inventory | None = None,
                 options: RouterOptions | None = None, **option_overrides: Any):
        options = options or RouterOptions()
        if option_overrides:
            options = RouterOptions(**{**options.__dict__, **option_overrides})
        self.options = options
        self._sched = Scheduler(list(models), inventory or SystemInventory(), options)
        self._stop = threading.Event()
        self._reaper = threading.Thread(target=self._reap, name="ttl-reaper", daemon=True)
        self._reaper.start()
        for rec in self._sched.records():
            if rec.config.load_on_startup:
                threading.Thread(target=self._load_quietly, args=(rec.name,), daemon=True).start()

    @classmethod
    def from_preset(cls, path, **kw: Any) -> "Router":
        """A router over the models of a llama-server preset INI file."""
        from .presets import read_preset  # noqa: PLC0415

        preset = read_preset(path)
        return cls(preset.models, **{**preset.router, **kw})

    # -- lifecycle -------------------------------------------------------------

    def __enter__(self) -> "Router":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Stop every worker; leaves no child process behind."""
        self._stop.set()
        self._sched.close()
        self._reaper.join(5)

    def _reap(self) -> None:
        while not self._stop.wait(1.0):
            self._sched.reap_idle()

    def _load_quietly(self, name: str) -> None:
        try:
            self.load(name)
        except RouterError:
            pass  # the failure is recorded on the model (status shows it)

    # -- control ---------------------------------------------------------------

    def load(self, name: str, timeout: float | None = None) -> None:
        """Load ``name`` (evicting idle models if needed) and return once LOADED."""
        rec = self._sched.lease(name, timeout, autoload=True)
        self._sched.release(rec)

    def unload(self, name: str, wait: float | None = 30.0) -> bool:
        return self._sched.unload(name, wait)

    def status(self) -> dict[str, Any]:
        return self._sched.status()

    def engine_stats(self, timeout: float = 5.0) -> dict[str, dict[str, float]]:
        """Per loaded model with parallel slots, what its batch loop has done since it
        was loaded (``EngineStats``: decode calls, busy slots, prompt and generated
        tokens, seconds in llama_decode and in whole steps).  Asked of every worker
        at once; a worker that does not answer within ``timeout`` is left out."""
        asked = []
        for w in self._sched.workers():
            try:
                asked.append(w.call(Stats))
            except WorkerDied:
                pass
        out: dict[str, dict[str, float]] = {}
        deadline = time.monotonic() + timeout
        for pending in asked:
            try:
                reply = pending.get(max(0.0, deadline - time.monotonic()))
            except TimeoutError:
                continue
            if isinstance(reply, Result):
                out.update(reply.value)
        return out

    def models(self) -> list[ModelConfig]:
        return [r.config for r in self._sched.records()]

    @property
    def scheduler(self) -> Scheduler:
        return self._sched

    # -- requests --------------------------------------------------------------

    def chat(self, model: str, messages: list[dict[str, Any]], *, stream: bool = False,
             timeout: float | None = None, autoload: bool | None = None, **params: Any):
        """OpenAI chat completion (a dict), or an iterator of chunks with ``stream=True``."""
        return self._request(model, "chat", dict(params, messages=messages), stream, timeout, autoload)

    def complete(self, model: str, prompt: str | list[int], *, stream: bool = False, timeout: float | None = None,
                 autoload: bool | None = None, **params: Any):
        """OpenAI completion of a prompt (text or token ids); chunks with ``stream=True``."""
        return self._request(model, "complete", dict(params, prompt=prompt), stream, timeout, autoload)

    def embed(self, model: str, input: str | list[str], *, timeout: float | None = None,
              autoload: bool | None = None, **params: Any) -> dict[str, Any]:
        return self._request(model, "embed", dict(params, input=input), False, timeout, autoload)

    async def achat(self, model: str, messages: list[dict[str, Any]], *, stream: bool = False,
                    timeout: float | None = None, autoload: bool | None = None, **params: Any):
        """``chat`` awaited in the running event loop (async iterator of chunks with ``stream=True``)."""
        result = await self.arequest(model, "chat", dict(params, messages=messages), stream, timeout, autoload)
        return _aiter(result) if stream else result

    async def acomplete(self, model: str, prompt: str | list[int], *, stream: bool = False,
                        timeout: float | None = None, autoload: bool | None = None, **params: Any):
        result = await self.arequest(model, "complete", dict(params, prompt=prompt), stream, timeout, autoload)
        return _aiter(result) if stream else result

    async def aembed(self, model: str, input: str | list[str], *, timeout: float | None = None,
                     autoload: bool | None = None, **params: Any) -> dict[str, Any]:
        return await self.arequest(model, "embed", dict(params, input=input), False, timeout, autoload)

    async def arequest(self, model: str, method: str, kwargs: dict[str, Any], stream: bool = False,
                       timeout: float | None = None, autoload: bool | None = None) -> "Stream | dict[str, Any]":
        """One request (``method``: chat, complete or embed; ``kwargs`` as llama_cpp takes
        them) from a coroutine: the reply dict, or a Stream to ``anext_batch``.

        A model that can take the request now is leased in the event loop (no thread
        hop before the worker has it); otherwise the lease is waited for in a thread.
        """
        kwargs = self._check(model, method, kwargs)
        rec = self._sched.try_lease(model)
        if rec is None:
            rec = await asyncio.to_thread(self._sched.lease, model, timeout, autoload)
        pending = self._run(rec, method, kwargs, stream)
        if stream:
            return self._stream(rec, pending)
        try:
            while (reply := pending.get_nowait()) is None:
                await pending.wait_async()
        except BaseException:  # the caller left: stop the request; the lease ends with its reply
            pending.cancel()
            threading.Thread(target=self._release_after, args=(rec, pending), daemon=True).start()
            raise
        self._sched.release(rec)
        return _value(rec, reply)

    def _request(self, model: str, method: str, kwargs: dict[str, Any], stream: bool,
                 timeout: float | None, autoload: bool | None):
        kwargs = self._check(model, method, kwargs)
        rec = self._sched.lease(model, timeout, autoload)
        pending = self._run(rec, method, kwargs, stream)
        if stream:
            return self._stream(rec, pending)
        try:
            reply = pending.get()
        finally:
            self._sched.release(rec)
        return _value(rec, reply)

    def _check(self, model: str, method: str, kwargs: dict[str, Any]) -> dict[str, Any]:
        """The request's parameters, checked before anything is leased or loaded for it."""
        spec = self._sched.resolve(model).config.spec
        if spec.embedding != (method == "embed"):
            what = "an embedding model: use embeddings" if spec.embedding else "not an embedding model"
            raise RequestFailed(model, "ValueError", f"model {model!r} is {what}")
        return normalize(method, kwargs)

    def _run(self, rec: Record, method: str, kwargs: dict[str, Any], stream: bool):
        """Send the request to the leased model's worker (the lease is released if that fails)."""
        try:
            return rec.worker.call(lambda rid: Run(rid, rec.name, method, kwargs, stream))
        except BaseException:
            self._sched.release(rec)
            raise

    def _release_after(self, rec: Record, pending) -> None:
        try:
            pending.get()
        finally:
            self._sched.release(rec)

    def _stream(self, rec: Record, pending) -> "Stream":
        return Stream(rec, pending, self._sched.release)


class Stream:
    """Chunks of one streaming request; ``cancel()`` may be called from any thread.

    The lease on the model is released exactly once: when the final reply
    arrives, whether the stream was read to its end, closed or cancelled.
    """

    def __init__(self, rec: Record, pending, release):
        self._rec = rec
        self._pending = pending
        self._release = release
        self._done = False
        self._lock = threading.Lock()
        self._read = threading.Lock()  # one reader at a time (a drain may race a reader)
        self._failure: RouterError | None = None  # a failure found by anext_batch, raised next
        self.usage: dict[str, Any] | None = None  # token counts, once the stream has ended (batched path)

    @property
    def done(self) -> bool:
        """Whether the final reply has arrived (nothing more will come)."""
        return self._done

    def __iter__(self) -> "Stream":
        return self

    def __next__(self) -> dict[str, Any]:
        with self._read:
            if self._failure is not None:
                failure, self._failure = self._failure, None
                raise failure
            if self._done:
                raise StopIteration
            msg = self._pending.get()
            if isinstance(msg, Chunk):
                return msg.value
            self._finish(msg)
        if isinstance(msg, Failed):
            raise _error(self._rec, msg)
        raise StopIteration

    async def anext_batch(self) -> list[dict[str, Any]]:
        """The next chunk and every further one already here ([] at the end), awaited in
        the event loop (woken by the worker's reader thread), not in a thread."""
        while (out := self._ready()) is None:
            await self._pending.wait_async()
        return out

    def _ready(self) -> list[dict[str, Any]] | None:
        """The chunks already here, [] at the end, None if none is here yet; a failure
        is raised once, after the chunks that came before it."""
        with self._read:
            out = []
            while not self._done:
                msg = self._pending.get_nowait()
                if msg is None:
                    break
                if isinstance(msg, Chunk):
                    out.append(msg.value)
                    continue
                self._finish(msg)
                if isinstance(msg, Failed):
                    self._failure = _error(self._rec, msg)
            if out:
                return out
            if self._failure is not None:
                failure, self._failure = self._failure, None
                raise failure
            return [] if self._done else None

    def _finish(self, final: Any) -> None:
        if isinstance(final, Result) and isinstance(final.value, dict):
            self.usage = final.value.get("usage")
        with self._lock:
            if self._done:
                return
            self._done = True
        self._release(self._rec)

    def cancel(self) -> None:
        """Stop generation (thread-safe). Whoever reads the stream then sees its end."""
        if not self._done:
            self._pending.cancel()

    def close(self) -> None:
        """Cancel and wait for the worker's final reply (the lease is then free)."""
        self.cancel()
        self._drain()

    def _drain(self) -> None:
        while not self._done:
            try:
                next(self)
            except (StopIteration, RouterError):
                return

    def abandon(self) -> None:
        """Cancel without waiting: the final reply is read (and the lease freed) in the background."""
        if not self._done:
            self.cancel()
            threading.Thread(target=self._drain, daemon=True).start()

    def __del__(self) -> None:
        self.abandon()


def _value(rec: Record, reply: Any) -> Any:
    if isinstance(reply, Failed):
        raise _error(rec, reply)
    return reply.value


def _error(rec: Record, reply: Failed) -> RouterError:
    if reply.kind == "WorkerDied":
        return WorkerDied(f"model {rec.name!r}: {reply.message}")
    return RequestFailed(rec.name, reply.kind, reply.message)


async def _aiter(stream: Stream) -> AsyncIterator[dict[str, Any]]:
    try:
        while chunks := await stream.anext_batch():
            for chunk in chunks:
                yield chunk
    finally:
        stream.abandon()
