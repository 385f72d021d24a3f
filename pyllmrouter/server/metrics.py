"""Prometheus metrics: request latency and queue waits observed live; loads,
evictions and per-device bytes read from the router's status at scrape time;
each batched model's decode counters (llama-server's, per model) asked of the
workers at scrape time."""

from __future__ import annotations

from typing import Any, Callable

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

__all__ = ["Metrics", "ENGINE_COUNTERS"]

# EngineStats field -> (metric name after pyllmrouter_model_, help)
ENGINE_COUNTERS = {
    "n_decode": ("decode_calls_total", "llama_decode calls of the model's batch loop"),
    "busy_slots": ("decode_busy_slots_total",
                   "Slots busy at each llama_decode call, summed (over decode calls: busy slots per decode)"),
    "prompt_tokens": ("prompt_tokens_total", "Prompt tokens processed, excluding cached tokens"),
    "prompt_tokens_cached": ("prompt_tokens_cached_total", "Prompt tokens reused from a slot's cache"),
    "tokens_predicted": ("tokens_predicted_total", "Tokens generated"),
    "decode_seconds": ("decode_seconds_total", "Seconds inside llama_decode"),
    "step_seconds": ("step_seconds_total",
                     "Seconds of whole batch steps: llama_decode, sampling, text, sending the chunks"),
    "send_seconds": ("send_seconds_total", "Seconds of the steps spent sending their chunks to the router"),
    "requests": ("requests_batched_total", "Requests finished on the batch"),
    "serial_requests": ("requests_serial_total", "Requests served alone by llama_cpp's own methods"),
}


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


class _EngineCollector:
    """Counters of each batched model since it was loaded (set before each scrape)."""

    def __init__(self):
        self.stats: dict[str, dict[str, float]] = {}

    def collect(self):
        for field, (name, help_) in ENGINE_COUNTERS.items():
            c = CounterMetricFamily(f"pyllmrouter_model_{name}", help_ + " (since the model was loaded)",
                                    labels=["model"])
            for model, st in sorted(self.stats.items()):
                c.add_metric([model], st.get(field, 0))
            yield c


class Metrics:
    def __init__(self, status: Callable[[], dict[str, Any]]):
        self.registry = CollectorRegistry()
        self.registry.register(_StatusCollector(status))
        self._engines = _EngineCollector()
        self.registry.register(self._engines)
        self.latency = Histogram("pyllmrouter_request_seconds", "Request latency (to the last byte)",
                                 ["model", "endpoint", "status"], registry=self.registry)
        self.queue_wait = Histogram("pyllmrouter_queue_wait_seconds", "Time a request waited for its model",
                                    ["model"], registry=self.registry)

    def render(self, engine_stats: dict[str, dict[str, float]] | None = None) -> bytes:
        """The registry in Prometheus' text format, with ``engine_stats`` (model -> EngineStats
        fields, from ``Router.engine_stats``) as the models' decode counters."""
        self._engines.stats = engine_stats or {}
        return generate_latest(self.registry)
