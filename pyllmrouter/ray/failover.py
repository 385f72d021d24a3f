"""A node lost under a request: what becomes of the request, and which nodes are left
out (pure: no Ray, no clock of its own).

    the node is lost (a call to its replica raised; or it stopped answering pings)
      ├─ the reply had not begun (no status; a whole reply: no Started)
      │     └─ sent to another node, once, with the seconds it waited (its place in line)
      │        lost again: 502 node_died
      ├─ a whole reply had Started (its generation ran there): 502 node_died
      └─ a stream had its status: it ends with an error event (ingress._relay)

A lost node is left out of every request for ``hold`` seconds: longer than Ray takes
to mark a killed node dead (its GCS misses five health checks, about 15 s), after which
the node is no longer listed.  A node still listed after the hold is tried again: it
was unreachable for a while (a hung node whose statistics stopped is left out by the
request router meanwhile: ``silent_after``).
"""

from __future__ import annotations

from typing import Callable

__all__ = ["HOLD", "RETRY", "FAIL", "after_loss", "LostNodes", "stats_timeout", "silent_after"]

HOLD = 30.0  # seconds a lost node is left out
RETRY, FAIL = "retry", "fail"


def stats_timeout(period: float) -> float:
    """Seconds Serve waits for a replica's statistics before it gives a reading up."""
    return max(5.0, period)


def silent_after(period: float) -> float:
    """Seconds without a new reading of a replica's statistics that mean it stopped
    answering them: two readings missed at their longest (Serve asks every ``period``)."""
    return 2 * (period + stats_timeout(period))


def after_loss(began: bool, retried: bool, for_model: bool) -> str:
    """RETRY: the request goes to another node; FAIL: 502.  ``began``: the node had sent
    its status (a stream) or said the request runs (a whole reply's Started);
    ``retried``: the request was sent on once already; ``for_model``: a model's request
    (a question for one named node is not sent elsewhere)."""
    return RETRY if for_model and not began and not retried else FAIL


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
