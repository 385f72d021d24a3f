"""Continuous batching in the worker: many sequences of one model at once."""

from __future__ import annotations

import re
import threading
import time

import pytest

from pyllmrouter import ModelSpec
from pyllmrouter.config import ModelConfig
from pyllmrouter.devices import EmulatedInventory
from pyllmrouter.router import Router

NO_EOS = {"2": -100, "4": -100}  # the tiny models' end-of-generation tokens
TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}]
PROMPTS = ["hello world", "the model", "router memory", "fast token", "a GPU", "of the", "it is", "you and"]


SHARE_PROBE_CACHE = True


@pytest.fixture(scope="module")
def router(tiny, module_cache):
    models = [ModelConfig("p", ModelSpec(tiny["tiny-llama"], n_ctx=2048, n_seq_max=4)),
              ModelConfig("moe", ModelSpec(tiny["tiny-moe"], n_ctx=2048, n_seq_max=4)),
              ModelConfig("short", ModelSpec(tiny["tiny-llama"], n_ctx=256, n_seq_max=4)),
              ModelConfig("serial", ModelSpec(tiny["tiny-llama"], n_ctx=2048, n_seq_max=1)),
              ModelConfig("cold", ModelSpec(tiny["tiny-llama"], n_ctx=2048))]  # never loaded
    with Router(models, inventory=EmulatedInventory({"GPU0": 1 << 30}), margin=0) as r:
        yield r


def alone(router, model, prompt, **kw):
    return router.complete(model, prompt, temperature=0, logit_bias=NO_EOS, **kw)


def concurrently(fn, args_list):
    out, errors = {}, []

    def go(i, args):
        try:
            out[i] = fn(*args)
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=go, args=(i, a)) for i, a in enumerate(args_list)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    return [out[i] for i in range(len(args_list))]


@pytest.mark.parametrize("model", ["p", "moe"])
def test_same_tokens_alone_and_in_a_batch(router, model):
    solo = [alone(router, model, p, max_tokens=24)["choices"][0]["text"] for p in PROMPTS]
    batched = concurrently(lambda p: alone(router, model, p, max_tokens=24)["choices"][0]["text"],
                           [(p,) for p in PROMPTS])
    assert batched == solo
    assert len(set(solo)) > 1  # different prompts, different continuations


def test_concurrent_streams_are_independent(router):
    def stream(p):
        chunks = list(router.complete("p", p, temperature=0, logit_bias=NO_EOS, max_tokens=20, stream=True))
        return "".join(c["choices"][0]["text"] for c in chunks), chunks[-1]["choices"][0]["finish_reason"]

    expected = [alone(router, "p", p, max_tokens=20)["choices"][0]["text"] for p in PROMPTS[:6]]
    got = concurrently(stream, [(p,) for p in PROMPTS[:6]])
    assert [g[0] for g in got] == expected
    assert {g[1] for g in got} == {"length"}


def test_stop_strings_and_max_tokens_per_sequence(router):
    full = alone(router, "p", "hello world", max_tokens=30)["choices"][0]["text"]
    stop = full[8:11]
    assert stop and stop in full
    limited, stopped = concurrently(lambda kw: alone(router, "p", "hello world", **kw),
                                    [({"max_tokens": 3},), ({"max_tokens": 30, "stop": [stop]},)])
    assert limited["usage"]["completion_tokens"] == 3 and limited["choices"][0]["finish_reason"] == "length"
    assert stopped["choices"][0]["text"] == full[: full.index(stop)]
    assert stopped["choices"][0]["finish_reason"] == "stop"


def test_cancelling_a_stream_frees_its_slot(router):
    streams = [router.complete("p", p, logit_bias=NO_EOS, max_tokens=1500, stream=True) for p in PROMPTS[:4]]
    for s in streams:
        next(s)
    streams[0].close()  # a client goes away
    t0 = time.monotonic()
    fifth = alone(router, "p", "it is", max_tokens=4)  # needs the freed slot: all four were busy
    waited = time.monotonic() - t0
    assert fifth["usage"]["completion_tokens"] == 4
    for s in streams[1:]:
        s.close()
    assert waited < 5


def test_prefix_of_a_conversation_is_reused(router):
    turn1 = [{"role": "user", "content": "hello world " * 20}]
    first = router.chat("p", turn1, max_tokens=8, temperature=0)
    turn2 = turn1 + [first["choices"][0]["message"], {"role": "user", "content": "and the model"}]
    second = router.chat("p", turn2, max_tokens=8, temperature=0)
    cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached >= first["usage"]["prompt_tokens"] - 1


def test_chat_through_the_batch_uses_the_model_template(router):
    out = router.chat("p", [{"role": "user", "content": "hi"}], max_tokens=5, temperature=0)
    assert out["object"] == "chat.completion" and out["choices"][0]["message"]["role"] == "assistant"
    # ChatML markers + "user\nhi": more tokens than the bare text
    assert out["usage"]["prompt_tokens"] > 5


def test_requests_the_batch_cannot_serve_take_the_serial_path(router):
    from pyllmrouter.errors import RequestFailed

    busy = router.complete("p", "hello", logit_bias=NO_EOS, max_tokens=200, stream=True)
    next(busy)
    forced = {"type": "function", "function": {"name": "f"}}  # a forced tool: llama_cpp's grammar and tool call
    out = router.chat("p", [{"role": "user", "content": "hi"}], tools=TOOLS, tool_choice=forced, max_tokens=3,
                      temperature=0)
    assert out["choices"][0]["message"]["tool_calls"][0]["function"]["name"] == "f"  # after the batch
    assert sum(1 for _ in busy) > 0
    with pytest.raises(RequestFailed, match="logprobs"):  # what llama_cpp refuses, it refuses clearly
        router.complete("p", "hello", max_tokens=3, logprobs=2)
    again = alone(router, "p", "hello world", max_tokens=8)  # and the batch still works after it
    assert again["usage"]["completion_tokens"] == 8


def test_json_mode_constrains_the_output(router):
    out = router.chat("p", [{"role": "user", "content": "json"}], max_tokens=6, temperature=0.8, seed=1,
                      response_format={"type": "json_object"})
    text = out["choices"][0]["message"]["content"]
    # llama_cpp's JSON grammar: root ::= object, so the first character can only be "{"
    assert text.startswith("{"), text
    assert out["usage"]["completion_tokens"] >= 1


def test_prompt_longer_than_the_context_is_a_clear_error(router):
    from pyllmrouter.errors import RequestFailed

    with pytest.raises(RequestFailed, match="exceed context window"):
        router.complete("p", "hello " * 3000, max_tokens=2)


def test_a_full_shared_kv_cache_ends_the_longest_sequence_not_all(router):
    # four sequences of up to 150 tokens cannot share 256 cells: some end early, none fails
    outs = concurrently(lambda p: alone(router, "short", p, max_tokens=150), [(p,) for p in PROMPTS[:4]])
    lengths = sorted(o["usage"]["completion_tokens"] for o in outs)
    assert all(o["choices"][0]["finish_reason"] == "length" for o in outs)
    assert lengths[0] < 150 and sum(o["usage"]["total_tokens"] for o in outs) > 256


@pytest.mark.parametrize("model", ["p", "serial"])  # the batch, and llama_cpp's own completion
def test_a_prompt_of_token_ids_is_served_like_its_text(router, tiny, model):
    from llama_cpp import Llama

    tokens = Llama(str(tiny["tiny-llama"]), vocab_only=True, verbose=False).tokenize(b"hello world", special=True)
    as_text = alone(router, model, "hello world", max_tokens=8)
    for prompt in (tokens, [tokens]):  # OpenAI's token array, and its one-prompt batch shape
        out = alone(router, model, prompt, max_tokens=8)
        assert out["choices"][0]["text"] == as_text["choices"][0]["text"]
        assert out["usage"]["prompt_tokens"] == as_text["usage"]["prompt_tokens"] == len(tokens)


@pytest.mark.parametrize("model", ["p", "serial"])
def test_json_schema_constrains_completions(router, model):
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    fmt = {"type": "json_schema", "json_schema": {"name": "thing", "schema": schema}}
    text = router.complete(model, "x", max_tokens=64, temperature=0,
                           response_format=fmt)["choices"][0]["text"]
    assert re.match(r'\{\s*"a"\s*:', text), text  # the schema's one required key comes first


def test_a_bad_parameter_fails_before_anything_is_loaded_or_sent(router, tiny):
    from pyllmrouter import BadRequest
    from pyllmrouter.errors import RequestFailed

    for kw, param in (({"temperature": "hot"}, "temperature"), ({"prompt": ["a", "b"]}, "prompt"),
                      ({"logit_bias": {"x": 1}}, "logit_bias")):
        with pytest.raises(BadRequest) as e:
            router.complete("cold", **{"prompt": "hi", **kw})
        assert e.value.param == param
    assert router.status()["models"]["cold"]["state"] == "unloaded"
    # a token the model does not have is refused where the vocabulary is known, and the model serves on
    with pytest.raises(RequestFailed, match="token id 100000 is not in the model's vocabulary"):
        router.complete("p", [1, 100000], max_tokens=2)
    assert alone(router, "p", "hello", max_tokens=2)["usage"]["completion_tokens"] == 2


def test_a_step_takes_every_generating_token_then_prompts_in_admission_order():
    from pyllmrouter.batching import _Slot, allot

    generating = [_Slot(i, admitted=i) for i in range(3)]
    late, early = _Slot(3, pending=list(range(100)), admitted=9), _Slot(4, pending=list(range(50)), admitted=5)
    assert {s.seq: k for s, k in allot(generating + [late, early], 64)} == {0: 1, 1: 1, 2: 1, 4: 50, 3: 11}
    # the earliest prompt first: the later one waits for the next step rather than share
    assert {s.seq: k for s, k in allot([late, early] + generating, 40)} == {0: 1, 1: 1, 2: 1, 4: 37}
    assert sum(k for _, k in allot([_Slot(i, admitted=i) for i in range(10)], 4)) == 4  # never over n_batch


def test_tools_reach_the_template_in_the_batch_as_llama_cpp_passes_them(router):
    hi = [{"role": "user", "content": "hi"}]
    busy = router.complete("p", "hello", logit_bias=NO_EOS, max_tokens=1500, stream=True)
    next(busy)
    out = router.chat("p", hi, tools=TOOLS, max_tokens=6, temperature=0, logit_bias=NO_EOS)
    busy.cancel()
    assert sum(1 for _ in busy) < 1000  # served beside the busy stream, not after its 1500 tokens
    theirs = router.chat("serial", hi, tools=TOOLS, max_tokens=6, temperature=0, logit_bias=NO_EOS)  # llama_cpp's
    plain = router.chat("p", hi, max_tokens=6, temperature=0, logit_bias=NO_EOS)
    assert out["usage"]["prompt_tokens"] == theirs["usage"]["prompt_tokens"] > plain["usage"]["prompt_tokens"]
    assert out["choices"][0]["message"]["content"] == theirs["choices"][0]["message"]["content"]


def test_engine_counters_follow_what_the_batch_did(router):
    router.load("p")
    router.load("serial")
    before = router.engine_stats()["p"]
    outs = concurrently(lambda p: alone(router, "p", p, max_tokens=40), [(p,) for p in PROMPTS[:4]])
    forced = {"type": "function", "function": {"name": "f"}}
    router.chat("p", [{"role": "user", "content": "hi"}], tools=TOOLS, tool_choice=forced, max_tokens=3)
    stats = router.engine_stats()
    assert "serial" not in stats  # one slot: llama_cpp's own methods decode, no step counters
    d = {k: v - before[k] for k, v in stats["p"].items()}
    assert d["tokens_predicted"] == sum(o["usage"]["completion_tokens"] for o in outs) == 160
    assert d["prompt_tokens"] + d["prompt_tokens_cached"] == sum(o["usage"]["prompt_tokens"] for o in outs)
    assert d["prompt_tokens_cached"] == sum(o["usage"]["prompt_tokens_details"]["cached_tokens"] for o in outs)
    assert d["requests"] == 4 and d["serial_requests"] == 1
    # each sequence is in 40 decodes (its prompt, then a token for each of 39 more), several per decode
    assert d["busy_slots"] == 160 > d["n_decode"]
    assert 0 < d["decode_seconds"] < d["decode_seconds"] + d["send_seconds"] < d["step_seconds"]
