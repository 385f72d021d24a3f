"""A node lost under a request: what becomes of the request, and which nodes are left
out (pure: no Ray, no clock of its own).

    a call to a node's replica raised (kind_of):
      APP        the node's app failed the request (RayTaskError): 500, no node lost
      TRANSIENT  its object store or memory short, a timeout, Serve refusing (ObjectLostError,
                 OutOfMemoryError, RayServeException...): 503 + Retry-After, the node not
                 held out
      UNSURE     the replica unreachable for now (ActorUnavailableError: what a killed node's
                 calls raise until Ray declares it dead, ~15 s, and what a brief network fault
                 raises too; Serve's own router does not take it for death): the nodes are
                 pinged; one whose replica does not answer within 2 s is LOST, else TRANSIENT
      LOST       the actor or its node dead (ActorDiedError, NodeDiedError, WorkerCrashedError):
      ├─ REPEATABLE (inference on a model: repeating it is unobservable) and not begun
      │  (its node had not claimed its ticket in the ingress's ledger, which now refuses
      │  any claim of it: ledger.py; no Started; none of its reply came)
      │     └─ sent to another node, once, with the seconds it waited (its place in line)
      │        lost again: 502 node_died
      ├─ begun (Started: it held a slot, stream or whole), or not repeatable (a load, a pull,
      │  an unload, a slot action, a delete, a conversation's request): 502 node_died,
      │  naming the node and whether the work may have run there
      └─ a stream had its status: it ends with an error event (ingress._relay), the node lost

The classes (``endpoints.repeatable``: the endpoint table says which routes write):
    repeatable   a POST of a model's inference (an engine route that writes nothing; Ollama's
                 chat, generate, embed with a prompt), no X-Conversation-Id; a GET (it reads)
    not          everything else: /models (pull, delete), /models/load, /models/unload,
                 /slots/{id} (save, restore, erase: one node's engine), /lora-adapters,
                 /props, a resumable stream's lookup (one node's session), Ollama's load
                 without a prompt, a request of a conversation (it writes its stream)

A Started in transit when the node dies does not read as not begun: "begun" is the
ledger's answer (a node runs a request only after its claim came back, and the ingress
sends it on only after its abandon found no claim), so a request runs on one node at
most.  A node silent for answer.SILENT seconds (a stopped host: Ray says nothing for a
minute) is held out and its requests decided alike.

A lost node is left out of every request for ``hold`` seconds: longer than Ray takes
to mark a killed node dead (its GCS misses five health checks, about 15 s), after which
the node is no longer listed.  A node still listed after the hold is tried again: it
was unreachable for a while (a hung node whose statistics stopped is left out by the
request router meanwhile: ``silent_after``).
"""

from __future__ import annotations

from typing import Callable

__all__ = ["HOLD", "RETRY", "FAIL", "LOST", "TRANSIENT", "UNSURE", "APP", "after_loss", "kind_of", "LostNodes",
           "stats_timeout", "silent_after"]

HOLD = 30.0  # seconds a lost node is left out
RETRY, FAIL = "retry", "fail"
LOST, TRANSIENT, UNSURE, APP = "lost", "transient", "unsure", "app"
# Ray's errors that mean the actor (or its node) is gone for good: a replaced replica is a new actor
_DEAD = ("ActorDiedError", "NodeDiedError", "WorkerCrashedError", "LocalRayletDiedError", "ActorUnschedulableError")


def kind_of(e: BaseException) -> str:
    """APP, LOST, UNSURE or TRANSIENT for an exception a call to a replica raised (by class
    name along its MRO: Ray's and Serve's classes, without importing Ray here)."""
    names = [c.__name__ for c in type(e).__mro__]
    if "RayTaskError" in names and "RequestCancelledError" not in names:
        return APP
    if "ActorUnavailableError" in names:
        return UNSURE
    if any(n in names for n in _DEAD) or type(e).__name__ == "RayActorError":  # a bare one: the actor died
        return LOST
    return TRANSIENT


def stats_timeout(period: float) -> float:
    """Seconds Serve waits for a replica's statistics before it gives a reading up."""
    return max(5.0, period)


def silent_after(period: float) -> float:
    """Seconds without a new reading of a replica's statistics that mean it stopped
    answering them: two readings missed at their longest (Serve asks every ``period``)."""
    return 2 * (period + stats_timeout(period))


def after_loss(began: bool, retried: bool, for_model: bool, repeats: bool = True) -> str:
    """RETRY: the request goes to another node; FAIL: 502.  ``began``: the node had sent
    its status or said the request runs (Started: it took a slot); ``retried``: the
    request was sent on once already; ``for_model``: a model's request (a question for one
    named node is not sent elsewhere); ``repeats``: ``endpoints.repeatable``."""
    return RETRY if for_model and repeats and not began and not retried else FAIL


class LostNodes:
    """The nodes found lost, each left out for ``hold`` seconds after it was (``clock``:
    the caller's, monotonic).  One owner: the ingress's event loop."""

    def __init__(self, clock: Callable[[], float], hold: float = HOLD):
        self._clock, self._hold = clock, hold
        self._since: dict[str, float] = {}

    def add(self, nodes: frozenset[str] | set[str]) -> None:
        now = self._clock()
        for node in nodes:
            self._since[node] = now

    def now(self) -> frozenset[str]:
        """The nodes left out now (every request asks: nothing to do while none is)."""
        if not self._since:
            return frozenset()
        horizon = self._clock() - self._hold
        self._since = {n: t for n, t in self._since.items() if t > horizon}
        return frozenset(self._since)
