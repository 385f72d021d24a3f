"""Model states and the transitions between them.

        load admitted            worker says Loaded
    ┌──────────┐ ───────────▶ ┌─────────┐ ───────────▶ ┌────────┐
    │ UNLOADED │              │ LOADING │              │ LOADED │◀─┐ leases +1/-1
    └──────────┘ ◀─────────── └─────────┘              └────────┘──┘ (requests)
         ▲  ▲     load failed / worker died                  │
         │  │                                                │ evict / unload / ttl
         │  │     worker said Unloaded / worker died   ┌───────────┐
         │  └───────────────────────────────────────── │ UNLOADING │ ◀┘
         │                                             └───────────┘
         └──── LOADED ── worker died (reason recorded)
    LOADING ──▶ UNLOADING: the load timed out; it is cancelled in the worker, whose
    Unloaded (or death) ends it: its bytes stay held until then.

A failed load or a dead worker leaves the model UNLOADED with a reason.
Requests are only ever sent to a LOADED model; only an idle LOADED model that
is not persistent may be evicted.
"""

from __future__ import annotations

import enum

__all__ = ["State", "TRANSITIONS", "check_transition", "holds_memory", "evictable"]


class State(enum.Enum):
    UNLOADED = "unloaded"
    LOADING = "loading"
    LOADED = "loaded"
    UNLOADING = "unloading"


TRANSITIONS: dict[State, frozenset[State]] = {
    State.UNLOADED: frozenset({State.LOADING}),
    State.LOADING: frozenset({State.LOADED, State.UNLOADED, State.UNLOADING}),
    State.LOADED: frozenset({State.UNLOADING, State.UNLOADED}),
    State.UNLOADING: frozenset({State.UNLOADED}),
}


def check_transition(old: State, new: State) -> None:
    if new not in TRANSITIONS[old]:
        raise RuntimeError(f"illegal model state transition {old.value} -> {new.value}")


def holds_memory(state: State) -> bool:
    """Memory is (or is about to be) allocated in these states."""
    return state is not State.UNLOADED


def evictable(state: State, leases: int, persistent: bool) -> bool:
    return state is State.LOADED and leases == 0 and not persistent
