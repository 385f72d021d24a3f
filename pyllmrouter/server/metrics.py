"""Prometheus metrics: request latency and queue waits observed live; loads,
evictions and per-device bytes read from the router's status at scrape time;
each batched model's decode counters (llama-server's, per model) asked of the
workers at scrape time."""

from __future__ import annotations

from typing import Any, Callable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

__all__ = ["Metrics"]



class _StatusCollector:
    def __init__(self, status: Callable[[], dict[str, Any]]):
        self.status = status

    def collect(self):
        st = self.status()
        for name, value in st["counters"].items():
            c = CounterMetricFamily(f"pyllmrouter_{name}", f"Total {name.replace('_', ' ')}")
            c.add_metric([], value)
            yield c
        for field, help_ in (("held", "Bytes held by our models and workers"),
                             ("capacity", "Bytes our models may use (budget minus margin)"),
                             ("free", "Free bytes reported by the device"),
                             ("available", "Bytes available to the next model")):
            g = GaugeMetricFamily(f"pyllmrouter_device_{field}_bytes", help_, labels=["device"])
            for dev, d in st["devices"].items():
                if d.get(field) is not None:
                    g.add_metric([dev], d[field])
            yield g
        g = GaugeMetricFamily("pyllmrouter_model_loaded", "1 if the model is loaded", labels=["model"])
        q = GaugeMetricFamily("pyllmrouter_model_requests_in_flight", "Requests in flight", labels=["model"])
        for name, m in st["models"].items():
            g.add_metric([name], 1 if m["state"] == "loaded" else 0)
            q.add_metric([name], m["leases"])
        yield g
        yield q
        w = GaugeMetricFamily("pyllmrouter_queue_waiting", "Requests waiting for admission")
        w.add_metric([], st["queue"])
        yield w
        k = GaugeMetricFamily("pyllmrouter_model_kept_bytes", "Bytes of prompt states kept across eviction",
                              labels=["model", "place"])
        for name, m in st["models"].items():
            for place in ("ram", "disk"):
                k.add_metric([name, place], m["kept"][place])
        yield k
        for name, value in st["kept"].get("counters", {}).items():
            c = CounterMetricFamily(f"pyllmrouter_kv_keep_{name}", f"Kept prompt states: {name.replace('_', ' ')}")
            c.add_metric([], value)
            yield c


class Metrics:
    """``routes``: the endpoints labelled by name (anything else is "other", a /slots/N
    is "/slots/{id_slot}"); ``canonical(model)``: the listed model a name or alias is
    (None: "unknown"), so a label set grows only with the router's own list, never
    with what clients send."""

    def __init__(self, status: Callable[[], dict[str, Any]], routes: frozenset[str] = frozenset(),
                 canonical: Callable[[str], str | None] = lambda name: None):
        self._routes, self._canonical = routes, canonical
        self.registry = CollectorRegistry()
        self.registry.register(_StatusCollector(status))
        self.latency = Histogram("pyllmrouter_request_seconds", "Request latency (to the last byte)",
                                 ["model", "endpoint", "status"], registry=self.registry)
        self.queue_wait = Histogram("pyllmrouter_queue_wait_seconds", "Time a request waited for its model",
                                    ["model"], registry=self.registry)
        written = Counter("pyllmrouter_responses", "Model responses by who wrote them: the worker, on the "
                          "client's connection (native), or this process (relayed)", ["path"], registry=self.registry)
        self.native, self.relayed = written.labels("native"), written.labels("relayed")
        self.followed = Counter("pyllmrouter_followed_requests", "Model requests a worker read itself on a "
                                "connection it held, like the one before (--follow-ms)", registry=self.registry)

    def observe(self, model: str, endpoint: str, status: str, seconds: float) -> None:
        """A request's latency, labelled by its listed model and route."""
        route = endpoint if endpoint in self._routes else (
            "/slots/{id_slot}" if endpoint.startswith("/slots/") else "other")
        self.latency.labels(self._canonical(model) or "unknown", route, status).observe(seconds)

    def render(self) -> bytes:
        """The registry in Prometheus' text format (a model's own decode counters are
        llama-server's, at ``/metrics?model=``)."""
        return generate_latest(self.registry)
