"""pyllmrouter on a Ray cluster (``pip install pyllmrouter[ray]``).

    client ──HTTP──▶ Ingress ──▶ MemoryAwareRouter (Serve's request router: each
                                 replica's statistics, ranked by ranking.rank)
                                   ──▶ NodeRouter on node A: Router + the serve app
                                   ──▶ NodeRouter on node B ...

Modules: ``policy`` (pure ranking over statistics), ``messages``, ``replica``
(NodeRouter), ``request_router`` (MemoryAwareRouter), ``ingress``, ``cluster``
(merged views, pure), ``deploy``.  Tested with ray 2.60.0 (the request-router API is
alpha).
"""
