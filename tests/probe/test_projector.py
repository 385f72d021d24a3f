"""A model with a multimodal projector (mmproj): counted in the probe, in admission and
placement, served (an image request answers), and a bad projector named."""

from __future__ import annotations

import base64

import pytest

from pyllmrouter import ModelSpec, ProbeError, probe
from pyllmrouter.config import ModelConfig
from pyllmrouter.devices import EmulatedInventory
from pyllmrouter.engine.backend import native
from pyllmrouter.errors import LoadFailed, QueueTimeout
from pyllmrouter.router.api import Router
from pyllmrouter.tools import tinymodels


def image_chat(text: str = "what is in it?", seed: int = 0) -> list[dict]:
    uri = "data:image/png;base64," + base64.b64encode(tinymodels.png(seed=seed)).decode()
    return [{"role": "user", "content": [{"type": "text", "text": text},
                                         {"type": "image_url", "image_url": {"url": uri}}]}]


def test_the_probe_counts_the_projector_weights_and_compute_on_its_device(tiny, projector):
    plain = probe(ModelSpec(tiny["tiny-llama"], n_ctx=512), use_cache=False)
    with_projector = probe(ModelSpec(tiny["tiny-llama"], ("--mmproj", str(projector)), n_ctx=512), use_cache=False)
    rows = [b for b in with_projector.buffers if b.projector]
    assert len(rows) == 1 and rows[0].device == "CPU" and rows[0].host
    bytes_ = rows[0].projector
    # the model's own rows are unchanged; the projector adds its row and nothing else
    assert [b for b in with_projector.buffers if not b.projector] == list(plain.buffers)
    assert with_projector.total == plain.total + bytes_
    assert with_projector.devices[0].projector == bytes_
    # its weights (every tensor of the file) and a warm-up image's compute buffer on top
    weights = sum(n for _, n in native().tensor_sizes(str(projector)))
    assert weights < bytes_ < weights + 64 * 2**20
    assert with_projector.to_dict()["devices"][0]["projector"] == bytes_


def test_a_missing_or_corrupt_projector_is_named(tiny, projector, tmp_path):
    missing = tmp_path / "gone.gguf"
    with pytest.raises(ProbeError, match="gone.gguf: projector: file not found") as e:
        probe(ModelSpec(tiny["tiny-llama"], ("--mmproj", str(missing))), use_cache=False)
    assert e.value.path == str(missing)
    # a GGUF that is not a projector (the text model itself)
    with pytest.raises(ProbeError, match="cannot load it as a projector") as e:
        probe(ModelSpec(tiny["tiny-llama"], ("--mmproj", str(tiny["tiny-llama"]))), use_cache=False)
    assert e.value.path == str(tiny["tiny-llama"])
    noise = tmp_path / "noise.gguf"
    noise.write_bytes(b"not a gguf at all")
    with pytest.raises(ProbeError, match="noise.gguf: projector: not a GGUF file"):
        probe(ModelSpec(tiny["tiny-llama"], ("--mmproj", str(noise))), use_cache=False)


@pytest.mark.slow
def test_an_image_request_answers_through_the_router(tiny, projector):
    spec = ModelSpec(tiny["tiny-llama"], ("-np", "1", "--mmproj", str(projector)), n_ctx=512)
    with Router([ModelConfig("vision", spec)], inventory=EmulatedInventory({"GPU0": 1 << 30}), margin=0) as r:
        text_only = r.chat("vision", [{"role": "user", "content": "what is in it?"}], max_tokens=2)
        seen = r.chat("vision", image_chat(), max_tokens=2)
        assert seen["choices"][0]["finish_reason"] == "length"
        # the image became tokens of the prompt: 16 patches of the 32x32 projector input
        assert seen["usage"]["prompt_tokens"] >= text_only["usage"]["prompt_tokens"] + 16
        status = r.status()["models"]["vision"]
        assert status["requirement"]["GPU0"]["GPU0"] == probe(spec).total
        # the components, named, per memory pool the worker sees
        parts = status["components"]["GPU0"]["CPU"]
        assert parts["projector"] == probe(spec).devices[0].projector > 0
        assert sum(parts.values()) == probe(spec).total


@pytest.mark.slow
def test_a_bad_projector_fails_its_model_and_unloads_nothing(tiny, tmp_path):
    models = [ModelConfig("text", ModelSpec(tiny["tiny-llama"], n_ctx=512), devices=("GPU0",)),
              ModelConfig("vision", ModelSpec(tiny["tiny-llama"], ("--mmproj", str(tmp_path / "gone.gguf")), n_ctx=512),
                          devices=("GPU0",))]
    with Router(models, inventory=EmulatedInventory({"GPU0": 1 << 30}), margin=0, max_models=1) as r:
        r.load("text")
        with pytest.raises(LoadFailed, match="gone.gguf: projector: file not found"):
            r.chat("vision", image_chat(), max_tokens=2)
        assert r.status()["models"]["text"]["state"] == "loaded"
        assert r.chat("text", [{"role": "user", "content": "hi"}], max_tokens=2)["choices"]


@pytest.mark.slow
def test_seed_incident_with_a_projector_the_second_model_fits_only_without_it(tiny, projector):
    """Two models pinned to GPU0 whose weights and KV fit there together, but not with the
    projector: the projector is counted, so the second waits while the first is busy,
    then evicts it once idle; GPU0 is never oversubscribed."""
    text = ModelSpec(tiny["tiny-llama"], n_ctx=512)
    vision = ModelSpec(tiny["tiny-llama"], ("--mmproj", str(projector)), n_ctx=256)
    without = probe(ModelSpec(tiny["tiny-llama"], n_ctx=256)).total
    gpu0 = probe(text).total + without + probe(vision).total // 100  # room for both, less the projector
    assert probe(text).total + probe(vision).total > gpu0
    models = [ModelConfig("text", text, devices=("GPU0",)), ModelConfig("vision", vision, devices=("GPU0",))]
    with Router(models, inventory=EmulatedInventory({"GPU0": gpu0, "GPU1": 1 << 30}), margin=0) as r:
        r.scheduler.measure("vision")  # measured ahead: the 1 s wait below is for memory, not a probe
        busy = r.complete("text", "hello", max_tokens=8, stream=True, temperature=0.0)
        next(busy)
        with pytest.raises(QueueTimeout, match="'vision'.*busy"):
            r.chat("vision", image_chat(), max_tokens=2, wait=1.0)
        assert r.status()["models"]["text"]["state"] == "loaded"
        r.scheduler.check_invariant()
        list(busy)
        assert r.chat("vision", image_chat(), max_tokens=2)["choices"]
        events = [(what, name) for _, what, name, _ in r.scheduler.events]
        assert events[-2:] == [("evict", "text"), ("load", "vision")]
        r.scheduler.check_invariant()
