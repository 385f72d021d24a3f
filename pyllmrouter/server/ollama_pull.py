"""Ollama's pull progress: the lines ``/api/pull`` streams while the router downloads a model
through llama.cpp's cache (server/ollama.py starts the download and streams these)."""

from __future__ import annotations

import asyncio
from typing import Any, AsyncIterator

from pyllmrouter.router.api import Router

__all__ = ["progress", "PULL_POLL"]

PULL_POLL = 0.25  # seconds between readings of a pull's progress


async def progress(router: Router, name: str) -> AsyncIterator[dict[str, Any]]:
    """Ollama's pull progress lines for ``name``: until it is listed (success) or its download failed."""
    yield {"status": "pulling manifest"}
    while True:
        if router.scheduler.canonical(name) is not None:
            yield {"status": "success"}
            return
        d = router.status()["downloads"].get(name)
        if d is not None and d["status"] == "failed":
            yield {"error": f"pull of '{name}' failed: {d['error']}"}
            return
        if d is None:  # ended (a model that came is listed before its download ends), or stopped
            if router.scheduler.canonical(name) is None:
                yield {"error": f"pull of '{name}' ended with no model file (no such repository or tag?), "
                                f"or was stopped"}
                return
            continue
        for url, p in (d or {}).get("progress", {}).items():
            yield {"status": f"pulling {url.rsplit('/', 1)[-1]}", "digest": url, "total": p["total"],
                   "completed": p["done"]}
        await asyncio.sleep(PULL_POLL)
