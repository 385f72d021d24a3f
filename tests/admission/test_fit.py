"""Fit into per-device grants, on rpc-server devices: plan, load, generate, probe == live."""

from __future__ import annotations


import pytest
from conftest import RPC_SERVER, run_py

from pyllmrouter import ModelConfig, ModelSpec, NeverFits, Router
from pyllmrouter.devices import RpcInventory

SHARE_PROBE_CACHE = True
pytestmark = [pytest.mark.slow,  # rpc-servers and worker processes
              pytest.mark.skipif(not RPC_SERVER.exists(),
                                 reason="rpc-server not built: scripts/build_llama_tools.sh ggml-rpc-server")]




FIT_AND_LOAD = """
    import json
    from pyllmrouter.engine.backend import native
    from pyllmrouter import ModelSpec, probe
    from pyllmrouter.engine.fit import fit_here, FitError
    from pyllmrouter.engine.loader import load, request
    from pyllmrouter.memory import aggregate
    from pyllmrouter.engine.probe import live_breakdown
    native().add_rpc_servers({endpoints!r})
    spec = ModelSpec({path!r}, ("-lm", "none",), n_ctx=1024)
    full = probe(spec).per_device()
    out = []
    for share in {shares!r}:
        # a grant of the fixed costs (compute) plus a share of what the layers need
        grants = {{d: int(full[d] * share) for d in ("RPC0", "RPC1")}}
        grants["CPU"] = 1 << 40
        plan = fit_here(spec, grants)
        llm = load(plan.spec)
        live = {{d.device: (d.weights, d.kv, d.compute) for d in aggregate(live_breakdown(llm))}}
        est = {{d.device: (d.weights, d.kv, d.compute) for d in probe(plan.spec).devices}}
        text = request(llm, "/v1/completions", {{"prompt": "hello", "max_tokens": 4}})["choices"][0]["text"]
        llm.close()
        out.append({{"grants": grants, "per_device": plan.per_device, "layers": plan.layers,
                    "experts_on_host": plan.experts_on_host, "probes": plan.probes, "live": live, "est": est,
                    "ngl": plan.spec.n_gpu_layers}})
    try:
        fit_here(spec, {{"RPC0": 1, "RPC1": 1, "CPU": 1}})
        out.append("fitted the impossible")
    except FitError as e:
        out.append(str(e))
    print(json.dumps(out))
"""


@pytest.mark.parametrize("model", ["tiny-llama", "tiny-moe"])
def test_fit_into_grants_of_several_sizes_loads_and_matches_the_probe(rpc_servers, tiny, model):
    shares = [1.0, 0.8, 0.6]
    out = run_py(FIT_AND_LOAD.format(endpoints=rpc_servers[:2], path=str(tiny[model]), shares=shares))
    *plans, impossible = out
    for share, plan in zip(shares, plans):
        for d in ("RPC0", "RPC1"):
            assert plan["per_device"].get(d, 0) <= plan["grants"][d], (share, plan)
        for d, (w, kv, compute) in plan["live"].items():  # loaded exactly as probed
            ew, ekv, ecompute = plan["est"][d]
            assert (w, kv) == (ew, ekv) and compute <= ecompute, (d, plan)
    full, smallest = plans[0], plans[-1]
    assert full["probes"] == 1  # a spec that fits as given is probed once and left alone
    assert smallest["probes"] >= 2
    moved = (smallest["ngl"] is not None and smallest["ngl"] < 3) or smallest["experts_on_host"] > 0
    assert moved  # something went to host memory to fit
    assert "host memory" in impossible or "cannot fit" in impossible or "no fit" in impossible


def _rpc0_bytes(endpoint: str, specs: dict[str, ModelSpec]) -> dict[str, int]:
    """Each spec's probed bytes on RPC0 (probed where the rpc device is attached)."""
    return run_py(f"""
        import json
        from pyllmrouter.engine.backend import native
        from pyllmrouter import ModelSpec, probe
        native().add_rpc_servers({[endpoint]!r})
        specs = {{k: ModelSpec.from_dict(v) for k, v in {({k: v.to_dict() for k, v in specs.items()})!r}.items()}}
        print(json.dumps({{k: probe(s).per_device()["RPC0"] for k, s in specs.items()}}))
    """)


def test_router_fits_a_model_bigger_than_its_device(rpc_servers, tiny):
    m, nofit = ModelSpec(tiny["tiny-moe"], n_ctx=1024), ModelSpec(tiny["tiny-moe"], ("--fit", "off"), n_ctx=1024)
    full = _rpc0_bytes(rpc_servers[0], {"m": m})["m"]
    capacity = int(full * 0.75)
    inv = RpcInventory({rpc_servers[0]: capacity})
    models = [ModelConfig("m", m, devices=("RPC0",)), ModelConfig("nofit", nofit, devices=("RPC0",))]
    with Router(models, inventory=inv, margin=0) as r:
        assert r.complete("m", "hello", max_tokens=4)["choices"]
        st = r.status()["models"]["m"]
        assert st["requirement"]["RPC0"]["RPC0"] == full > capacity  # the spec as given
        assert st["fit"]["grant"]["RPC0"] == capacity  # nothing else held: the whole device
        assert 0 < st["fit"]["need"]["RPC0"] <= capacity
        assert st["live"]["RPC0"] <= capacity
        r.scheduler.check_invariant()
        with pytest.raises(NeverFits, match="RPC0"):  # fit = false: the model as given
            r.complete("nofit", "x")
    # no host memory to move anything to: a clear error, at once
    with Router([ModelConfig("m", m, devices=("RPC0",))], inventory=RpcInventory({rpc_servers[0]: capacity},
                                                                                 host=1 << 20), margin=0) as r:
        with pytest.raises(NeverFits, match="no fit"):
            r.complete("m", "x", timeout=60)


def test_grant_is_what_is_free_after_the_evictions_policy_allows(rpc_servers, tiny):
    """A persistent model keeps its bytes, an idle one gives them up: the fit gets
    the device minus the persistent model, and only the idle model is evicted."""
    small = ModelSpec(tiny["tiny-llama"], n_ctx=256)
    m = ModelSpec(tiny["tiny-moe"], n_ctx=1024)
    size = _rpc0_bytes(rpc_servers[0], {"small": small, "m": m})
    capacity = size["small"] + int(size["m"] * 0.75)
    assert 2 * size["small"] <= capacity
    models = [ModelConfig("keep", small, devices=("RPC0",), persistent=True),
              ModelConfig("idle", small, devices=("RPC0",)),
              ModelConfig("m", m, devices=("RPC0",))]
    with Router(models, inventory=RpcInventory({rpc_servers[0]: capacity}), margin=0) as r:
        r.load("keep")
        r.load("idle")
        assert r.complete("m", "hello", max_tokens=4)["choices"]
        st = r.status()["models"]
        assert st["keep"]["state"] == "loaded" and st["idle"]["state"] == "unloaded"
        assert st["m"]["fit"]["grant"]["RPC0"] == capacity - size["small"]
        assert st["m"]["fit"]["need"]["RPC0"] <= capacity - size["small"] < size["m"]
        assert ("evict", "idle") in {(what, name) for _t, what, name, _d in r.scheduler.events}
        r.scheduler.check_invariant()


def test_fit_moves_the_projector_and_the_draft_to_host_before_any_layer(rpc_servers, tiny, projector, draft):
    """A model with a projector and a draft, granted on its device all it needs but half of
    the projector: the projector goes to host memory and every layer stays; granted less
    than its draft too, the draft goes as well; each decision is in the plan."""
    out = run_py(f"""
        import json
        from pyllmrouter.engine.backend import native
        from pyllmrouter import ModelSpec, probe
        from pyllmrouter.engine.fit import fit_here
        native().add_rpc_servers({rpc_servers[:1]!r})
        spec = ModelSpec({str(tiny["tiny-llama"])!r}, ("-np", "1", "--mmproj", {str(projector)!r}, "-md", {str(draft)!r}), n_ctx=512)
        parts = probe(spec, use_cache=False).devices
        rpc0 = next(d for d in parts if d.device == "RPC0")
        plans = []
        for room in (rpc0.total - rpc0.projector // 2, rpc0.total - rpc0.projector - rpc0.draft // 2):
            plan = fit_here(spec, {{"RPC0": room, "CPU": 1 << 40}})
            on = {{d.device: (d.projector, d.draft) for d in probe(plan.spec).devices}}
            plans.append({{"to_host": list(plan.to_host), "ngl": plan.spec.n_gpu_layers, "on": on,
                           "rpc0": plan.per_device["RPC0"], "room": room}})
        print(json.dumps({{"projector": rpc0.projector, "draft": rpc0.draft, "plans": plans}}))
    """)
    assert out["projector"] > 0 and out["draft"] > 0  # both offloaded with the model as given
    first, second = out["plans"]
    assert first["to_host"] == ["projector"] and first["ngl"] is None  # every layer still on the device
    assert first["on"]["RPC0"][0] == 0 and first["on"]["CPU"][0] > 0 and first["on"]["RPC0"][1] > 0
    assert second["to_host"] == ["projector", "draft"] and second["ngl"] is None
    assert second["on"]["RPC0"] == [0, 0] and first["rpc0"] <= first["room"] and second["rpc0"] <= second["room"]
