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


def save_all(engine: Any, directory: str, budget: int | None = None) -> list[tuple[str, int, int]]:
    """Save every slot that holds tokens as slot<N>.bin in ``directory``, within ``budget``
    bytes in all (None: no bound): a slot whose state could pass what is left is not saved
    (its bound is known before it is written: its KV state's size, and its tokens at most
    the context), and one that did all the same is removed at once.  (file name, tokens,
    bytes) of each one saved."""
    kept, left = [], budget
    for slot in range(engine.n_parallel):
        name = f"slot{slot}.bin"
        path = os.path.join(directory, name)
        if left is not None:
            state = engine.slot_state_size(slot)
            if state == 0:
                continue  # nothing in it
            if state + 8 * engine.n_ctx + 4096 > left:
                _LOG.info("slot %d not kept: its state (%d bytes) would pass the RAM left for kept states (%d)",
                          slot, state, left)
                continue
        data = _action(engine, True, slot, path)
        if not data.get("n_saved"):
            if "error" in data:
                _LOG.warning("slot %d not saved: %s", slot, data["error"])
            if os.path.exists(path):
                os.unlink(path)
            continue
        written = int(data["n_written"])
        if left is not None and written > left:  # bigger than its bound after all (multimodal tokens)
            os.unlink(path)
            continue
        if left is not None:
            left -= written
        kept.append((name, int(data["n_saved"]), written))
    return kept


def restore_all(engine: Any, paths: list[str]) -> tuple[dict[str, int], dict[str, str]]:
    """Restore each slot<N>.bin file (a path: the router's RAM or disk directory) into slot
    N; (file name -> tokens restored, file name -> why refused)."""
    restored, refused = {}, {}
    for path in paths:
        name = os.path.basename(path)
        try:
            slot = int(name.removeprefix("slot").removesuffix(".bin"))
        except ValueError:
            refused[name] = "not a slot state file"
            continue
        if not 0 <= slot < engine.n_parallel:
            refused[name] = f"slot {slot} does not exist"
            continue
        data = _action(engine, False, slot, path)
        if data.get("n_restored"):
            restored[name] = int(data["n_restored"])
        else:
            err = data.get("error")
            refused[name] = str(err.get("message", err)) if isinstance(err, dict) else str(data)
    return restored, refused
