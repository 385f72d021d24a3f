"""Ray Serve's own model multiplexing, as the baseline of ray_bench.py: one replica per
marked node, ``@serve.multiplexed(max_num_models_per_replica=K)`` (least recently used
by count), each model loaded with the same llama.cpp engine in the replica's process.

Serve does not know memory: a load goes ahead whatever the device holds.  The device
is emulated here (this machine has no GPU), so a load that would not fit the node's
device (its bytes by the same probe, against PYLLMROUTER_EMULATE_DEVICES) fails as
a real card would: "cudaMalloc failed: out of memory".  Counters go to a named actor.
"""

from __future__ import annotations

import asyncio
import json
import os

import ray
from ray import serve

COUNTERS = "bench-counters"


@ray.remote(num_cpus=0)
class Counters:
    def __init__(self):
        self.values = {"loads": 0, "evictions": 0, "failed_loads": 0}

    def add(self, key: str) -> None:
        self.values[key] += 1

    def get(self) -> dict:
        return dict(self.values)


class _Loaded:
    """A model held by a replica: the engine and its bytes on the device; ``__del__``
    (Serve's eviction calls it, and Python again when the object goes) frees both, once."""

    def __init__(self, owner: "_Replica", name: str, engine, need: int):
        self.owner, self.name, self.engine, self.need = owner, name, engine, need
        self.freed = False

    def __del__(self):
        if self.freed:
            return
        self.freed = True
        self.owner.held -= self.need
        self.engine.close()
        self.owner.counters.add.remote("evictions")


class _Replica:
    def __init__(self, preset: str):
        from pyllmrouter.devices import EmulatedInventory
        from pyllmrouter.presets import read_preset

        self.specs = {m.name: m.spec for m in read_preset(preset).models}
        self.capacity = sum(d.total for d in EmulatedInventory.parse(os.environ["PYLLMROUTER_EMULATE_DEVICES"]).devices()
                            if d.kind == "emulated")
        self.held = 0
        self.counters = ray.get_actor(COUNTERS)

    async def _load(self, name: str) -> _Loaded:
        from pyllmrouter import probe
        from pyllmrouter.engine.loader import load

        spec = self.specs[name]
        need = probe(spec).total
        if self.held + need > self.capacity:
            self.counters.add.remote("failed_loads")
            raise RuntimeError(f"{name}: cudaMalloc failed: out of memory (emulated: {need} bytes wanted, "
                               f"{self.capacity - self.held} free)")
        engine = await asyncio.to_thread(load, spec)
        self.held += need
        self.counters.add.remote("loads")
        return _Loaded(self, name, engine, need)

    async def __call__(self, request) -> dict:
        from pyllmrouter.engine.loader import request as engine_request

        from starlette.responses import JSONResponse

        model = await self.get_model(serve.get_multiplexed_model_id())
        body = json.loads(await request.body())
        answer = await asyncio.to_thread(engine_request, model.engine, "/v1/completions", body)
        # the node that answered, under the header ours sends (ray_bench --kill-node reads it)
        return JSONResponse(answer, headers={"x-pyllmrouter-node": ray.get_runtime_context().get_node_id()})


def build(preset: str, replicas: int, per_replica: int):
    class Multiplexed(_Replica):
        @serve.multiplexed(max_num_models_per_replica=per_replica)
        async def get_model(self, name: str) -> _Loaded:
            return await self._load(name)

    return serve.deployment(Multiplexed, name="Multiplexed", num_replicas=replicas, max_ongoing_requests=64,
                            ray_actor_options={"num_cpus": 0, "resources": {"pyllmrouter": 1}}).bind(preset)
