import os

import pytest

from pyllmrouter import ModelSpec, probe
from pyllmrouter.tools import tinymodels
from pyllmrouter.engine.loader import load, request


@pytest.fixture()
def engine():
    engines = []

    def make(spec):
        engines.append(load(spec))
        return engines[-1]

    yield make
    for e in engines:
        e.close()


def test_dense_and_moe_generate(tiny, engine):
    for name in ("tiny-llama", "tiny-moe"):
        e = engine(ModelSpec(tiny[name], n_ctx=256))
        body = {"prompt": "hello world", "max_tokens": 6, "temperature": 0.0, "cache_prompt": False}
        out = request(e, "/v1/completions", body)
        assert out["usage"]["completion_tokens"] > 0
        # greedy decoding of the same prompt is deterministic
        assert request(e, "/v1/completions", body)["choices"][0]["text"] == out["choices"][0]["text"]


def test_chat_template_is_applied(tiny, engine):
    e = engine(ModelSpec(tiny["tiny-llama"], n_ctx=256))
    out = request(e, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
    assert out["choices"][0]["message"]["role"] == "assistant"
    assert out["usage"]["prompt_tokens"] > 3  # ChatML markers + content
    prompt = request(e, "/apply-template", {"messages": [{"role": "user", "content": "hi"}]})["prompt"]
    assert prompt == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_bert_embeds(tiny, engine):
    e = engine(ModelSpec(tiny["tiny-bert"], ("--embedding",), n_ctx=512))
    a, b = (d["embedding"] for d in request(e, "/v1/embeddings", {"input": ["hello world", "the model"]})["data"])
    assert len(a) == tinymodels.BERT.n_embd
    assert a != b


def test_writers_are_seeded(tmp_path):
    a = tinymodels.write_llama(tmp_path / "a.gguf", seed=3)
    b = tinymodels.write_llama(tmp_path / "b.gguf", seed=3)
    c = tinymodels.write_llama(tmp_path / "c.gguf", seed=4)
    assert a.read_bytes() == b.read_bytes() != c.read_bytes()


def test_moe_writer_rejects_a_dense_shape(tmp_path):
    with pytest.raises(ValueError, match="n_expert"):
        tinymodels.write_moe(tmp_path / "x.gguf", shape=tinymodels.LLAMA)


def test_large_shape_is_sparse_and_probes_as_its_real_layout(shape7b):
    st = os.stat(shape7b)
    assert st.st_size > 3.5e9  # the real Q4_0 size of a 7B
    assert st.st_blocks * 512 < 16 * 1024 * 1024  # but almost nothing on disk
    est = probe(ModelSpec(shape7b, n_ctx=4096))
    assert est.facts.n_layer == 32 and est.facts.n_embd == 4096
    assert 6.5e9 < est.facts.n_params < 7.5e9
    # f16 KV of a 7B GQA model: 2 (K,V) * 32 layers * 1024 (8 heads x 128) * 4096 ctx * 2 bytes
    assert est.devices[-1].kv == 2 * 32 * 1024 * 4096 * 2
