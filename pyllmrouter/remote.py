"""A running server, asked over HTTP (``pyllmrouter ps``, ``devices --url``, the demo):
its models and devices as text tables, as ``ollama ps`` shows them.  Plain urllib: no
llama.cpp, nothing to install."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any

from pyllmrouter.tables import mib

__all__ = ["RemoteError", "request", "get", "post", "ps_table", "devices_table"]

PS_HEADERS = ["model", "state", "on (MiB per device)", "requests", "waiting", "until"]
DEVICE_HEADERS = ["device", "kind", "total MiB", "models MiB", "workers MiB", "other programs MiB",
                  "margin MiB", "available MiB"]


class RemoteError(RuntimeError):
    """The server could not be asked, or answered with an error (its message)."""


def request(url: str, method: str, path: str, body: dict | None = None, key: str | None = None) -> tuple[int, Any]:
    """``method path`` on the server at ``url``: its status and JSON body, error statuses
    included; RemoteError only when it cannot be reached."""
    headers = {"Content-Type": "application/json"}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url.rstrip("/") + path, data=data, headers=headers, method=method)
    try:
        with urllib.request.urlopen(req, timeout=300) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        try:
            return e.code, json.loads(e.read())
        except ValueError:
            return e.code, {"error": {"message": e.reason}}
    except (urllib.error.URLError, OSError) as e:
        raise RemoteError(f"{url}: cannot connect ({getattr(e, 'reason', e)})") from None


def _ok(url: str, path: str, status: int, data: Any) -> Any:
    if status >= 400:
        message = (data.get("error") or {}).get("message") if isinstance(data, dict) else None
        raise RemoteError(f"{url}{path}: {status} {message or data}")
    return data


def get(url: str, path: str, key: str | None = None) -> Any:
    """The JSON body of ``GET path``; an error status raises RemoteError with its message."""
    return _ok(url, path, *request(url, "GET", path, None, key))


def post(url: str, path: str, body: dict, key: str | None = None) -> Any:
    """The JSON body of ``POST path``; an error status raises RemoteError with its message."""
    return _ok(url, path, *request(url, "POST", path, body, key))


def _until(m: dict) -> str:
    if m.get("in_flight"):
        return "busy"
    if m.get("ttl_left") is not None:
        return f"in {m['ttl_left']:.0f} s (ttl)"
    if (m.get("status") or {}).get("value") != "loaded":
        return ""
    if m.get("persistent"):
        return "forever (persistent)"
    idle = m.get("idle_seconds")
    return "until evicted" + (f" (idle {idle:.0f} s)" if idle is not None else "")


def ps_table(models: dict, everything: bool = False) -> tuple[list[str], list[list]]:
    """``GET /models`` as rows: the models that hold memory or have requests (all with
    ``everything``)."""
    rows = []
    for m in models["data"]:
        mem, status, waiting = m.get("memory") or {}, m.get("status") or {}, m.get("waiting") or {}
        held = mem.get("held") or {}
        if not everything and not held and not m.get("in_flight") and not waiting.get("requests"):
            continue
        state = status.get("value", "?") + (" (failed)" if status.get("failed") else "")
        short = ", ".join(f"{d} short {mib(n)}" for d, n in (waiting.get("short") or {}).items())
        wait = f"{waiting['requests']}: {waiting.get('why') or ''}" + (f" ({short})" if short else "") \
            if waiting.get("requests") else ""
        rows.append([m["id"], state, _on(held), m.get("in_flight", 0), wait, _until(m)])
        for extra in (m.get("instances") or [])[1:]:  # its extra instances (replicas = N), a row each
            rows.append([f"{extra['id']} (instance of {m['id']})", extra["state"], _on(extra.get("held") or {}),
                         extra.get("in_flight", 0), "", ""])
    return PS_HEADERS, rows


def _on(held: dict) -> str:
    return ", ".join(f"{d} {mib(n)}" for d, n in sorted(held.items())) or "-"


def devices_table(devices: dict) -> tuple[list[str], list[list]]:
    """``GET /devices`` as rows: each device's bytes, ours (models, workers) and not."""
    rows = []
    for name, d in devices["devices"].items():
        overhead = d.get("overhead", 0) + d.get("kept", 0)
        rows.append([name, d["kind"], mib(d["total"]), mib(d["held"] - overhead), mib(overhead),
                     mib(d.get("external", 0)), mib(d.get("margin", 0)), mib(max(0, d["available"]))])
    return DEVICE_HEADERS, rows
