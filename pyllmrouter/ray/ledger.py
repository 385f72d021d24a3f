"""Which node runs a repeatable request: one answer, agreed by the node and the ingress.

    ingress ──NodeRequest(ticket)──▶ node's replica: the request leased, a slot free
                                        │ claim(ticket) ──▶ Ledger ──▶ True: it runs (Started)
                                        │                          └─▶ False: given up, it never runs
    ingress: the node lost, or silent ──▶ abandon(ticket) ──▶ claimed: it may have run there (502/504)
                                                         └──▶ not claimed: it never will: sent on,
                                                              under a new ticket
    ingress: its call over (the reply's head came, or it failed) ──▶ settle(ticket)

The invariant (``Claims``): a ticket is claimed or abandoned, whichever comes first, and
never both; a ticket is claimed once.  A node runs a request only after its claim came back True; the ingress sends
a request on only after its abandon came back unclaimed.  So a request runs on one node
at most, whatever is lost in transit: a Started that never arrived, a node that stops
and resumes, a claim whose answer was lost (the node does not run it; the ingress takes
it for run: a 502 that says "may have run", never a second run).

One Ledger (a small Ray actor) per ingress, on the ingress's node: it lives and dies
with the ingress, whose clients are the only ones its tickets serve.  A ledger found
dead is replaced (the ingress asks it every few seconds); a claim sent to the dead one
fails, and a request whose claim fails does not run (503: the ingress sends it on).  Each
request keeps the ledger it was ticketed with, for its claim and for the ingress's
abandon and settle: a request ticketed with the old one is never judged by the new.  ``Claims`` is the
pure state; the actor only calls it.
"""

from __future__ import annotations

from collections import OrderedDict

__all__ = ["Claims", "Ledger", "ABANDONED_KEPT"]

ABANDONED_KEPT = 1 << 16  # tickets given up that a late claim is still refused for (the latest)


class Claims:
    """Claimed and given-up tickets (the ingress numbers them, one count: a later attempt
    has a higher number).  ``claim`` and ``abandon`` each decide once, for both sides: the
    first of the two wins.  Only the latest ``kept`` given-up tickets are kept (more while
    an older request is still in flight: the ingress says its lowest); any ticket at or
    under the highest one let go is refused a claim."""

    def __init__(self, kept: int = ABANDONED_KEPT):
        self._claimed: set[int] = set()
        self._abandoned: OrderedDict[int, None] = OrderedDict()
        self._kept = kept
        self._floor = -1  # the highest given-up ticket let go

    def claim(self, ticket: int) -> bool:
        """A node asks to run ``ticket``'s request: True (it runs) unless it was given up or
        claimed already."""
        if ticket <= self._floor or ticket in self._abandoned or ticket in self._claimed:
            return False
        self._claimed.add(ticket)
        return True

    def abandon(self, ticket: int, low: int | None = None) -> bool:
        """The ingress gives ``ticket`` up: True where a node had claimed it (it may have
        run: not to be sent on), False where none had (no node will run it now).  ``low``:
        the lowest ticket still in flight at the ingress; the floor stays under it."""
        if ticket in self._claimed:
            return True
        self._abandoned[ticket] = None
        while len(self._abandoned) > self._kept:
            oldest = next(iter(self._abandoned))
            if low is not None and oldest >= low:
                break  # letting it go would refuse a request still in flight: kept, past the limit
            del self._abandoned[oldest]
            self._floor = max(self._floor, oldest)
        return False

    def settle(self, ticket: int, low: int | None = None) -> None:
        """The ingress's call for ``ticket`` is over (its reply began, or it ended): nothing
        asks about its claim any more, and a claim that comes now is refused."""
        if ticket in self._claimed:
            self._claimed.discard(ticket)
        elif ticket > self._floor:
            self.abandon(ticket, low)

    def __len__(self) -> int:
        return len(self._claimed) + len(self._abandoned)


class Ledger:
    """The Ray actor around one ``Claims`` (its methods run one at a time: an actor's
    queue; nothing in them awaits)."""

    def __init__(self) -> None:
        self._claims = Claims()

    def claim(self, ticket: int) -> bool:
        return self._claims.claim(ticket)

    def abandon(self, ticket: int, low: int | None = None) -> bool:
        return self._claims.abandon(ticket, low)

    def settle(self, ticket: int, low: int | None = None) -> None:
        self._claims.settle(ticket, low)

    def size(self) -> int:
        return len(self._claims)
