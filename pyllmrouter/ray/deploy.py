"""Deploy pyllmrouter on a Ray cluster: one NodeRouter replica per marked node, one ingress.

    ray start --head --resources='{"pyllmrouter": 1}'             # on the first host
    ray start --address=HEAD:6379 --resources='{"pyllmrouter": 1}'  # on every other host
    pyllmrouter ray --models-preset models.ini --port 8080          # once, anywhere

A marked node gets one replica (it asks for one unit of the ``pyllmrouter``
resource), which owns all of that node's devices; it asks Ray for no GPU, so Ray
masks nothing and the replica's workers mask themselves.  The ingress serves the
HTTP API on ``host:port`` itself, from the head node; Serve, where this starts it,
runs no HTTP proxy.
"""

from __future__ import annotations

from typing import Sequence

import ray
from ray import serve
from ray.serve.config import RequestRouterConfig
from ray.serve.schema import LoggingConfig

from pyllmrouter.ray import failover
from pyllmrouter.ray.ingress import NODE_RESOURCE, Ingress, node_ids
from pyllmrouter.ray.replica import NodeRouter
from pyllmrouter.server.run import parse_serve_args

__all__ = ["build", "deploy", "APP"]

APP = "pyllmrouter"
HEAD_RESOURCE = "node:__internal_head__"  # Ray's own resource of the head node


def build(serve_args: Sequence[str], *, host: str = "127.0.0.1", port: int = 8080, replicas: int | None = None,
          api_key: str | None = None, max_body: int = 8 << 20, stats_period: float = 1.0):
    """The Serve application: ``serve_args`` are ``pyllmrouter serve``'s arguments (models,
    margin, limits) for every node; the ingress listens on ``host:port``; ``replicas``
    defaults to the marked nodes alive now."""
    n = replicas if replicas is not None else len(node_ids())
    if n < 1:
        raise RuntimeError(f"no alive node offers the '{NODE_RESOURCE}' resource: start each host with "
                           f"ray start --resources='{{\"{NODE_RESOURCE}\": 1}}'")
    access_log = parse_serve_args(serve_args).access_log
    logs = LoggingConfig(enable_access_log=access_log)
    nodes = serve.deployment(
        NodeRouter, name="NodeRouter", num_replicas=n, max_ongoing_requests=1024, logging_config=logs,
        ray_actor_options={"num_cpus": 0, "num_gpus": 0, "resources": {NODE_RESOURCE: 1}},
        request_router_config=RequestRouterConfig(
            request_router_class="pyllmrouter.ray.request_router:MemoryAwareRouter",
            request_routing_stats_period_s=stats_period,
            request_routing_stats_timeout_s=failover.stats_timeout(stats_period)),
    )
    # the ingress lives on the head node: a worker node taken away then ends only the
    # requests it served (an error event), not every client's connection
    ingress = serve.deployment(Ingress, name="Ingress", num_replicas=1, logging_config=logs,
                               ray_actor_options={"num_cpus": 0, "resources": {HEAD_RESOURCE: 0.001},
                                                  "runtime_env": {"env_vars": {
                                                      "RAY_SERVE_QUEUE_LENGTH_RESPONSE_DEADLINE_S": "1.0"}}})
    return ingress.bind(nodes.bind(list(serve_args), stats_period), host, port, api_key, max_body, access_log)


def deploy(serve_args: Sequence[str], *, address: str | None = "auto", host: str = "127.0.0.1", port: int = 8080,
           **kw) -> None:
    """Connect to the cluster at ``address`` and run the application (returns once it serves)."""
    if not ray.is_initialized():
        ray.init(address=address)
    serve.start(proxy_location="Disabled")
    try:
        serve.run(build(serve_args, host=host, port=port, **kw), name=APP, route_prefix=None)
    except RuntimeError as e:  # Serve names the deployment; its replica's error says why
        raise RuntimeError(f"{e} {_why(APP)}".strip()) from None


def _why(app: str) -> str:
    """The last line of each failed deployment's message: its replica's exception."""
    status = serve.status().applications.get(app)
    lines = [d.message.strip().splitlines()[-1] for d in (status.deployments.values() if status else ())
             if d.message.strip()]
    return "; ".join(lines)
