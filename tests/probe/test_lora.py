"""LoRA adapters: their bytes counted where llama.cpp puts them, a per-request scale
applies, a bad adapter is named."""

from __future__ import annotations

import logging
import re

import pytest

from pyllmrouter import ModelSpec, ProbeError, probe
from pyllmrouter.config import ModelConfig
from pyllmrouter.devices import EmulatedInventory
from pyllmrouter.engine.backend import native
from pyllmrouter.engine.loader import load, request
from pyllmrouter.router.api import Router
from pyllmrouter.tools import tinymodels


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    d = tmp_path_factory.mktemp("lora")
    return {"small": tinymodels.write_lora(d / "small.gguf"),
            "wide": tinymodels.write_lora(d / "wide.gguf", rank=256, seed=1),
            "odd": tinymodels.write_lora(d / "odd.gguf", rank=3, seed=2, targets=("output", "attn_k")),
            "moe": tinymodels.write_lora(d / "moe.gguf", tinymodels.MOE, targets=("attn_q",))}


def lora_rows(est):
    return [b for b in est.buffers if b.component == "lora"]


def test_the_probe_counts_each_adapter_as_ggml_allocates_it(tiny, adapters):
    base = ModelSpec(tiny["tiny-llama"], ("-np", "1"), n_ctx=512)
    plain = probe(base, use_cache=False)
    est = probe(base.with_args("--lora-scaled", f"{adapters['small']}:1,{adapters['odd']}:0.5"), use_cache=False)
    assert [b for b in est.buffers if b.component != "lora"] == list(plain.buffers)  # the model is as it was
    rows = lora_rows(est)
    assert [(r.buffer_type, r.device, r.host) for r in rows] == [("CPU", "CPU", True)] * 2
    sizes = {name: sum(n for _, n in native().tensor_sizes(str(adapters[name]))) for name in ("small", "odd")}
    assert rows[0].model == sizes["small"]  # every tensor a multiple of the alignment: no padding
    assert sizes["odd"] < rows[1].model < sizes["odd"] + 64 * 8  # rank 3: each tensor padded to the alignment
    assert est.devices[0].lora == rows[0].model + rows[1].model and est.total == plain.total + est.devices[0].lora


def test_the_count_is_what_llama_cpp_allocates_when_the_engine_loads(tiny, adapters, caplog):
    spec = ModelSpec(tiny["tiny-llama"], ("-np", "1", "--lora", str(adapters["wide"])), n_ctx=512)
    (row,) = lora_rows(probe(spec, use_cache=False))
    with caplog.at_level(logging.DEBUG, logger="pyllmrouter.llama"):
        load(spec).close()
    logged = [m for r in caplog.records if (m := re.search(r"LoRA buffer size = +([\d.]+) MiB", r.getMessage()))]
    assert [m.group(1) for m in logged] == [f"{row.model / 2**20:.2f}"]  # llama.cpp's own figure, 1.38 MiB


def test_a_scale_set_per_request_applies(tiny, adapters):
    spec = ModelSpec(tiny["tiny-llama"], ("-np", "1"), n_ctx=512)
    body = {"prompt": "hello", "max_tokens": 8, "temperature": 0}
    plain = load(spec)
    try:
        base = request(plain, "/v1/completions", body)["choices"][0]["text"]
    finally:
        plain.close()
    engine = load(spec.with_args("--lora", str(adapters["small"])))
    try:
        off = request(engine, "/v1/completions", {**body, "lora": [{"id": 0, "scale": 0.0}]})["choices"][0]["text"]
        on = request(engine, "/v1/completions", {**body, "lora": [{"id": 0, "scale": 1.0}]})["choices"][0]["text"]
        listed = request(engine, "/lora-adapters", None, "GET")
    finally:
        engine.close()
    assert off == base and on != base
    assert [a["path"] for a in listed] == [str(adapters["small"])]


def test_a_bad_adapter_is_named(tiny, adapters, tmp_path):
    spec = ModelSpec(tiny["tiny-llama"], n_ctx=512)
    gone = tmp_path / "gone.gguf"
    with pytest.raises(ProbeError, match="gone.gguf: lora: file not found") as e:
        probe(spec.with_args("--lora", str(gone)), use_cache=False)
    assert e.value.path == str(gone)
    with pytest.raises(ProbeError, match="moe.gguf: lora: made for qwen3moe, the model is llama"):
        probe(spec.with_args("--lora", str(adapters["moe"])), use_cache=False)
    with pytest.raises(ProbeError, match="tiny-moe.gguf: lora: not a LoRA adapter"):
        probe(spec.with_args("--lora", str(tiny["tiny-moe"])), use_cache=False)


@pytest.mark.slow
def test_the_router_counts_the_adapter_and_shows_it(tiny, adapters):
    spec = ModelSpec(tiny["tiny-llama"], ("-np", "1", "--lora", str(adapters["wide"])), n_ctx=512)
    need = probe(spec).total
    with Router([ModelConfig("m", spec)], inventory=EmulatedInventory({"GPU0": need}), margin=0) as r:
        assert r.complete("m", "hello", max_tokens=2)["choices"]
        status = r.status()["models"]["m"]
        assert status["requirement"]["GPU0"]["GPU0"] == need
        assert status["components"]["GPU0"]["CPU"]["lora"] == lora_rows(probe(spec))[0].model


def test_an_applied_adapter_needs_no_compute_beyond_the_probe(tiny, adapters):
    """llama.cpp reserves its compute buffers again once an adapter is applied (at load and
    per request): after requests with the adapter on, the live buffers are the probe's."""
    from pyllmrouter.engine.probe import live_breakdown

    for ubatch in (512, 64):
        spec = ModelSpec(tiny["tiny-llama"], ("-np", "1", "-b", str(ubatch), "-ub", str(ubatch),
                                              "--lora", str(adapters["wide"])), n_ctx=1024)
        est = probe(spec, use_cache=False)
        engine = load(spec)
        try:
            for scale in (1.0, 0.5):
                request(engine, "/v1/completions", {"prompt": "hello " * 100, "max_tokens": 4,
                                                    "lora": [{"id": 0, "scale": scale}]})
            live = {b.buffer_type: (b.context, b.compute) for b in live_breakdown(engine) if b.context or b.compute}
        finally:
            engine.close()
        probed = {b.buffer_type: (b.context, b.compute) for b in est.buffers
                  if b.component == "model" and (b.context or b.compute)}
        assert live == probed
