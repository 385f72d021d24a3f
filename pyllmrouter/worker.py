"""The worker process: one per device set, hosting models in-process.

    main thread:  conn.recv() ─┬─ LoadModel ──▶ loader thread ─▶ Loaded | Failed
                               ├─ Run ────────▶ the model's queue
                               ├─ UnloadModel ▶ the model's queue (after its requests)
                               ├─ Cancel ─────▶ cancelled set (checked per token)
                               ├─ Probe ──────▶ probe thread ─▶ Result | Failed
                               ├─ Stats ──────▶ Result: each batched model's counters, at once
                               └─ Shutdown / EOF (router gone) ──▶ exit
    model thread (one per model): parallel > 1: a continuous-batching loop (batching.py);
                                parallel 1 / embeddings: requests in arrival order
                                ─▶ Chunk* Result | Failed

The device mask is applied to the environment before llama_cpp is imported,
so this process can only ever see (and create contexts on) its own devices.
Different models serve concurrently; one model serves one request at a time.
"""

from __future__ import annotations

import os
import queue
import threading
import time
from typing import Any, Callable

from .protocol import Cancel, Chunk, Failed, Fit, LoadModel, Loaded, Probe, Ready, Result, Run, Shutdown, \
    Stats, Unloaded, UnloadModel

__all__ = ["worker_main"]


def _rss() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def serve_serial(llm: Any, msg: Run, send: Callable[[Any], None], cancelled: set[int]) -> None:
    """One request through llama_cpp's own methods: Chunk* then Result, or Failed."""
    try:
        _serial(llm, msg, send, cancelled)
    except Exception as e:  # noqa: BLE001 - any failure goes back to the caller
        send(Failed(msg.req_id, type(e).__name__, str(e)))
    finally:
        cancelled.discard(msg.req_id)


def _serial(llm: Any, msg: Run, send: Callable[[Any], None], cancelled: set[int]) -> None:
    if msg.req_id in cancelled:
        send(Failed(msg.req_id, "Cancelled", "request cancelled before it started"))
        return
    kwargs = dict(msg.kwargs)
    if msg.method == "embed":
        send(Result(msg.req_id, llm.create_embedding(**kwargs)))
        return
    import llama_cpp  # noqa: PLC0415 - already imported by the loader
    import numpy as np  # noqa: PLC0415

    if msg.method == "complete":
        from .batching import response_grammar  # noqa: PLC0415
        from .openai_params import check_tokens  # noqa: PLC0415

        if isinstance(kwargs.get("prompt"), list):
            check_tokens(kwargs["prompt"], llm.n_vocab())
        gbnf = response_grammar(kwargs.pop("response_format", None))
        if gbnf:  # create_completion takes a grammar, not a response_format
            kwargs["grammar"] = llama_cpp.LlamaGrammar.from_string(gbnf, verbose=False)
    rid, eos = msg.req_id, llm.token_eos()
    bias = kwargs.pop("logit_bias", None) or {}  # token id -> float (openai_params.normalize)

    def bias_and_cancel(_ids, scores):
        # logit_bias is applied here: llama_cpp drops both its own bias and any
        # logits_processor when given the two together (list.extend returns None)
        for token, b in bias.items():
            if 0 <= token < scores.shape[-1]:
                scores[token] += b
        if rid in cancelled:  # a cancelled request can only end its sequence
            scores = np.full_like(scores, -np.inf)
            scores[eos] = 0.0
        return scores

    kwargs["logits_processor"] = llama_cpp.LogitsProcessorList(
        list(kwargs.get("logits_processor") or []) + [bias_and_cancel])
    fn = {"chat": llm.create_chat_completion, "complete": llm.create_completion}.get(msg.method)
    if fn is None:
        raise ValueError(f"unknown method {msg.method!r}")
    if not msg.stream:
        send(Result(rid, fn(**kwargs)))
        return
    n = 0
    for chunk in fn(stream=True, **kwargs):
        if rid in cancelled:
            break
        send(Chunk(rid, chunk))
        n += 1
    send(Result(rid, {"chunks": n, "cancelled": rid in cancelled}))


class _Hosted:
    """One loaded model served one request at a time, in arrival order."""

    stats = None  # llama_cpp's own methods decode: no step counters

    def __init__(self, name: str, llm: Any, send: Callable[[Any], None], cancelled: set[int]):
        self.name = name
        self.llm = llm
        self.send = send
        self.cancelled = cancelled
        self.queue: queue.SimpleQueue = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._serve, name=f"model-{name}", daemon=True)
        self.thread.start()

    def put(self, msg: Any) -> None:
        self.queue.put(msg)

    def _serve(self) -> None:
        while True:
            msg = self.queue.get()
            if isinstance(msg, UnloadModel):
                self.llm.close()
                self.llm = None
                self.send(Unloaded(msg.req_id, self.name))
                return
            serve_serial(self.llm, msg, self.send, self.cancelled)


class _Worker:
    def __init__(self, conn):
        self.conn = conn
        self.send_lock = threading.Lock()
        self.models: dict[str, _Hosted] = {}
        self.cancelled: set[int] = set()

    def send(self, msg: Any) -> None:
        with self.send_lock:
            self.conn.send(msg)

    def _load(self, msg: LoadModel) -> None:
        from .loader import load  # noqa: PLC0415
        from .probe import aggregate, live_breakdown  # noqa: PLC0415

        try:
            if msg.name in self.models:
                raise RuntimeError(f"model {msg.name!r} is already loaded in this worker")
            t0 = time.perf_counter()
            llm = load(msg.spec, **msg.llama_kwargs)
            pools = {d.device: d.total for d in aggregate(live_breakdown(llm))}
            if msg.spec.n_seq_max > 1 and not msg.spec.embedding:
                from .batching import BatchEngine  # noqa: PLC0415

                serial = lambda llm_, run: serve_serial(llm_, run, self.send, self.cancelled)  # noqa: E731
                self.models[msg.name] = BatchEngine(msg.name, llm, self.send, self.cancelled, serial)
            else:
                self.models[msg.name] = _Hosted(msg.name, llm, self.send, self.cancelled)
            self.send(Loaded(msg.req_id, msg.name, pools, time.perf_counter() - t0))
        except Exception as e:  # noqa: BLE001
            self.send(Failed(msg.req_id, type(e).__name__, str(e)))

    def _probe(self, msg: Probe | Fit) -> None:
        from .fit import fit_here  # noqa: PLC0415
        from .probe import probe  # noqa: PLC0415

        try:
            if isinstance(msg, Fit):
                self.send(Result(msg.req_id, fit_here(msg.spec, msg.grants).to_dict()))
            else:
                self.send(Result(msg.req_id, probe(msg.spec).to_dict()))
        except Exception as e:  # noqa: BLE001
            self.send(Failed(msg.req_id, type(e).__name__, str(e)))

    def serve(self) -> None:
        while True:
            try:
                msg = self.conn.recv()
            except (EOFError, OSError):
                return  # the router is gone: so are we
            if isinstance(msg, Shutdown):
                return
            if isinstance(msg, Cancel):
                self.cancelled.add(msg.req_id)
            elif isinstance(msg, LoadModel):
                threading.Thread(target=self._load, args=(msg,), daemon=True).start()
            elif isinstance(msg, Stats):
                self.send(Result(msg.req_id, {name: m.stats.as_dict() for name, m in list(self.models.items())
                                              if m.stats is not None}))
            elif isinstance(msg, (Probe, Fit)):
                threading.Thread(target=self._probe, args=(msg,), daemon=True).start()
            elif isinstance(msg, UnloadModel):
                hosted = self.models.pop(msg.name, None)
                if hosted is None:
                    self.send(Unloaded(msg.req_id, msg.name))
                else:
                    hosted.put(msg)
            elif isinstance(msg, Run):
                hosted = self.models.get(msg.name)
                if hosted is None:
                    self.send(Failed(msg.req_id, "ModelNotLoaded", f"model {msg.name!r} is not loaded here"))
                else:
                    hosted.put(msg)


def worker_main(conn, env: dict[str, str]) -> None:
    """Process entry point (multiprocessing, spawn)."""
    os.environ.update(env)  # before anything imports llama_cpp
    from ._llama import native  # noqa: PLC0415 - imports llama_cpp under the mask
    from .devices import RPC_ENV  # noqa: PLC0415

    rpc = [e for e in os.environ.get(RPC_ENV, "").split(",") if e]
    if rpc:
        native().add_rpc_servers(rpc)  # this worker's devices: its rpc-servers, as RPC0, RPC1...
    native().devices()  # initialise the backends now, so the overhead below is real
    worker = _Worker(conn)
    worker.send(Ready(os.getpid(), {"CPU": _rss()}))
    worker.serve()
