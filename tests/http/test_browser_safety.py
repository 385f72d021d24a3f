"""Safe beside a browser: what a web page can make a router on 127.0.0.1 do, sent exactly as a
browser sends it (a "simple" request needs no preflight: a text/plain body, an Origin
header; DNS rebinding: a Host of the page's own name), against ``pyllmrouter serve`` with
its defaults; then the same from a page of another origin in Debian's chromium."""

from __future__ import annotations

import json
import threading
import time
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest

from pyllmrouter.server.manage import LOOKUP_IDS
from pyllmrouter.tools.loopback import free_port, start_serve
from test_live import wait_for

pytestmark = pytest.mark.slow

EVIL = "http://evil.example"
LOAD = '{"model":"a"}'


@contextmanager
def serving(tiny, tmp_path, *args: str):
    preset = tmp_path / "models.ini"
    preset.write_text(f"[a]\nmodel = {tiny['tiny-llama']}\nc = 256\n")
    proc, base = start_serve(["--models-preset", str(preset), "--no-models-cache",
                              "--emulate-devices", "GPU0=1GiB", "--models-memory-margin", "0", *args])
    try:
        yield base
    finally:
        proc.terminate()
        proc.wait(30)


def state(base: str, **headers) -> str:
    models = httpx.get(base + "/models", headers=headers, timeout=30).json()["data"]
    return next(m["status"]["value"] for m in models if m["id"] == "a")


def test_a_page_of_another_site_drives_nothing_by_default(tiny, tmp_path):
    with serving(tiny, tmp_path) as base:
        port = base.rsplit(":", 1)[1]
        # DNS rebinding: the page's own name, now resolving to 127.0.0.1, and so its own origin
        r = httpx.post(base + "/models/load", content=LOAD, timeout=30,
                       headers={"Origin": f"{EVIL}:{port}", "Host": f"evil.example:{port}", "Content-Type": "text/plain"})
        assert r.status_code == 403 and "--allowed-hosts" in r.json()["error"]["message"]
        assert "access-control-allow-origin" not in r.headers
        # a page of another origin: a simple request (no preflight), and a read
        r = httpx.post(base + "/models/load", content=LOAD, headers={"Origin": EVIL, "Content-Type": "text/plain"},
                       timeout=30)
        assert r.status_code == 403 and "--cors-origins" in r.json()["error"]["message"]
        r = httpx.get(base + "/models", headers={"Origin": EVIL}, timeout=30)
        assert r.status_code == 403 and "access-control-allow-origin" not in r.headers
        r = httpx.post(base + "/v1/completions", json={"model": "a", "prompt": "x", "max_tokens": 1},
                       headers={"Origin": EVIL}, timeout=30)
        assert r.status_code == 403  # inference too: it loads models and evicts others
        for path in ("/tools", "/cors-proxy", "/slots?model=a", "/props?model=a"):
            assert httpx.get(base + path, headers={"Origin": EVIL}, timeout=30).status_code == 403, path
        assert state(base) == "unloaded"  # none of it loaded anything
        # the router's own page and local tools keep working: the local origins, any port
        local = {"Origin": "http://localhost:5173"}
        assert httpx.get(base + "/models", headers=local, timeout=30).headers["access-control-allow-origin"] \
            == "http://localhost:5173"
        r = httpx.post(base + "/models/load", content=LOAD, headers={**local, "Content-Type": "text/plain"}, timeout=30)
        assert r.status_code == 415 and "application/json" in r.json()["error"]["message"]  # a browser's body: JSON
        r = httpx.post(base + "/models/load", content=LOAD, headers={**local, "Content-Type": "application/json"},
                       timeout=60)
        assert r.status_code == 200 and state(base) == "loaded"
        own = {"Origin": base}  # the page the router serves itself
        assert httpx.get(base + "/models", headers=own, timeout=30).status_code == 200
        assert httpx.get(base + "/health", headers={"Origin": EVIL}, timeout=30).status_code == 200  # public
        # programs send no Origin: unchanged
        assert httpx.post(base + "/models/unload", content=LOAD, timeout=30).status_code == 200


def test_the_options_that_open_it(tiny, tmp_path):
    with serving(tiny, tmp_path, "--allowed-hosts", "router.lan", "--cors-origins", "*") as base:
        port = base.rsplit(":", 1)[1]
        assert httpx.get(base + "/models", headers={"Host": f"router.lan:{port}"}, timeout=30).status_code == 200
        assert httpx.get(base + "/models", headers={"Host": f"other.lan:{port}"}, timeout=30).status_code == 403
        # '*': llama-server's default, every origin may read and drive it (with a JSON body)
        r = httpx.get(base + "/models", headers={"Origin": EVIL}, timeout=30)
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == EVIL
        r = httpx.post(base + "/models/load", json={"model": "a"}, headers={"Origin": EVIL}, timeout=60)
        assert r.status_code == 200
    with serving(tiny, tmp_path, "--api-key", "k") as base:  # a key opens everything
        key = {"Authorization": "Bearer k", "Origin": EVIL}
        assert httpx.get(base + "/models", headers=key, timeout=30).status_code == 200
        assert httpx.get(base + "/models", headers={"Origin": EVIL}, timeout=30).status_code == 403


def test_no_request_holds_the_event_loop(tiny, tmp_path):
    """A lookup of 1,000,000 copies of a remembered conversation id (6.7 MiB, under the body
    limit): /health keeps answering within 100 ms, and the lookup is refused, naming its cap."""
    with serving(tiny, tmp_path) as base:
        conv = "c1x"  # short: a million copies fit the body limit
        r = httpx.post(base + "/v1/completions", json={"model": "a", "prompt": "x", "max_tokens": 1},
                       headers={"X-Conversation-Id": conv}, timeout=60)
        assert r.status_code == 200
        body = json.dumps({"conversation_ids": [conv] * 1_000_000}).encode()
        worst, stop = [0.0], threading.Event()

        def poll():
            with httpx.Client(base_url=base, timeout=60) as http:
                while not stop.is_set():
                    t0 = time.perf_counter()
                    assert http.get("/health").status_code == 200
                    worst[0] = max(worst[0], time.perf_counter() - t0)
                    time.sleep(0.005)

        poller = threading.Thread(target=poll)
        poller.start()
        try:
            time.sleep(0.2)
            r = httpx.post(base + "/v1/streams/lookup", content=body, headers={"Content-Type": "application/json"},
                           timeout=120)
            time.sleep(0.2)
        finally:
            stop.set()
            poller.join()
        assert r.status_code == 400 and f"at most {LOOKUP_IDS}" in r.json()["error"]["message"]
        assert worst[0] < 0.1, f"/health waited {worst[0] * 1e3:.0f} ms"
        # duplicates count once: the same id many times is one lookup
        r = httpx.post(base + "/v1/streams/lookup", json={"conversation_ids": [conv] * 5000}, timeout=30)
        assert r.status_code == 200 and len(r.json()) <= 1
        # a model nobody lists remembers no conversation (nothing to hold for it)
        r = httpx.post(base + "/v1/completions", json={"model": "x" * 100_000, "prompt": "x"},
                       headers={"X-Conversation-Id": "ghost"}, timeout=30)
        assert r.status_code == 404
        r = httpx.get(base + "/v1/stream", params={"conv_id": "ghost"}, timeout=30)
        assert r.status_code == 404 and r.json()["error"]["message"] == "Stream not found or expired"


def test_pulls_are_off_without_the_cache(tiny, tmp_path):
    with serving(tiny, tmp_path) as base:
        r = httpx.post(base + "/models", json={"model": "org/repo:Q8_0"}, timeout=30)
        assert r.status_code == 400 and "--models-cache" in r.json()["error"]["message"]


# -- in a real browser ---------------------------------------------------------------

ATTACK = """<!doctype html><title>a page of another site</title><script>
window.results = [];
async function attempt(name, url, opts) {
  try { const r = await fetch(url, opts); window.results.push([name, r.status, await r.text()]); }
  catch (e) { window.results.push([name, "blocked", String(e)]); }
}
(async () => {
  const router = "ROUTER";
  await attempt("simple POST load", router + "/models/load", {method: "POST", body: '{"model":"a"}'});
  await attempt("no-cors POST load", router + "/models/load", {method: "POST", mode: "no-cors", body: '{"model":"a"}'});
  await attempt("read the model list", router + "/models", {});
  await attempt("JSON POST load", router + "/models/load",
                {method: "POST", headers: {"Content-Type": "application/json"}, body: '{"model":"a"}'});
  await attempt("completion", router + "/v1/completions", {method: "POST", mode: "no-cors",
                body: '{"model":"a","prompt":"x","max_tokens":1}'});
  window.done = true;
})();
</script>"""


def test_a_page_of_another_origin_in_chromium_gets_nothing_through(tiny, tmp_path):
    from test_page import _why_no_browser, chromium

    why = _why_no_browser()
    if why:
        pytest.skip(why)

    with serving(tiny, tmp_path) as base:
        page = ATTACK.replace("ROUTER", base).encode()

        class Attack(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_GET(self):
                self.send_response(200)
                self.send_header("Content-Type", "text/html")
                self.send_header("Content-Length", str(len(page)))
                self.end_headers()
                self.wfile.write(page)

        site = ThreadingHTTPServer(("127.0.0.1", free_port()), Attack)
        threading.Thread(target=site.serve_forever, daemon=True).start()
        driver = chromium("--host-resolver-rules=MAP evil.test 127.0.0.1")  # a site of its own name
        try:
            driver.get(f"http://evil.test:{site.server_address[1]}/")
            wait_for(lambda: driver.execute_script("return window.done === true"), what="the page's attempts")
            results = driver.execute_script("return window.results")
        finally:
            driver.quit()
            site.shutdown()
        seen = {name: (status, text) for name, status, text in results}
        # what the page could read: nothing (a refused simple request's answer is unreadable too)
        for name, (status, text) in seen.items():
            assert status in ("blocked", 0), (name, status, text)
        assert state(base) == "unloaded"  # and nothing it sent took effect


def test_the_host_check_remembers_only_what_it_accepted():
    """Every acceptable Host is accepted however often it comes, a rebound name is refused
    every time (the memo of the check never holds a refusal), and however many distinct Host
    headers come, the memo stays bounded."""
    from pyllmrouter.server.browser import Gate  # noqa: PLC0415

    gate = Gate("localhost", frozenset({"router.lan"}))
    for _ in range(2):
        assert gate.host("127.0.0.1:8080") is None
        assert gate.host("Router.LAN:80") is None
        assert gate.host("evil.example:8080").status == 403
    for n in range(1000):
        assert gate.host(f"127.0.{n // 250}.{n % 250 + 1}:{n}") is None
        assert gate.host("evil.example") is not None
    assert len(gate._accepted) <= 64
