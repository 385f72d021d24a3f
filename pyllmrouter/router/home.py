"""What a router holds is the process's that built it.

    Router() in process P ──▶ workers, threads, pipes, the kept-state directory: P's
    os.fork() ──▶ the child: a copy of P's memory and descriptors, none of its threads
                   child's copies of the descriptors closed at once (``hold``)
                   a Router call there ─▶ RouterForked (never a wait on a reply no thread reads)
                   close(), finalizers there ─▶ nothing (P's workers and directory are P's)

A fork's child (``os.fork``, a fork-based multiprocessing pool, a pre-forking server)
has no thread of the parent's router: a request there would wait for ever, and a
close() there would stop the parent's workers and remove its kept states.  Its
copies of the router's descriptors are closed right after the fork, so a parent that
dies is seen by its workers (their pipe's end) and by the next router (the kept-state
lock) however long the child lives; closing a copy leaves the parent's open.
"""

from __future__ import annotations

import os
import weakref
from typing import Protocol

from pyllmrouter.errors import RouterForked

__all__ = ["hold", "here"]


class Inherited(Protocol):
    def let_go(self) -> None:
        """Close this process's copies of the object's descriptors, taking no lock (a thread
        of the parent's may have held it at the fork, and it has no thread here)."""


_held: "weakref.WeakSet[Inherited]" = weakref.WeakSet()


def hold(obj: Inherited) -> None:
    """``obj.let_go()`` runs in the child of every later fork of this process."""
    _held.add(obj)


def here(pid: int) -> None:
    """RouterForked where this is not process ``pid`` (the router's, built there)."""
    if os.getpid() != pid:
        raise RouterForked(pid, os.getpid())


def _in_child() -> None:
    held = list(_held)
    _held.clear()  # the child's own: nothing of the parent's to let go at its own forks
    for obj in held:
        obj.let_go()


os.register_at_fork(after_in_child=_in_child)
