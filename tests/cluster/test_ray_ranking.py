"""The cluster's placement policy (pyllmrouter.ray.ranking): pure ranking of nodes by a
model's bytes against each node's statistics.  No Ray needed."""

from __future__ import annotations

from pyllmrouter.ray.cluster import merge_models, no_node_fits
from pyllmrouter.ray.ranking import assume_routed, classify, node_stats, rank, waits

MiB = 1 << 20


def stats(node: str, capacity: int, models: dict, *, queue: int = 0, max_models: int = 0) -> dict:
    """A node with one device GPU0 of ``capacity`` MiB; ``models``: name -> (state, leases,
    MiB held, MiB needed, last used)."""
    held = sum(m[2] for m in models.values()) * MiB
    return {
        "node": node, "queue": queue, "max_models": max_models,
        "devices": {"GPU0": {"capacity": capacity * MiB, "available": capacity * MiB - held, "held": held}},
        "models": {n: {"state": s, "leases": leases, "held": {"GPU0": h * MiB} if h else {}, "last_used": t,
                       "persistent": False, "requirement": {"GPU0": {"GPU0": need * MiB}} if need else {}}
                   for n, (s, leases, h, need, t) in models.items()},
    }


def test_a_loaded_model_goes_where_it_is_loaded():
    a = stats("a", 100, {"m": ("loaded", 3, 10, 10, 1.0)})
    b = stats("b", 100, {"m": ("unloaded", 0, 0, 10, 0.0)})
    assert classify("m", a).kind == "loaded" and classify("m", b).kind == "free"
    assert rank("m", [("A", a), ("B", b)]) == [["A"], ["B"]]


def test_free_memory_before_eviction_and_the_tightest_fit_first():
    small = stats("small", 30, {"m": ("unloaded", 0, 0, 20, 0.0)})
    big = stats("big", 100, {"m": ("unloaded", 0, 0, 20, 0.0)})
    full = stats("full", 30, {"m": ("unloaded", 0, 0, 20, 0.0), "x": ("loaded", 0, 25, 25, 1.0)})
    assert [classify("m", s).kind for s in (small, big, full)] == ["free", "free", "evict"]
    # the tightest fit first: the big node keeps its room for a model only it can hold
    assert rank("m", [("FULL", full), ("BIG", big), ("SMALL", small)]) == [["SMALL"], ["BIG"], ["FULL"]]


def test_fewest_bytes_evicted_first_and_busy_models_are_never_counted_as_evictable():
    a = stats("a", 40, {"m": ("unloaded", 0, 0, 30, 0.0), "x": ("loaded", 0, 30, 30, 1.0)})
    b = stats("b", 40, {"m": ("unloaded", 0, 0, 30, 0.0), "y": ("loaded", 0, 15, 15, 1.0)})
    busy = stats("busy", 40, {"m": ("unloaded", 0, 0, 30, 0.0), "z": ("loaded", 2, 15, 15, 1.0)})
    assert classify("m", a).order == 30 * MiB and classify("m", b).order == 15 * MiB
    assert classify("m", busy).kind == "ever"  # it fits once z's requests end; z is not evicted now
    assert rank("m", [("A", a), ("BUSY", busy), ("B", b)]) == [["B"], ["A"], ["BUSY"]]


def test_least_recently_used_victims_as_the_node_itself_would_pick_them():
    node = stats("n", 50, {"m": ("unloaded", 0, 0, 30, 0.0), "old": ("loaded", 0, 20, 20, 1.0),
                           "new": ("loaded", 0, 25, 25, 5.0)})
    # 5 MiB free: evicting the least recently used (20 MiB) is not enough, then the next
    assert classify("m", node).order == 45 * MiB


def test_a_model_that_fits_no_node_ranks_nowhere_and_says_why():
    a = stats("a", 10, {"m": ("unloaded", 0, 0, 20, 0.0)})
    assert classify("m", a).kind == "never" and "GPU0" in classify("m", a).why
    assert rank("m", [("A", a)]) == []
    unknown = stats("b", 10, {})
    assert classify("m", unknown).kind == "never"  # that node does not serve it


def test_replicas_without_statistics_or_measurements_yet_rank_last():
    a = stats("a", 100, {"m": ("unloaded", 0, 0, 0, 0.0)})  # not measured yet
    b = stats("b", 100, {"m": ("unloaded", 0, 0, 10, 0.0)})
    assert rank("m", [("A", a), ("NEW", {}), ("B", b)]) == [["B"], ["A"], ["NEW"]]


def test_the_model_count_limit_is_one_more_device():
    full = stats("a", 100, {"m": ("unloaded", 0, 0, 10, 0.0), "x": ("loaded", 0, 10, 10, 1.0)}, max_models=1)
    assert classify("m", full).kind == "evict"


def test_node_stats_carries_what_the_policy_reads():
    status = {"queue": 2, "devices": {"GPU0": {"capacity": 100, "available": 40, "held": 60, "kind": "emulated",
                                               "total": 100, "free": 100}},
              "models": {"m": {"state": "loaded", "leases": 1, "held": {"GPU0": 60}, "last_used": 3.0,
                               "persistent": False, "requirement": {"GPU0": {"GPU0": 60}}, "aliases": []}}}
    s = node_stats("n1", status)
    assert s["node"] == "n1" and s["queue"] == 2 and s["devices"]["GPU0"]["available"] == 40
    assert classify("m", s).kind == "loaded"


def test_the_cluster_view_keeps_llama_servers_format_and_adds_the_nodes():
    entry = lambda name, state: {"id": name, "object": "model", "owned_by": "pyllmrouter", "aliases": [],
                                 "path": f"{name}.gguf", "status": {"value": state}}
    view = merge_models({"n1": {"data": [entry("m", "unloaded"), entry("k", "unloaded")], "devices": {"GPU0": {}}},
                         "n2": {"data": [entry("m", "loaded")], "devices": {}}})
    m = next(x for x in view["data"] if x["id"] == "m")
    assert m["status"] == {"value": "loaded"} and m["loaded_on"] == ["n2"] and set(m["nodes"]) == {"n1", "n2"}
    assert set(view["nodes"]) == {"n1", "n2"}
    err = no_node_fits("m", {"n1": {"error": {"needed_bytes": 5}}, "n2": {"error": {"needed_bytes": 6}}})
    assert err["error"]["nodes"]["n2"]["needed_bytes"] == 6 and err["error"]["code"] == "model_too_large"


def test_a_routed_load_counts_until_the_nodes_statistics_show_it():
    node = stats("n", 30, {"m": ("unloaded", 0, 0, 20, 0.0), "k": ("unloaded", 0, 0, 20, 0.0),
                           "old": ("loaded", 0, 5, 5, 1.0)})
    assert classify("k", node).kind == "free"
    after = assume_routed("m", node)
    assert after["models"]["m"]["state"] == "loading" and after["devices"]["GPU0"]["available"] == 5 * MiB
    assert classify("m", after).kind == "loaded"
    assert classify("k", after).kind == "ever"  # m is loading (busy): k would wait on this node
    evicting = assume_routed("k", stats("n", 30, {"k": ("unloaded", 0, 0, 20, 0.0), "x": ("loaded", 0, 25, 25, 1.0)}))
    assert evicting["models"]["x"]["state"] == "unloaded" and evicting["devices"]["GPU0"]["available"] == 10 * MiB
    assert assume_routed("m", after) == after  # already counted


def with_replicas(node: dict, model: str, replicas: int, slots: int = 1) -> dict:
    models = {**node["models"], model: {**node["models"][model], "replicas": replicas, "slots": slots}}
    return {**node, "models": models}


def test_a_model_with_replicas_whose_requests_wait_goes_to_a_node_with_room():
    """replicas = 2: while its requests wait on the one node that has it (3 in flight, 1
    slot), a node where it fits in free memory comes first; once it is on two nodes, or
    its requests do not wait, or it may have one instance only, where it is loaded first."""
    hot = lambda leases, replicas: with_replicas(  # noqa: E731
        stats("a", 100, {"m": ("loaded", leases, 10, 10, 1.0)}), "m", replicas)
    spare = with_replicas(stats("b", 100, {"m": ("unloaded", 0, 0, 10, 0.0)}), "m", 2)
    assert rank("m", [("A", hot(3, 2)), ("B", spare)]) == [["B"], ["A"]]
    assert rank("m", [("A", hot(1, 2)), ("B", spare)]) == [["A"], ["B"]]  # its one slot: no wait
    assert rank("m", [("A", hot(3, 1)), ("B", spare)]) == [["A"], ["B"]]  # one instance at most
    both = with_replicas(stats("b", 100, {"m": ("loading", 0, 10, 10, 2.0)}), "m", 2)
    assert rank("m", [("A", hot(3, 2)), ("B", both)]) == [["B"], ["A"]]  # loaded: fewest in flight
    full = with_replicas(stats("b", 15, {"m": ("unloaded", 0, 0, 10, 0.0), "x": ("loaded", 0, 10, 10, 1.0)}), "m", 2)
    assert rank("m", [("A", hot(3, 2)), ("B", full)]) == [["A"], ["B"]]  # no free room: nothing evicted for it


def test_a_node_s_own_extra_instances_count_toward_its_slots():
    node = stats("a", 100, {"m": ("loaded", 2, 10, 10, 1.0), "m#2": ("loaded", 0, 10, 10, 1.0)})
    node["models"]["m#2"]["replica_of"] = "m"
    assert not waits("m", node)  # two in flight, two instances of one slot each
    node["models"]["m"]["leases"] = 3
    assert waits("m", node)


def test_node_stats_carry_what_replicas_need():
    status = {"devices": {"GPU0": {"capacity": 1, "available": 1, "held": 0}}, "queue": 0,
              "models": {"m": {"state": "loaded", "leases": 0, "held": {}, "last_used": 0.0, "persistent": False,
                               "requirement": {}, "replicas": 3, "context": {"slots": 4}, "replica_of": None}}}
    m = node_stats("n", status)["models"]["m"]
    assert (m["replicas"], m["slots"], m["replica_of"]) == (3, 4, None)


def view(available_mib: int, models: dict) -> dict:
    """A node's GET /models: one device GPU0 with ``available_mib`` free; ``models``: name ->
    (state, MiB needed)."""
    return {"devices": {"GPU0": {"available": available_mib * MiB}},
            "data": [{"id": n, "status": {"value": s}, "memory": {"requirement": {"GPU0": {"GPU0": need * MiB}}}}
                     for n, (s, need) in models.items()]}


def test_a_model_evicted_lately_goes_back_where_it_fits_free_the_tightest_fit_first():
    from pyllmrouter.ray.ranking import re_place

    crowded = view(5, {"x": ("unloaded", 50), "y": ("loaded", 50), "z": ("unloaded", 10)})
    joined = view(60, {"x": ("unloaded", 50), "y": ("unloaded", 50), "z": ("unloaded", 10)})
    roomy = view(200, {"x": ("unloaded", 50), "y": ("unloaded", 50), "z": ("unloaded", 10)})
    # x was pushed out for y: it fits free on the node that joined (the tightest) and the roomy one
    assert re_place({"A": crowded, "B": joined, "C": roomy}, ["x"]) == [("x", "B")]
    # one load a node per round; a model loaded somewhere is left alone; one that fits nowhere free stays out
    assert re_place({"A": crowded, "B": joined, "C": roomy}, ["x", "z", "y"]) == [("x", "B"), ("z", "C")]
    assert re_place({"A": crowded, "B": view(40, {"x": ("unloaded", 50)})}, ["x"]) == []
