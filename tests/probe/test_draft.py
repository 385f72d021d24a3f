"""A draft model for speculative decoding: counted in the probe with the context
llama-server gives it, served (speculation runs), and a bad draft named."""

from __future__ import annotations

import dataclasses

import pytest

from pyllmrouter import ModelSpec, ProbeError, probe
from pyllmrouter.config import ModelConfig
from pyllmrouter.devices import EmulatedInventory
from pyllmrouter.engine.loader import load, request
from pyllmrouter.errors import NeverFits
from pyllmrouter.router.api import Router
from pyllmrouter.tools import tinymodels


def rows(est, component):
    return [(b.buffer_type, b.model, b.context, b.compute, b.output) for b in est.buffers if b.component == component]


# (the target's arguments, the draft's cache types, the speculation's arguments)
@pytest.mark.parametrize("target, draft_types, speculation", [
    (("-c", "512", "-np", "2"), (), ()),
    (("-c", "1024", "-np", "4", "--no-kv-unified"), ("-ctk", "q8_0", "-ctv", "q8_0"), ()),
    (("-c", "256", "-np", "1"), (), ("--spec-type", "draft-simple", "--spec-draft-n-max", "8")),
])
def test_the_draft_is_counted_with_the_context_llama_server_gives_it(tiny, draft, target, draft_types, speculation):
    spec = ModelSpec(tiny["tiny-llama"], (*target, *speculation, "-md", str(draft),
                                          *(("-ctkd", draft_types[1], "-ctvd", draft_types[3]) if draft_types else ())))
    est = probe(spec, use_cache=False)
    # the target's own rows are those of the model probed alone with the same speculation
    alone = probe(ModelSpec(tiny["tiny-llama"], (*target, *speculation)), use_cache=False)
    assert rows(est, "model") == rows(alone, "model")
    # the draft: its own model and a context as long as the target's, with the target's
    # slots, the draft's cache types and one output row per slot
    expected = probe(ModelSpec(draft, (*target, *draft_types), n_ctx=est.n_ctx), use_cache=False)
    assert rows(est, "draft") == rows(expected, "model")
    assert est.devices[0].draft == expected.total
    assert est.total == alone.total + expected.total


@pytest.mark.parametrize("target", [("-c", "0"), ("-c", "1000", "-np", "3", "--no-kv-unified")])
def test_the_draft_gets_the_context_the_target_came_out_with(tiny, tmp_path, target):
    # the draft trains on a shorter context than the target, so a draft left to its
    # own training context (-c 0) or to the length asked before padding differs
    draft = tinymodels.write_llama(tmp_path / "draft-1k.gguf", dataclasses.replace(tinymodels.DRAFT, n_ctx_train=1024),
                                   seed=1)
    spec = ModelSpec(tiny["tiny-llama"], (*target, "-md", str(draft)))
    est = probe(spec, use_cache=False)
    assert est.n_ctx != int(target[1])  # the training context, or the padded length
    expected = probe(ModelSpec(draft, (*target[2:],), n_ctx=est.n_ctx), use_cache=False)
    assert rows(est, "draft") == rows(expected, "model")


def test_speculation_widens_the_targets_output_buffer(tiny, draft):
    base = ModelSpec(tiny["tiny-llama"], ("-np", "2", "-md", str(draft)), n_ctx=512)
    plain = sum(b.output for b in probe(base, use_cache=False).buffers if b.component == "model")
    speculating = probe(base.with_args("--spec-type", "draft-simple", "--spec-draft-n-max", "8"), use_cache=False)
    outputs = sum(b.output for b in speculating.buffers if b.component == "model")
    assert outputs == plain * (1 + 8)  # a row per drafted token and slot, as llama-server reserves


def test_a_loaded_draft_speculates(tiny, draft):
    spec = ModelSpec(tiny["tiny-llama"], ("-np", "1", "-md", str(draft), "--spec-type", "draft-simple"), n_ctx=512)
    engine = load(spec)
    try:
        reply = request(engine, "/v1/completions", {"prompt": "hello", "max_tokens": 16, "temperature": 0})
    finally:
        engine.close()
    assert reply["usage"]["completion_tokens"] == 16
    assert reply["timings"]["draft_n"] > 0  # the draft model drafted tokens the target verified


def test_a_missing_or_wrong_draft_is_named(tiny, projector, tmp_path):
    gone = tmp_path / "gone.gguf"
    with pytest.raises(ProbeError, match="gone.gguf: draft: file not found") as e:
        probe(ModelSpec(tiny["tiny-llama"], ("-md", str(gone))), use_cache=False)
    assert e.value.path == str(gone)
    with pytest.raises(ProbeError, match="projector.gguf: draft: cannot load model") as e:
        probe(ModelSpec(tiny["tiny-llama"], ("-md", str(projector))), use_cache=False)
    assert e.value.path == str(projector)


@pytest.mark.slow
def test_the_router_admits_by_the_total_with_the_draft(tiny, draft):
    spec = ModelSpec(tiny["tiny-llama"], ("-np", "1", "-md", str(draft), "--spec-type", "draft-simple"), n_ctx=512)
    need = probe(spec).total
    too_small = need - probe(ModelSpec(tiny["tiny-llama"], ("-np", "1"), n_ctx=512)).total // 2  # fits only without the draft
    with Router([ModelConfig("m", spec)], inventory=EmulatedInventory({"GPU0": too_small}), margin=0) as r:
        with pytest.raises(NeverFits, match=f"needs {need} bytes"):
            r.complete("m", "x", max_tokens=2)
    with Router([ModelConfig("m", spec)], inventory=EmulatedInventory({"GPU0": need}), margin=0) as r:
        reply = r.complete("m", "hello", max_tokens=8, temperature=0)
        assert reply["timings"]["draft_n"] > 0
        assert r.status()["models"]["m"]["requirement"]["GPU0"]["GPU0"] == need


def test_the_router_gives_a_worker_its_drafts_devices_by_the_names_the_worker_sees(tiny, draft):
    from pyllmrouter.router.workers.measure import worker_spec

    spec = ModelSpec(tiny["tiny-llama"], ("-md", str(draft)), draft_devices=("gpu-b",))
    ds = frozenset({"gpu-a", "gpu-b"})
    local = worker_spec(spec, ds, {"gpu-a": "CUDA0", "gpu-b": "CUDA1"})
    assert local.draft_devices == ("CUDA1",) and local.to_args()[-2:] == ["-devd", "CUDA1"]
    assert worker_spec(spec, ds, {}).draft_devices is None  # emulated devices: the mask decides
    with pytest.raises(ValueError, match="draft's devices gpu-b must be among the devices it is pinned to"):
        Router([ModelConfig("m", spec, devices=("gpu-a",))], inventory=EmulatedInventory({"gpu-a": 1 << 30}),
               margin=0)
