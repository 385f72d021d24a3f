"""A model's slot states, saved and restored with llama-server's own slot actions
(POST /slots/N?action=save|restore, files in the engine's --slot-save-path)."""

from __future__ import annotations

import json
import logging
import os
from typing import Any

__all__ = ["save_all", "restore_all"]

_LOG = logging.getLogger(__name__)


def _action(engine: Any, slot: int, action: str, filename: str) -> tuple[int, dict]:
    reply = engine.handle("POST", f"/slots/{slot}", {"action": action}, {}, json.dumps({"filename": filename}).encode())
    return reply.status, json.loads(reply.data or b"{}")


def save_all(engine: Any, directory: str) -> list[tuple[str, int, int]]:
    """Save every slot that holds tokens as slot<N>.bin in ``directory`` (the engine's
    slot save path); (file name, tokens, bytes) of each one saved."""
    kept = []
    for slot in range(engine.n_parallel):
        name = f"slot{slot}.bin"
        status, data = _action(engine, slot, "save", name)
        path = os.path.join(directory, name)
        if status != 200 or not data.get("n_saved"):
            if status != 200:
                _LOG.warning("slot %d not saved: %s", slot, data)
            if os.path.exists(path):
                os.unlink(path)
            continue
        kept.append((name, int(data["n_saved"]), int(data["n_written"])))
    return kept


def restore_all(engine: Any, names: list[str]) -> tuple[dict[str, int], dict[str, str]]:
    """Restore slot<N>.bin files into slot N; (file -> tokens restored, file -> why refused)."""
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
        status, data = _action(engine, slot, "restore", name)
        if status == 200 and data.get("n_restored"):
            restored[name] = int(data["n_restored"])
        else:
            refused[name] = str(data.get("error", {}).get("message", data)) if isinstance(data, dict) else str(data)
    return restored, refused
