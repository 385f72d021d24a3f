"""Ray Serve's request router for pyllmrouter replicas: ranks replicas by the model's
bytes against each node's free and evictable memory (ranking.rank), from the statistics
every replica records (``record_routing_stats``), a period old at worst.  A model routed
to a node in the last few seconds counts as loading there (ranking.assume_routed) until
the node's statistics show it, so requests in between are not placed on stale figures.

Serve calls ``choose_replicas`` for each request and sends it to the first rank that
has room; a rank is one replica, and replicas take requests without limit (their own
Router queues them), so the first is where it goes.

A replica whose statistics have not changed for the ``silent_after`` seconds they
state (failover.silent_after: two readings missed at their longest, 12 s with a
reading a second) has stopped answering them: each reading carries a count, ``seq``,
so a live one changes every period.  It is left out while any other replica answers.
The seconds are this router's own (monotonic), from when it first saw that reading: no
host's clock is compared with another's, so a node whose clock is behind is not taken
for silent.  A reading is seen as Serve brings it (``update_replicas``), whether or not
a request is routed meanwhile.  The ingress leaves out a node whose calls fail
at once (failover.py)."""

from __future__ import annotations

import time
from typing import Any, List, Optional

from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

from pyllmrouter.ray.messages import NodeRequest
from pyllmrouter.ray.ranking import assume_routed, rank

__all__ = ["MemoryAwareRouter"]

RECENT = 5.0  # seconds a routed load is assumed before the node's statistics show it


class MemoryAwareRouter(RequestRouter):
    def initialize_state(self, **kwargs: Any) -> None:
        self._routed: dict[str, list[tuple[float, str]]] = {}  # replica id -> (when, model), routing loop only
        self._heard: dict[str, tuple[Any, float]] = {}  # replica id -> (its last reading's ``seq``, when first seen)

    async def choose_replicas(self, candidate_replicas: List[RunningReplica],
                              pending_request: Optional[PendingRequest] = None) -> List[List[RunningReplica]]:
        request = _request_of(pending_request)
        if request is None:
            return [candidate_replicas]
        if request.node is not None:  # a question for one node: that node's replica
            mine = [r for r in candidate_replicas if r.node_id == request.node]
            # none (it is lost, or not placed yet): another answers 421, at once; a request
            # left unrouted would wait, and Serve hands the next replica chosen to the
            # oldest request waiting, whichever it asked for
            return [mine or candidate_replicas[:1]]
        live = [r for r in candidate_replicas if r.node_id not in request.exclude]
        answering = [r for r in live if not self._silent(r)]
        live = answering or live  # every one silent: they are all there is
        if request.model is None:
            return [live]
        ranks = rank(request.model, [(r, self._stats(r)) for r in live])
        if ranks:  # the first has room (no replica limits its queue): the request goes there
            top = ranks[0][0].replica_id.unique_id
            self._routed.setdefault(top, []).append((time.monotonic(), request.model))
        # no node could ever hold it: a replica answers with its 507 and the figures (every
        # node left out already: one of them again, so the ingress sees the refusal repeat)
        return ranks or [live or candidate_replicas]

    def update_replicas(self, replicas: List[RunningReplica]) -> None:
        """Serve's news of the replicas (their statistics with it): each new reading is
        heard now, whether or not a request is routed meanwhile."""
        super().update_replicas(replicas)
        current = {r.replica_id.unique_id for r in replicas}
        self._heard = {rid: h for rid, h in self._heard.items() if rid in current}  # gone replicas forgotten
        for r in replicas:
            self._hear(r)

    def _hear(self, replica: RunningReplica) -> tuple[Any, float]:
        """(``replica``'s reading's ``seq``, when this router first saw it)."""
        seq, rid = (replica.routing_stats or {}).get("seq"), replica.replica_id.unique_id
        last = self._heard.get(rid)
        if last is None or last[0] != seq:
            self._heard[rid] = last = (seq, time.monotonic())
        return last

    def _silent(self, replica: RunningReplica) -> bool:
        """Whether ``replica``'s statistics have not changed for the seconds they state."""
        seq, since = self._hear(replica)
        return seq is not None and time.monotonic() - since > (replica.routing_stats or {}).get(
            "silent_after", float("inf"))

    def _stats(self, replica: RunningReplica) -> dict:
        if not replica.routing_stats:
            return {}
        stats = {**replica.routing_stats, "node": replica.node_id}
        horizon = time.monotonic() - RECENT
        recent = [(t, m) for t, m in self._routed.get(replica.replica_id.unique_id, ()) if t > horizon]
        self._routed[replica.replica_id.unique_id] = recent
        for _, model in recent:
            if model in stats["models"]:
                stats = assume_routed(model, stats)
        return stats


def _request_of(pending_request: Optional[PendingRequest]) -> NodeRequest | None:
    request = pending_request.args[0] if pending_request is not None and pending_request.args else None
    return request if isinstance(request, NodeRequest) else None
