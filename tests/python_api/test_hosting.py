"""EngineHost, the worker's side of a model: its call threads are kept between
requests, and closing the host ends them."""

from __future__ import annotations

import json
import queue
import threading

from pyllmrouter import ModelSpec
from pyllmrouter.engine.backend import native
from pyllmrouter.engine.hosting import EngineHost
from pyllmrouter.engine.loader import load
from pyllmrouter.protocol import Batch, Call, Result


def call_threads(name: str) -> int:
    return sum(1 for t in threading.enumerate() if t.name.startswith(f"call-{name}_"))


def test_call_threads_are_kept_between_requests_and_end_with_the_host(tiny):
    spec = ModelSpec(tiny["tiny-llama"], ("-np", "4"), n_ctx=512)
    replies: queue.SimpleQueue = queue.SimpleQueue()

    def send(msg):
        for m in msg.messages if isinstance(msg, Batch) else [msg]:
            replies.put(m)

    def finished(n: int) -> list[Result]:
        done = []
        while len(done) < n:
            m = replies.get(timeout=60)
            if isinstance(m, Result):
                done.append(m)
        return done

    body = json.dumps({"prompt": "hello", "max_tokens": 4, "temperature": 0}).encode()
    host = EngineHost("pool", load(spec), native(), send)
    try:
        for rid in range(1, 6):  # one after the other: one thread serves them all
            host.call(Call(rid, "pool", "POST", "/v1/completions", body))
            assert finished(1)[0].value.status == 200
        assert call_threads("pool") == 1
        for rid in range(10, 14):  # four at once: never more threads than requests in flight
            host.call(Call(rid, "pool", "POST", "/v1/completions", body))
        assert all(r.value.status == 200 for r in finished(4))
        assert 1 <= call_threads("pool") <= 4
    finally:
        host.close()
    assert call_threads("pool") == 0
