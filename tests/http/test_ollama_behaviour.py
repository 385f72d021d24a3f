"""Ollama's behaviour beyond its wire, driven by Ollama's own Python client: a conversation
longer than the context runs on with its oldest turns dropped (its system message kept), a
long document is embedded cut to fit (``truncate: false``: Ollama's 400), a ``num_ctx``
larger than the loaded context is given by a reload admitted by its exact bytes (one that can
never fit: an error naming them), and LlamaIndex's way of reading the context from
/api/show then asking for it runs on the loaded model."""

from __future__ import annotations

import base64
import time

import httpx
import ollama
import pytest

from pyllmrouter import ModelConfig, ModelSpec, Router
from pyllmrouter.devices import EmulatedInventory
from pyllmrouter.server import ollama_wire as wire
from pyllmrouter.tools import tinymodels

from test_live import serving

SHARE_PROBE_CACHE = True
SYSTEM = {"role": "system", "content": "You are a terse assistant. Remember the code word: zebra."}
QUICK = {"num_predict": 2, "temperature": 0}


@pytest.fixture(scope="module")
def models(tiny):
    llama = tiny["tiny-llama"]
    return [ModelConfig("chat", ModelSpec(llama, ("-np", "1"), n_ctx=512)),
            ModelConfig("grow", ModelSpec(llama, ("-np", "2"), n_ctx=512)),
            ModelConfig("wide", ModelSpec(llama, ("-np", "256"), n_ctx=2048)),
            ModelConfig("bert", ModelSpec(tiny["tiny-bert"], ("--embedding",), n_ctx=512))]


@pytest.fixture(scope="module")
def server(models):
    # 200 MiB: the wide model (256 slots) fits with 256 tokens a slot, never with 2,048 (some 260 MiB)
    with Router(models, inventory=EmulatedInventory({"GPU0": 200 << 20}), margin=0) as r, \
            serving(r, allowed_hosts=frozenset()) as base:
        yield r, base


@pytest.fixture(scope="module")
def client(server):
    return ollama.Client(host=server[1], timeout=120)


def turns(n: int, words: int = 30) -> list[dict]:
    """A conversation of ``n`` user and assistant turns, each message ``words`` long."""
    out = [SYSTEM]
    for i in range(n):
        out.append({"role": "user", "content": f"question {i}: " + " ".join(["alpha beta"] * (words // 2))})
        out.append({"role": "assistant", "content": f"answer {i}: " + " ".join(["gamma delta"] * (words // 2))})
    out.append({"role": "user", "content": "what was the code word?"})
    return out


def count(r: Router, model: str, messages: list[dict]) -> int:
    reply, _ = r.call(model, "POST", "/chat/completions/input_tokens", {"messages": messages})
    return reply.json()["input_tokens"]


# -- a conversation longer than the context ------------------------------------------------------

def test_a_20_turn_conversation_past_the_context_keeps_its_system_and_newest_turns(client, server):
    r, _ = server
    messages = turns(20)
    assert count(r, "chat", messages) > 512  # past the slot's context: llama-server's own endpoint refuses it
    assert r.call("chat", "POST", "/v1/chat/completions", {"messages": messages, "max_tokens": 1},
                  raise_for_status=False)[0].status == 400
    out = client.chat(model="chat", messages=messages, options=QUICK)
    assert out.done and 0 < out.prompt_eval_count < 512
    # exactly the turns that fit: the system message and the newest turns, whole, the fewest dropped
    starts = wire.turn_starts(messages)
    fits = [s for s in starts if count(r, "chat", wire.kept_turns(messages, s)) < 512]
    kept = wire.kept_turns(messages, fits[0])
    assert kept[0] == SYSTEM and kept[1]["role"] == "user" and kept[-1] == messages[-1]
    assert count(r, "chat", wire.kept_turns(messages, starts[starts.index(fits[0]) - 1])) >= 512
    assert out.prompt_eval_count == count(r, "chat", kept)
    streamed = list(client.chat(model="chat", messages=messages, options=QUICK, stream=True))
    assert streamed[-1].done and streamed[-1].prompt_eval_count == out.prompt_eval_count


def test_a_tool_call_and_its_result_go_together():
    messages = [SYSTEM, {"role": "user", "content": "weather? " + "alpha beta " * 200},
                {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "w", "arguments": {}}}]},
                {"role": "tool", "content": "sunny " * 10},
                {"role": "user", "content": "and now? " + "alpha " * 50},
                {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "w", "arguments": {}}}]},
                {"role": "tool", "content": "rain"}]
    assert wire.turn_starts(messages) == [4]  # a turn begins at a user message only
    assert wire.kept_turns(messages, 4) == [SYSTEM, *messages[4:]]


def test_truncate_false_is_ollamas_400_and_the_openai_endpoint_stays_llama_servers(client, server):
    _, base = server
    body = {"model": "chat", "messages": turns(20), "truncate": False, "stream": False, "options": QUICK}
    refused = httpx.post(base + "/api/chat", json=body, timeout=60)
    assert refused.status_code == 400 and wire.TOO_LONG in refused.json()["error"]
    openai = httpx.post(base + "/v1/chat/completions", json={"model": "chat", "messages": turns(20),
                                                             "max_tokens": 1}, timeout=60)
    assert openai.status_code == 400 and openai.json()["error"]["type"] == "exceed_context_size_error"


def test_a_long_generate_prompt_is_cut_to_fit(client):
    out = client.generate(model="chat", prompt="lorem ipsum " * 400, options=QUICK)
    assert out.done and 0 < out.prompt_eval_count < 512
    raw = client.generate(model="chat", prompt="lorem ipsum " * 400, raw=True, options={**QUICK, "num_keep": 4})
    assert raw.done and 0 < raw.prompt_eval_count < 512


# -- a long document through /api/embed -----------------------------------------------------------

def test_a_long_document_is_embedded_cut_to_fit_and_refused_with_truncate_false(client, server):
    r, base = server
    document = "the quick brown fox jumps over the lazy dog " * 120  # past bert's 512 tokens
    alone = client.embed(model="bert", input=document)
    assert 500 < alone.prompt_eval_count <= 512  # bert's batch and context: 512 tokens, its special ones counted
    out = client.embed(model="bert", input=[document, "short text"])
    assert len(out.embeddings) == 2 and out.embeddings[0] == pytest.approx(alone.embeddings[0], abs=1e-6)
    again = client.embed(model="bert", input="short text").embeddings[0]
    assert out.embeddings[1] == pytest.approx(again, abs=1e-6)  # a short input is not touched
    refused = httpx.post(base + "/api/embed", json={"model": "bert", "input": document, "truncate": False},
                         timeout=60)
    assert refused.status_code == 400 and wire.TOO_LONG in refused.json()["error"]
    assert client.embeddings(model="bert", prompt=document).embedding  # the older endpoint too


def test_langchains_chat_and_embeddings_run_past_the_context(server):
    from langchain_ollama import ChatOllama, OllamaEmbeddings

    _, base = server
    history = [(m["role"] if m["role"] != "assistant" else "ai", m["content"]) for m in turns(20)]
    reply = ChatOllama(model="chat", base_url=base, num_predict=2, temperature=0).invoke(history)
    assert 0 < reply.usage_metadata["input_tokens"] < 512
    document = "the quick brown fox jumps over the lazy dog " * 120
    vectors = OllamaEmbeddings(model="bert", base_url=base).embed_documents([document, "short"])
    assert len(vectors) == 2 and all(len(v) > 0 for v in vectors)


# -- num_ctx: given, by exact bytes ---------------------------------------------------------------

def slot(r: Router, model: str) -> int | None:
    return wire.slot_context(r.status()["models"][model]["context"])


def test_a_larger_num_ctx_reloads_the_model_with_it_admitted_by_bytes(client, server):
    r, _ = server
    client.chat(model="grow", messages=[{"role": "user", "content": "hi"}], options=QUICK)
    assert slot(r, "grow") == 256
    before = r.status()["models"]["grow"]
    prompt = [{"role": "user", "content": "alpha beta " * 45}]  # some 400 tokens: past 256, within 1024
    t0 = time.perf_counter()
    out = client.chat(model="grow", messages=prompt, options={**QUICK, "num_ctx": 1024})
    took = time.perf_counter() - t0
    after = r.status()["models"]["grow"]
    spec = {c.name: c for c in r.models()}["grow"].spec
    assert slot(r, "grow") == 1024 and spec.n_ctx == 2 * 1024 and spec.args == ("-np", "2")  # its new config
    assert out.prompt_eval_count > 256  # nothing dropped: the request got its context
    assert out.load_duration > 0 and out.load_duration / 1e9 <= took
    assert sum(after["held"].values()) > sum(before["held"].values())  # its KV cache's bytes, held
    shown = {m.model: m for m in client.ps().models}["grow:latest"]
    assert shown.context_length == 1024 and shown.size == sum(after["held"].values())
    client.chat(model="grow", messages=prompt, options=QUICK)  # kept for later requests, as Ollama keeps it
    assert slot(r, "grow") == 1024 and r.status()["models"]["grow"]["loads"] == after["loads"]
    client.chat(model="grow", messages=HI_, options={**QUICK, "num_ctx": 128})  # a smaller one: the loaded model
    assert r.status()["models"]["grow"]["loads"] == after["loads"]


HI_ = [{"role": "user", "content": "hi"}]


def test_a_num_ctx_that_can_never_fit_is_a_clear_error_naming_the_bytes(client, server):
    r, _ = server
    client.chat(model="wide", messages=HI_, options={"num_predict": 1})
    loads, held = r.status()["models"]["wide"]["loads"], slot(r, "wide")
    with pytest.raises(ollama.ResponseError) as e:
        client.chat(model="wide", messages=HI_, options={**QUICK, "num_ctx": 2048})
    assert e.value.status_code == 507 and "num_ctx 2048" in e.value.error and "bytes" in e.value.error
    assert {c.name: c for c in r.models()}["wide"].spec.n_ctx == 2048  # its own config kept
    client.chat(model="wide", messages=HI_, options={"num_predict": 1})
    assert slot(r, "wide") == held and r.status()["models"]["wide"]["loads"] >= loads


def test_llamaindexs_way_reads_the_context_then_asks_for_it_on_the_loaded_model(client, server):
    r, _ = server
    client.chat(model="chat", messages=HI_, options=QUICK)
    info = client.show("chat").modelinfo
    window = next(int(v) for k, v in info.items() if "context_length" in k)  # as llama-index-llms-ollama reads it
    assert window == slot(r, "chat") == 512
    loads = r.status()["models"]["chat"]["loads"]
    out = client.chat(model="chat", messages=HI_, options={**QUICK, "num_ctx": window})
    assert out.done and r.status()["models"]["chat"]["loads"] == loads  # no reload: the context it has


# -- what clients are told ------------------------------------------------------------------------

def test_show_verbose_gives_the_arrays(client, server):
    assert client.show("chat").modelinfo["tokenizer.ggml.tokens"] is None
    # the client has no verbose argument: as Ollama's CLI (show --verbose) asks for it
    shown = httpx.post(server[1] + "/api/show", json={"model": "chat", "verbose": True}, timeout=60).json()
    tokens = shown["model_info"]["tokenizer.ggml.tokens"]
    assert isinstance(tokens, list) and len(tokens) > 100 and all(isinstance(t, str) for t in tokens[:10])


def test_the_small_cases_answer_as_ollama(client, server):
    _, base = server
    assert client.chat(model="chat", messages=HI_, options=QUICK).load_duration >= 0
    with pytest.raises(ollama.ResponseError) as e:
        client.chat(model="chat", messages=HI_, think=True)
    assert e.value.status_code == 400 and "does not support thinking" in e.value.error
    png = base64.b64encode(tinymodels.png(8, 8)).decode()
    with pytest.raises(ollama.ResponseError) as e:
        client.chat(model="chat", messages=[{**HI_[0], "images": [png]}])
    assert e.value.status_code == 400 and "vision" in e.value.error
    assert wire.chat_request({"messages": HI_, "think": "max"}, "m", False)[1]["reasoning_effort"] == "high"
    r = server[0]
    r.unload("bert")
    out = client.embed(model="bert", input="hello")
    assert out.load_duration > 0  # the load it waited for, measured
