"""Which node runs a repeatable request: one answer, agreed by the node and the ingress.

    ingress ──NodeRequest(ticket)──▶ node's replica: the request leased, a slot free
                                        │ claim(ticket) ──▶ Ledger ──▶ True: it runs (Started)
                                        │                          └─▶ False: given up, it never runs
    ingress: the node lost, or silent ──▶ abandon(ticket) ──▶ claimed: it may have run there (502/504)
                                                         └──▶ not claimed: it never will: sent on,
                                                              under a new ticket
    ingress: its call over (the reply's head came, or it failed) ──▶ settle(ticket)

The invariant (``Claims``): a ticket is claimed or abandoned, whichever comes first, and
never both.  A node runs a request only after its claim came back True; the ingress sends
a request on only after its abandon came back unclaimed.  So a request runs on one node
at most, whatever is lost in transit: a Started that never arrived, a node that stops
and resumes, a claim whose answer was lost (the node does not run it; the ingress takes
it for run: a 502 that says "may have run", never a second run).

One Ledger (a small Ray actor) per ingress, on the ingress's node: it lives and dies
with the ingress, whose clients are the only ones its tickets serve.  ``Claims`` is the
pure state; the actor only calls it.
"""

from __future__ import annotations

from collections import OrderedDict

__all__ = ["Claims", "Ledger", "ABANDONED_KEPT"]

ABANDONED_KEPT = 1 << 16  # tickets given up that a late claim is still refused for (the latest)


class Claims:
    """Claimed and abandoned tickets.  ``claim`` and ``abandon`` each decide once, for
    both sides: the first of the two wins."""

    def __init__(self, kept: int = ABANDONED_KEPT):
        self._claimed: set[str] = set()
        self._abandoned: OrderedDict[str, None] = OrderedDict()
        self._kept = kept

    def claim(self, ticket: str) -> bool:
        """A node asks to run ``ticket``'s request: True (it runs) unless it was given up."""
        if ticket in self._abandoned:
            return False
        self._claimed.add(ticket)
        return True

    def abandon(self, ticket: str) -> bool:
        """The ingress gives ``ticket`` up: True where a node had claimed it (it may have
        run: not to be sent on), False where none had (no node will run it now)."""
        if ticket in self._claimed:
            return True
        self._abandoned[ticket] = None
        self._abandoned.move_to_end(ticket)
        while len(self._abandoned) > self._kept:
            self._abandoned.popitem(last=False)
        return False

    def settle(self, ticket: str) -> None:
        """The ingress's call for ``ticket`` is over (its reply began, or it ended): nothing
        will ask about its claim again."""
        self._claimed.discard(ticket)

    def __len__(self) -> int:
        return len(self._claimed) + len(self._abandoned)


class Ledger:
    """The Ray actor around one ``Claims`` (its methods run one at a time: an actor's
    queue; nothing in them awaits)."""

    def __init__(self) -> None:
        self._claims = Claims()

    def claim(self, ticket: str) -> bool:
        return self._claims.claim(ticket)

    def abandon(self, ticket: str) -> bool:
        return self._claims.abandon(ticket)

    def settle(self, ticket: str) -> None:
        self._claims.settle(ticket)

    def size(self) -> int:
        return len(self._claims)
