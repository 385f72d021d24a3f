import dataclasses
import json
import os
import time

import pytest

from pyllmrouter import ModelSpec, probe
from pyllmrouter.tools import tinymodels
from pyllmrouter.memory import cache_dir


def test_cached_probe_equals_fresh_and_is_marked(tiny):
    spec = ModelSpec(tiny["tiny-moe"], ("-np", "2"), n_ctx=512)
    fresh = probe(spec)
    again = probe(spec)
    assert not fresh.cached and again.cached
    assert again == fresh
    assert again.to_dict() == fresh.to_dict()


def test_cache_is_keyed_by_spec(tiny):
    a = probe(ModelSpec(tiny["tiny-llama"], n_ctx=512))
    b = probe(ModelSpec(tiny["tiny-llama"], n_ctx=1024))
    assert not b.cached and b.devices[0].kv == 2 * a.devices[0].kv
    assert len(list((cache_dir() / "probes").glob("*.json"))) == 2


def test_rewritten_file_is_probed_again(tmp_path):
    path = tmp_path / "m.gguf"
    tinymodels.write_llama(path)
    first = probe(ModelSpec(path, n_ctx=256))
    time.sleep(0.01)
    tinymodels.write_moe(path)  # same name, different model
    second = probe(ModelSpec(path, n_ctx=256))
    assert not second.cached
    assert (first.facts.architecture, second.facts.architecture) == ("llama", "qwen3moe")


def test_corrupt_cache_entry_is_ignored(tiny):
    spec = ModelSpec(tiny["tiny-llama"], n_ctx=256)
    probe(spec)
    for entry in (cache_dir() / "probes").glob("*.json"):
        entry.write_text("{not json")
    again = probe(spec)
    assert not again.cached and again.total > 0
    assert json.loads(next((cache_dir() / "probes").glob("*.json")).read_text())["total"] == again.total


def test_device_mask_is_part_of_the_key(tiny, monkeypatch):
    spec = ModelSpec(tiny["tiny-llama"], n_ctx=256)
    probe(spec)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    assert not probe(spec).cached


def test_llama_arg_variables_are_part_of_the_key(tiny, monkeypatch):
    # llama.cpp's parser reads LLAMA_ARG_* variables: they change what a spec means
    spec = ModelSpec(tiny["tiny-llama"])
    default = probe(spec)
    monkeypatch.setenv("LLAMA_ARG_CTX_SIZE", "512")
    small = probe(spec)
    assert not small.cached and small.n_ctx == 512 != default.n_ctx


def test_unwritable_cache_still_probes(tiny, monkeypatch, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv("PYLLMROUTER_CACHE", str(blocker / "sub"))
    assert probe(ModelSpec(tiny["tiny-llama"], n_ctx=256)).total > 0
    assert not os.path.isdir(blocker)


@pytest.mark.parametrize("kind", ["mmproj", "draft", "lora"])
def test_a_file_loaded_beside_the_model_is_part_of_the_key(tiny, tmp_path, kind):
    # the same path, rewritten with a bigger component: probed again, not the old entry
    write = {
        "mmproj": lambda p, i: tinymodels.write_projector(p, vision=tinymodels.VisionShape(n_embd=32 * i)),
        "draft": lambda p, i: tinymodels.write_llama(p, dataclasses.replace(tinymodels.DRAFT, n_embd=64 * i), seed=1),
        "lora": lambda p, i: tinymodels.write_lora(p, rank=8 * i),
    }[kind]
    path = write(tmp_path / f"{kind}.gguf", 1)
    flag = {"mmproj": "--mmproj", "draft": "--model-draft", "lora": "--lora"}[kind]
    spec = ModelSpec(tiny["tiny-llama"], (flag, str(path)), n_ctx=512)
    first = probe(spec, refresh=True)
    assert probe(spec).cached
    time.sleep(0.01)  # a new mtime even on coarse clocks
    write(tmp_path / f"{kind}.gguf", 2)
    again = probe(spec)
    assert not again.cached and again.total > first.total
