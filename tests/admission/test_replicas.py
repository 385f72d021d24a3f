"""Replicas by demand (replicas = N): a model whose requests wait gets another instance where
there is room, requests go to the instance with the fewest in flight, and an idle extra
instance is the first to make room for another model."""

from __future__ import annotations

import json
import subprocess
import sys
import threading

import httpx
import pytest

from pyllmrouter import ModelConfig, ModelSpec, Router, probe
from pyllmrouter.devices import EmulatedInventory
from pyllmrouter.presets import read_preset
from pyllmrouter.remote import ps_table
from test_follow import CLIENTS
from test_live import serving, wait_for
from test_scheduling import CHAT, Streams

pytestmark = pytest.mark.slow


def test_the_preset_key_reads(tmp_path, tiny):
    preset = tmp_path / "p.ini"
    preset.write_text(f"[m]\nmodel = {tiny['tiny-llama']}\nreplicas = 3\n")
    assert read_preset(preset).models[0].replicas == 3
    preset.write_text(f"[m]\nmodel = {tiny['tiny-llama']}\nreplicas = 0\n")
    with pytest.raises(ValueError, match="replicas"):
        read_preset(preset)


def test_waiting_requests_start_a_second_instance_and_go_to_the_least_busy(story, tiny):
    spec = ModelSpec(story, ("-np", "1", "-c", "2048", "--context-shift"))  # its streams last until stopped
    one = probe(spec).total
    other = ModelConfig("other", spec.replace(args=(*spec.args, "--temp", "0.5")), devices=("GPU1",))  # as big
    models = [ModelConfig("m", spec, replicas=2), other]
    inventory = EmulatedInventory({"GPU0": one + one // 2, "GPU1": one + one // 2})  # one instance each
    with Router(models, inventory=inventory, margin=0) as r, serving(r) as base:
        streams, first = Streams(base), threading.Event()
        try:
            streams.open("m", first)
            assert first.wait(60)
            assert [i for i in r.status()["models"] if i.startswith("m#")] == []  # its one slot, no wait: one
            streams.open("m")  # a request waits for the slot: a second instance loads on the other GPU
            wait_for(lambda: r.status()["models"].get("m#2", {}).get("state") == "loaded", what="the second instance")
            st = r.status()["models"]
            assert st["m"]["devices"] != st["m#2"]["devices"] and st["m#2"]["replica_of"] == "m"
            listed = {m["id"]: m for m in httpx.get(base + "/models", timeout=30).json()["data"]}
            assert "m#2" not in listed and [i["id"] for i in listed["m"]["instances"]] == ["m", "m#2"]
            assert "m#2" not in [m["id"] for m in httpx.get(base + "/v1/models", timeout=30).json()["data"]]
            # the next request goes to the instance with the fewest in flight (the extra one:
            # both streams are on the first), and answers as the model
            assert (st["m"]["leases"], st["m#2"]["leases"]) == (2, 0)
            lease = r.scheduler.try_lease("m")
            assert lease is not None and lease.name == "m#2"
            r.scheduler.release(lease)
            reply = httpx.post(base + "/v1/chat/completions", timeout=60,
                               json={"model": "m", "messages": CHAT, "max_tokens": 3})
            assert reply.status_code == 200 and reply.json()["model"] == "m"
            assert r.status()["models"]["m#2"]["loads"] == 1
            # ps and /metrics show each instance
            headers, rows = ps_table(httpx.get(base + "/models", timeout=30).json(), True)
            extra = next(row for row in rows if row[0] == "m#2 (instance of m)")
            assert extra[1] == "loaded" and extra[2].startswith(st["m#2"]["devices"][0])
            scrape = httpx.get(base + "/metrics", timeout=30).text
            assert 'pyllmrouter_model_loaded{model="m#2"} 1.0' in scrape
        finally:
            streams.close()
        wait_for(lambda: r.status()["models"]["m#2"]["leases"] + r.status()["models"]["m"]["leases"] == 0,
                 what="both instances idle")
        # a conversation goes back to the instance that served it last (its prompt is cached
        # there), though the model's own instance comes first among idle equals
        def ask(conv: str) -> str:
            reply = httpx.post(base + "/v1/chat/completions", timeout=60, headers={"X-Conversation-Id": conv},
                               json={"model": "m", "messages": CHAT, "max_tokens": 2})
            assert reply.status_code == 200, reply.text
            return r.conversations.owner(conv)

        def served(conv: str) -> str:  # the instance whose last use moved
            before = {n: m["last_used"] for n, m in r.status()["models"].items()}
            owner = ask(conv)
            moved = [n for n, m in r.status()["models"].items() if m["last_used"] != before[n]]
            assert moved == [owner], (moved, owner)
            return owner

        def seen() -> tuple:  # what a failure says: each instance, and the latest events
            return ({n: (m["state"], m["leases"], m["loads"]) for n, m in r.status()["models"].items()},
                    [(what, name) for _, what, name, _ in r.scheduler.events][-10:])
        assert served("fresh") == "m", seen()
        r.conversations.served_by("c1", r.conversations.remember("c1", "m"), "m#2")  # c1 was served by m#2
        assert served("c1") == "m#2" and served("c1") == "m#2" and served("fresh") == "m"
        # another model needs GPU1: the idle extra instance goes first, and leaves the list
        assert r.chat("other", CHAT, max_tokens=2)["choices"]
        events = [(what, name) for _, what, name, _ in r.scheduler.events]
        assert ("evict", "m#2") in events and "m#2" not in r.status()["models"]
        assert r.status()["models"]["m"]["state"] == "loaded"  # the model's own instance stays
        r.scheduler.check_invariant()


def test_connections_a_worker_follows_spread_over_a_new_instance(tiny, tmp_path):
    """Two connections whose requests never pause, each followed by the worker of the one
    instance (it reads their next requests itself): the second makes requests wait for the
    slot, so another instance loads, and the follows end then, for the router to spread
    the connections' next requests over both."""
    spec = ModelSpec(tiny["tiny-llama"], ("-np", "1", "-c", "1024"))
    one = probe(spec).total
    inventory = EmulatedInventory({"GPU0": one + one // 2, "GPU1": one + one // 2})  # one instance each
    body = {"model": "m", "prompt": "hi", "max_tokens": 3, "ignore_eos": True}
    with Router([ModelConfig("m", spec, replicas=2)], inventory=inventory, margin=0) as r, \
            serving(r, follow_ms=100) as base, open(tmp_path / "statuses", "w+") as out:
        r.load("m")
        clients = subprocess.Popen([sys.executable, "-c", CLIENTS, base.rsplit(":", 1)[1], json.dumps(body), "2"],
                                   stdout=out)
        try:
            wait_for(lambda: r.status()["models"].get("m#2", {}).get("state") == "loaded", what="the second instance")
            wait_for(lambda: r.status()["models"]["m#2"]["leases"] > 0, timeout=30,
                     what="a connection's requests on the second instance")
        finally:
            clients.kill()
            clients.wait(30)
        out.seek(0)
        statuses = out.read().split()
        assert statuses and set(statuses) == {"200"}, statuses
        r.scheduler.check_invariant()
