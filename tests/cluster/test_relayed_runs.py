"""A request a cluster's node runs only once it holds a free slot and its claim came back
(``Ask.running``, router/exchange.py; server/forwarded.py): it waits for a slot at the router, in
the order requests came, never in its engine's queue; a claim refused ends it with its
lease released and nothing sent to the engine."""

from __future__ import annotations

import asyncio
import json

import pytest

from pyllmrouter import ModelConfig, ModelSpec, Router, probe
from pyllmrouter.devices import EmulatedInventory
from pyllmrouter.router.exchange import Ask
from pyllmrouter.errors import Unclaimed

pytestmark = pytest.mark.slow

LONG = json.dumps({"prompt": "hi", "max_tokens": 100000, "stream": True}).encode()  # the story: until closed
WAITERS = 6
SHORT = json.dumps({"prompt": "hi", "max_tokens": 2}).encode()


def _router(path) -> Router:
    models = [ModelConfig("a", ModelSpec(path, ("-np", "1", "--context-shift"), n_ctx=2048))]  # LONG: until closed
    return Router(models, inventory=EmulatedInventory({"GPU0": 1 << 30}), margin=0)


async def _until(check, what: str, timeout: float = 60) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not check():
        assert asyncio.get_running_loop().time() < deadline, what
        await asyncio.sleep(0.01)


def test_a_relayed_request_waits_for_a_free_slot_then_claims_in_arrival_order(story):
    with _router(story) as r:
        r.load("a")
        order: list[str] = []
        seen_leases: list[int] = []

        def claim(name: str):
            async def running() -> bool:
                seen_leases.append(r.status()["models"]["a"]["leases"])
                order.append(name)
                return True
            return running

        async def relayed(name: str, body: bytes, until: asyncio.Event | None = None) -> int:
            reply, stream = await r.arelay(Ask("a", "POST", "/v1/completions", body, running=claim(name)))
            if until is not None:
                await until.wait()
                await stream.aclose()
            return reply.status

        async def scenario():
            end = asyncio.Event()
            first = asyncio.ensure_future(relayed("first", LONG, end))
            await _until(lambda: order == ["first"], "the first claim")
            later = []
            for i in range(WAITERS):
                later.append(asyncio.ensure_future(relayed(f"w{i}", SHORT)))
                await _until(lambda i=i: r.status()["models"]["a"]["waiting"]["requests"] == i + 1, f"w{i} waiting")
            # none holds a lease (none queued in the engine) nor has claimed, while the slot is busy
            await asyncio.sleep(0.5)
            assert r.status()["models"]["a"]["leases"] == 1 and order == ["first"]
            end.set()  # the story's stream closed: its slot frees
            return await asyncio.gather(first, *later)

        assert asyncio.run(scenario()) == [200] * (WAITERS + 1)
        assert order == ["first"] + [f"w{i}" for i in range(WAITERS)]
        assert seen_leases == [1] * (WAITERS + 1)  # each claimed holding the one slot, alone


def test_a_refused_claim_runs_nothing_and_releases_its_lease(tiny):
    with _router(tiny["tiny-llama"]) as r:
        r.load("a")
        async def refused() -> bool:
            return False

        async def scenario():
            with pytest.raises(Unclaimed):
                await r.arelay(Ask("a", "POST", "/v1/completions", SHORT, running=refused))

        asyncio.run(scenario())
        assert r.status()["models"]["a"]["leases"] == 0
        reply, _ = r.call("a", "GET", "/slots")  # the engine never had it: its slot has taken no task
        slots = json.loads(reply.body)
        assert slots and not any("id_task" in s for s in slots), slots
        r.call("a", "POST", "/v1/completions", {"prompt": "hi", "max_tokens": 2})  # (the check can fail: a task shows)
        assert any("id_task" in s for s in json.loads(r.call("a", "GET", "/slots")[0].body))


def test_a_wait_for_a_slot_starts_another_instance_and_has_no_queue_timeout(story):
    """A model with ``replicas = 2``: a relayed request that finds the one slot taken
    starts the second instance and runs there; with one instance only, it waits past the
    queue timeout (as in its engine's queue) and runs once the slot frees."""
    spec = ModelSpec(story, ("-np", "1", "-c", "2048", "--context-shift"))  # LONG: until closed
    one = probe(spec).total
    inventory = EmulatedInventory({"GPU0": one + one // 2, "GPU1": one + one // 2})

    async def yes() -> bool:
        return True

    with Router([ModelConfig("m", spec, replicas=2)], inventory=inventory, margin=0) as r:
        r.load("m")

        async def grown():
            _, first = await r.arelay(Ask("m", "POST", "/v1/completions", LONG, running=yes))
            taken: list[str] = []
            second = asyncio.ensure_future(r.arelay(Ask("m", "POST", "/v1/completions", SHORT, running=yes,
                                                        leased=taken.append)))
            reply, _ = await asyncio.wait_for(second, 120)  # the first still holds m's slot
            await first.aclose()
            return reply.status, taken

        assert asyncio.run(grown()) == (200, ["m#2"])

    with Router([ModelConfig("m", spec)], inventory=inventory, margin=0, queue_timeout=1) as r:
        r.load("m")

        async def waited():
            _, first = await r.arelay(Ask("m", "POST", "/v1/completions", LONG, running=yes))
            second = asyncio.ensure_future(r.arelay(Ask("m", "POST", "/v1/completions", SHORT, running=yes)))
            await asyncio.sleep(3)  # three queue timeouts
            assert not second.done() and r.status()["models"]["m"]["waiting"]["why"] == "waiting for a free slot"
            await first.aclose()
            reply, _ = await asyncio.wait_for(second, 60)
            return reply.status

        assert asyncio.run(waited()) == 200
