"""A local Ray cluster's nodes (``ray.cluster_utils.Cluster``), for the tests and
``bench/ray_bench.py``: a node marked for a pyllmrouter replica, with one emulated device,
started; and a node taken away as a machine that dies would go: its raylet and every
process under it (the replica, its workers) killed at once with SIGKILL, nothing told
first."""

from __future__ import annotations

import os
import signal
from typing import Any

__all__ = ["add_node", "kill_node", "stop_node", "process_tree"]


def add_node(cluster: Any, mib: int, cache: os.PathLike | str, run_log: os.PathLike | str | None = None) -> Any:
    """A node started in ``cluster`` (as ``ray start`` would): one CPU, the resource that
    marks it for a replica, one emulated device of ``mib`` MiB, the probe cache ``cache``;
    ``run_log``: the directory its replica logs the requests it ran to (replica.py)."""
    env = {"PYLLMROUTER_EMULATE_DEVICES": f"GPU0={mib}MiB", "PYLLMROUTER_CACHE": str(cache)}
    if run_log is not None:
        env["PYLLMROUTER_RUN_LOG"] = str(run_log)
    return cluster.add_node(num_cpus=1, resources={"pyllmrouter": 1}, env_vars=env)


def process_tree(pid: int) -> list[int]:
    """``pid`` and every live process under it (Linux: read from /proc)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                parent = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue  # gone meanwhile
        children.setdefault(parent, []).append(int(entry))
    tree, todo = [], [pid]
    while todo:
        p = todo.pop()
        tree.append(p)
        todo.extend(children.get(p, ()))
    return tree


def kill_node(node: Any, sig: int = signal.SIGKILL) -> int:
    """SIGKILL ``node``'s raylet (a ``Cluster.add_node`` result) and every process under
    it, all at once (``sig``: another signal); the number of processes signalled."""
    pids = [p for info in node.all_processes["raylet"] for p in process_tree(info.process.pid)]
    killed = 0
    for pid in pids:
        try:
            os.kill(pid, sig)
            killed += 1
        except ProcessLookupError:
            pass
    return killed


def stop_node(node: Any) -> int:
    """A node that goes silent, as a hung machine or a cut link does: its raylet and every
    process under it SIGSTOPped (no connection is reset: calls to it simply get no answer)."""
    return kill_node(node, signal.SIGSTOP)
