"""The whole cluster's view, merged from every node's own (pure functions).

``/models`` keeps llama-server's router format (``data``: one entry per model id with
its ``status``) and adds, per model, each node's entry under ``nodes``; a model is
``loaded`` if some node has it loaded; a node held out after a failure (``held`` in its
answer) is listed, marked, with its models.  ``/devices`` lists each node's devices."""

from __future__ import annotations

from typing import Any, Mapping

__all__ = ["merge_models", "merge_devices", "openai_models", "no_node_fits"]

_BEST = ("loaded", "loading", "unloading", "unloaded")


def merge_models(per_node: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    """{node: that node's GET /models} -> the cluster's GET /models."""
    models: dict[str, dict[str, Any]] = {}
    for node, reply in sorted(per_node.items()):
        for entry in reply.get("data", []):
            merged = models.setdefault(entry["id"], {k: v for k, v in entry.items()
                                                     if k in ("id", "object", "owned_by", "aliases", "path")})
            merged.setdefault("nodes", {})[node] = entry
    for merged in models.values():
        states = [e["status"]["value"] for e in merged["nodes"].values()]
        merged["status"] = {"value": min(states, key=_BEST.index) if states else "unloaded"}
        merged["loaded_on"] = sorted(n for n, e in merged["nodes"].items() if e["status"]["value"] == "loaded")
    return {"object": "list", "data": list(models.values()),
            "nodes": {node: {"devices": reply.get("devices", {}), "held": bool(reply.get("held")),
                             **({"error": reply["error"]} if "error" in reply else {})}
                      for node, reply in sorted(per_node.items())}}


def openai_models(cluster: Mapping[str, Any]) -> dict[str, Any]:
    """The cluster's GET /models -> OpenAI's GET /v1/models."""
    return {"object": "list", "data": [{"id": m["id"], "object": "model", "created": 0, "owned_by": "pyllmrouter",
                                        "status": m["status"]} for m in cluster["data"]]}


def merge_devices(per_node: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    """{node: that node's GET /devices} -> the cluster's GET /devices."""
    return {"nodes": {node: dict(reply) for node, reply in sorted(per_node.items())}}


def no_node_fits(model: str, refusals: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    """Every node refused ``model`` (507): one error with each node's figures."""
    return {"error": {"message": f"model '{model}' fits on no node of the cluster",
                      "type": "insufficient_memory", "param": None, "code": "model_too_large",
                      "nodes": {node: body.get("error", body) for node, body in sorted(refusals.items())}}}
