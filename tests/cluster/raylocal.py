"""A local Ray cluster with pyllmrouter deployed on it, as a user would deploy it (the
Ray tests' one way to start one)."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Iterator

import ray

from pyllmrouter.tools.loopback import free_port
from pyllmrouter.tools.raynodes import add_node


@contextlib.contextmanager
def deployed(directory: Path, tiny: dict, models: dict[str, tuple[str, int]], sizes_mib: list[int],
             queue_timeout: int, serve_args: tuple[str, ...] = ()) -> Iterator[tuple]:
    """A head and one node per size (one emulated device of that many MiB each, the probe
    cache shared), ``models`` (name: (tiny model, context), one slot each) deployed by
    ``pyllmrouter ray``: (cluster, port, nodes, start_node(mib) for a node started again).
    Each node's replica logs the requests it ran (those with an X-Request-Id) to
    ``directory/runs`` (replica.py).  ``serve_args``: more of serve's arguments."""
    from ray.cluster_utils import Cluster

    from pyllmrouter import cli

    preset = directory / "models.ini"
    preset.write_text("".join(f"[{name}]\nmodel = {tiny[kind]}\nctx-size = {ctx}\nparallel = 1\n\n"
                              for name, (kind, ctx) in models.items()))
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 2})

    (directory / "runs").mkdir(exist_ok=True)

    def start_node(mib: int):
        return add_node(c, mib, directory / "cache", run_log=directory / "runs")

    nodes = [start_node(mib) for mib in sizes_mib]
    ray.init(address=c.address)
    port = free_port()
    try:
        # serve's arguments plus the cluster's address
        assert cli.main(["ray", "--models-preset", str(preset), "--models-memory-margin", "0",
                         "--queue-timeout", str(queue_timeout), "--port", str(port), "--address", c.address, *serve_args]) == 0
        yield c, port, nodes, start_node, preset
    finally:
        from ray import serve

        serve.shutdown()
        ray.shutdown()
        c.shutdown()
