"""Ray Serve's request router for pyllmrouter replicas: ranks replicas by the model's
bytes against each node's free and evictable memory (policy.rank), from the statistics
every replica records (``record_routing_stats``), a period old at worst.

Serve calls ``choose_replicas`` for each request and, within the first rank that has
room, picks the replica with the shortest queue."""

from __future__ import annotations

from typing import List, Optional

from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

from pyllmrouter.ray.messages import NodeRequest
from pyllmrouter.ray.policy import rank

__all__ = ["MemoryAwareRouter"]


class MemoryAwareRouter(RequestRouter):
    async def choose_replicas(self, candidate_replicas: List[RunningReplica],
                              pending_request: Optional[PendingRequest] = None) -> List[List[RunningReplica]]:
        request = pending_request.args[0] if pending_request is not None and pending_request.args else None
        if not isinstance(request, NodeRequest):
            return [candidate_replicas]
        if request.node is not None:  # a question for one node: that node's replica, or none yet
            return [[r for r in candidate_replicas if r.node_id == request.node]]
        live = [r for r in candidate_replicas if r.node_id not in request.exclude]
        if request.model is None:
            return [live]
        ranks = rank(request.model, [(r, {**r.routing_stats, "node": r.node_id} if r.routing_stats else {})
                                     for r in live])
        # no node could ever hold it: any replica answers with its 507 and the figures
        return ranks or [live]
