"""Load a ModelSpec as llama.cpp's server engine, with exactly the probed arguments.

    ModelSpec ──to_args()──▶ engine_args(spec, name, extra) ──▶ _native.Engine: llama.cpp's parser
                                                               ──load()──▶ the slot loop running

The probe parses ``ModelSpec.to_args()`` with the same parser and builds the same
llama params from them (``_native.probe_server``), so what it measured is what
the engine allocates.  This module imports llama.cpp: only worker and probe
processes, the CLI and the tests use it.
"""

from __future__ import annotations

import json
from typing import Any, Callable, Iterable

from pyllmrouter.engine.backend import native
from pyllmrouter.spec import ModelSpec

__all__ = ["engine_args", "load", "request"]


def engine_args(spec: ModelSpec, name: str | None = None, extra: Iterable[str] = ()) -> list[str]:
    """llama-server's arguments for ``spec``: its own, the model's name as its alias (what
    replies call the model), llama.cpp's console log off, then ``extra`` (a preset's keys)."""
    return [*spec.to_args(), *(["--alias", name] if name else []), "--log-disable", *extra]


def load(spec: ModelSpec, *extra: str, name: str | None = None,
         progress: Callable[[dict[str, Any]], None] | None = None) -> Any:
    """A loaded ``_native.Engine`` for ``spec``; ``close()`` frees it.  ``progress`` gets
    llama-server's loading state as the load goes ({stages, current, value})."""
    engine = native().Engine(engine_args(spec, name, extra))
    try:
        engine.load(None if progress is None else lambda payload: progress(json.loads(payload)))
    except BaseException:
        engine.close()
        raise
    return engine


def request(engine: Any, path: str, body: dict[str, Any] | None = None, method: str = "POST") -> dict[str, Any]:
    """One whole (not streamed) request to a loaded engine, in this process: its JSON reply."""
    reply = engine.handle(method, path, {}, {}, json.dumps(body or {}).encode())
    if not reply.data:  # what llama-server's handler gives a request stopped under way
        raise RuntimeError(f"{path}: HTTP {reply.status} with no body: the engine was closed under the request")
    data = json.loads(reply.data)
    if reply.status >= 400:
        raise RuntimeError(f"{path}: HTTP {reply.status}: {data}")
    return data
