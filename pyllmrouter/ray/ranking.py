"""Where a request should go in a cluster: pure functions over the replicas' statistics.

    Router.status() ──node_stats──▶ {devices, models, queue}   (each replica, every period)
    stats of every replica (+ assume_routed: loads routed since) ──rank(model, stats)──▶
        [[r1], [r2], ...]: loaded (shortest queue first), then fits in free memory (least
        room left first), then fits once idle models go (fewest bytes first), then could
        ever fit
                                                    empty: it fits on no node
        replicas = N (a model's preset key): while it is loaded on fewer than N nodes and
        its requests wait on every one of them (more in flight than its slots there), a
        node where it fits in free memory comes first: one more instance loads there,
        as a node's own router loads one more on another device set (router/policy/replicas.py)

The arithmetic is the single-node router's own (router/policy/placement.py): the same
shortfall, the same least-recently-used victims, the same "never fits".  Statistics
are a period old at worst, so a replica's own admission still decides; a node that
refuses (507) is left out of the next attempt (the request router's ``exclude``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from pyllmrouter.router.policy import placement

__all__ = ["node_stats", "Choice", "classify", "assume_routed", "rank", "waits", "wants_another_node", "re_place"]

LOADED, FREE, EVICT, EVER = "loaded", "free", "evict", "ever"


def node_stats(node: str, status: Mapping[str, Any], max_models: int = 0) -> dict[str, Any]:
    """What a replica reports (plain values): its node, per device the most its models may
    hold and what they may still take, and per model its state, requests in flight, the
    bytes it holds, its probed requirement per device set and when it was last used."""
    devices = {n: {"capacity": d["capacity"], "available": d["available"] or 0, "held": d["held"]}
               for n, d in status["devices"].items()}
    models = {n: {"state": m["state"], "leases": m["leases"], "held": m["held"], "last_used": m["last_used"],
                  "persistent": m["persistent"], "requirement": m["requirement"],
                  "replicas": m.get("replicas", 1), "slots": (m.get("context") or {}).get("slots") or 1,
                  "replica_of": m.get("replica_of")}
              for n, m in status["models"].items()}
    return {"node": node, "devices": devices, "models": models, "queue": status["queue"],
            "max_models": max_models}


@dataclass(frozen=True)
class Choice:
    """How a model would be served on one node: the class, and the figure that orders
    nodes of the same class (queue length, headroom or bytes evicted)."""

    kind: str  # loaded | free | evict | ever | never
    order: int
    why: str = ""
    plan: placement.Plan | None = None  # free or evict: where, and the victims


def classify(model: str, stats: Mapping[str, Any]) -> Choice:
    """How ``model`` would be served on one node: loaded (any of its instances there: its
    own, or an extra one while its own is evicted), else by what its admission would do."""
    m = stats["models"].get(model)
    if m is None:
        return Choice("never", 0, f"node {stats['node']} does not serve {model}")
    instances = [i for n, i in stats["models"].items() if n == model or i.get("replica_of") == model]
    if any(i["state"] in ("loaded", "loading") for i in instances):
        return Choice(LOADED, sum(i["leases"] for i in instances) + stats["queue"])
    if not m["requirement"]:
        return Choice(EVER, 0, "not measured yet")  # its replica measures every model at start
    capacity = {d: v["capacity"] for d, v in stats["devices"].items()}
    available = {d: v["available"] for d, v in stats["devices"].items()}
    residents = [placement.Resident(n, r["held"], r["last_used"],
                                    r["state"] == "loaded" and r["leases"] == 0 and not r["persistent"])
                 for n, r in stats["models"].items() if r["held"]]
    candidates = [(frozenset(key.split("+")), need) for key, need in m["requirement"].items()]
    if stats.get("max_models"):
        capacity[placement.COUNT] = stats["max_models"]
        available[placement.COUNT] = stats["max_models"] - len(residents)
        residents = [placement.Resident(r.name, {**r.need, placement.COUNT: 1}, r.last_used, r.evictable)
                     for r in residents]
        candidates = [(ds, {**need, placement.COUNT: 1}) for ds, need in candidates]
    ever = [(ds, need) for ds, need in candidates if placement.never_fits(need, capacity) is None]
    if not ever:
        worst = placement.never_fits(candidates[0][1], capacity)
        return Choice("never", 0, str(worst))
    plan = placement.choose(ever, available, residents)
    if plan is None:
        return Choice(EVER, 0, "busy models hold the memory")
    if not plan.victims:  # best fit: the node left with the least room, so big holes stay for big models
        return Choice(FREE, min(available.get(d, 0) - n for d, n in plan.need.items() if d != placement.COUNT),
                      plan=plan)
    freed = sum(sum(n for d, n in r.need.items() if d != placement.COUNT)
                for r in residents if r.name in plan.victims)
    return Choice(EVICT, freed, plan=plan)


def assume_routed(model: str, stats: Mapping[str, Any]) -> Mapping[str, Any]:
    """``stats`` as they will read once the node has taken ``model`` (its admission does
    what ``classify`` foresees: the victims go, the model's bytes are taken), for the
    requests routed before the node's next statistics say so."""
    plan = classify(model, stats).plan
    if plan is None:
        return stats
    models = dict(stats["models"])
    devices = {d: dict(v) for d, v in stats["devices"].items()}
    for victim in plan.victims:
        for d, n in models[victim]["held"].items():
            devices[d]["available"] += n
        models[victim] = {**models[victim], "state": "unloaded", "held": {}}
    need = {d: n for d, n in plan.need.items() if d in devices}
    for d, n in need.items():
        devices[d]["available"] -= n
    models[model] = {**models[model], "state": "loading", "held": need}
    return {**stats, "models": models, "devices": devices}


def waits(model: str, stats: Mapping[str, Any]) -> bool:
    """Whether ``model``'s requests wait on this node: more in flight than the slots of its
    loaded instances there (its own and its extra ones)."""
    mine = [m for n, m in stats["models"].items() if n == model or m.get("replica_of") == model]
    loaded = [m for m in mine if m["state"] == "loaded"]
    return bool(loaded) and sum(m["leases"] for m in mine) > sum(m.get("slots", 1) for m in loaded)


def wants_another_node(model: str, replicas: Sequence[tuple[Any, Mapping[str, Any]]]) -> bool:
    """replicas = N: the model is loaded (or loading) on fewer than N nodes, on one at least,
    and its requests wait on every node where it is loaded."""
    where = [stats for _, stats in replicas
             if stats and stats["models"].get(model, {}).get("state") in ("loaded", "loading")]
    limit = max((stats["models"][model].get("replicas", 1) for stats in where), default=1)
    return 0 < len(where) < limit and all(waits(model, stats) for stats in where)


def rank(model: str, replicas: Sequence[tuple[Any, Mapping[str, Any]]]) -> list[list[Any]]:
    """``replicas``: (replica, its stats) pairs.  The replicas that could serve ``model``,
    best first, one per rank (so the first is where the request goes while it has room);
    replicas without stats yet rank with "could ever fit".  Empty: no node can ever hold it.
    A model that wants another node (``wants_another_node``) goes where it fits in free
    memory first."""
    order = {LOADED: 0, FREE: 1, EVICT: 2, EVER: 3}
    if wants_another_node(model, replicas):
        order = {FREE: 0, LOADED: 1, EVICT: 2, EVER: 3}
    scored: list[tuple[int, int, int]] = []
    for i, (replica, stats) in enumerate(replicas):
        choice = classify(model, stats) if stats else Choice(EVER, 0)
        if choice.kind in order:
            scored.append((order[choice.kind], choice.order, i))
    return [[replicas[i][0]] for _, _, i in sorted(scored)]


def re_place(views: Mapping[str, Mapping[str, Any]], evicted: Sequence[str]) -> list[tuple[str, str]]:
    """Loads that put models evicted lately back where they fit in free memory: (model,
    node) pairs, at most one a node.  ``views``: each node's GET /models (its ``data`` and
    ``devices``); ``evicted``: models a node evicted since the last round, most recent
    first.  A model loaded (or loading) on some node already is left alone; a node is
    chosen only where the model's probed bytes fit what its devices have available now
    (nothing evicted for it), the tightest fit first: a node that joins takes back what
    the others had to push out for each other, and two models that kept evicting each
    other for the same bytes end on different nodes."""
    available = {node: {d: (v.get("available") or 0) for d, v in (view.get("devices") or {}).items()}
                 for node, view in views.items()}
    entries = {node: {e["id"]: e for e in view.get("data") or ()} for node, view in views.items()}
    out: list[tuple[str, str]] = []
    taken: set[str] = set()
    for model in dict.fromkeys(evicted):
        if any((e.get(model) or {}).get("status", {}).get("value") in ("loaded", "loading")
               for e in entries.values()):
            continue
        best: tuple[int, str] | None = None
        for node, models in entries.items():
            entry = models.get(model)
            if node in taken or entry is None or entry.get("status", {}).get("failed"):
                continue
            for key, need in ((entry.get("memory") or {}).get("requirement") or {}).items():
                room = [available[node].get(d, 0) - n for d, n in need.items()]
                if need and set(need) <= set(available[node]) and min(room) >= 0 and \
                        (best is None or min(room) < best[0]):
                    best = (min(room), node)
        if best is not None:
            out.append((model, best[1]))
            taken.add(best[1])
    return out
