"""HTTP interface: OpenAI-compatible and llama-server router-compatible.

``create_app`` and ``AppOptions`` are imported when first asked for, so ``serve`` listens
(server/starting.py) before the HTTP app's modules are read."""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["AppOptions", "create_app"]


def __getattr__(name: str) -> Any:
    if name not in __all__:
        raise AttributeError(f"module 'pyllmrouter.server' has no attribute {name!r}")
    value = getattr(importlib.import_module("pyllmrouter.server.app"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
