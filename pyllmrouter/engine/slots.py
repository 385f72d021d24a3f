"""A model's slot states, saved and restored by the router itself: llama-server's slot
save and restore tasks posted on the engine's own queue (``Engine.slot_file``), into
the kept-state store's directory.  No client request reaches them: a client's
``POST /slots/N?action=...`` is llama-server's, refused unless the user gave the model
a ``--slot-save-path`` of their own, and then confined to it."""

from __future__ import annotations

import json
import logging
import os
from typing import Any

__all__ = ["save_all", "restore_all"]

_LOG = logging.getLogger(__name__)


def _action(engine: Any, save: bool, slot: int, path: str) -> dict:
    try:
        return json.loads(engine.slot_file(save, slot, path))
    except (RuntimeError, ValueError) as e:
        return {"error": {"message": str(e)}}


def save_all(engine: Any, directory: str) -> list[tuple[str, int, int]]:
    """Save every slot that holds tokens as slot<N>.bin in ``directory``; (file name,
    tokens, bytes) of each one saved."""
    kept = []
    for slot in range(engine.n_parallel):
        name = f"slot{slot}.bin"
        path = os.path.join(directory, name)
        data = _action(engine, True, slot, path)
        if not data.get("n_saved"):
            if "error" in data:
                _LOG.warning("slot %d not saved: %s", slot, data["error"])
            if os.path.exists(path):
                os.unlink(path)
            continue
        kept.append((name, int(data["n_saved"]), int(data["n_written"])))
    return kept


def restore_all(engine: Any, directory: str, names: list[str]) -> tuple[dict[str, int], dict[str, str]]:
    """Restore ``directory``/slot<N>.bin files into slot N; (file -> tokens restored,
    file -> why refused)."""
    restored, refused = {}, {}
    for name in names:
        try:
            slot = int(name.removeprefix("slot").removesuffix(".bin"))
        except ValueError:
            refused[name] = "not a slot state file"
            continue
        if not 0 <= slot < engine.n_parallel:
            refused[name] = f"slot {slot} does not exist"
            continue
        data = _action(engine, False, slot, os.path.join(directory, name))
        if data.get("n_restored"):
            restored[name] = int(data["n_restored"])
        else:
            err = data.get("error")
            refused[name] = str(err.get("message", err)) if isinstance(err, dict) else str(data)
    return restored, refused
