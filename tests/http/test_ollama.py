"""Ollama's API on the router, driven by Ollama's own Python client (``ollama``) and raw HTTP:
its documented calls, each answer against what the same request gets from llama-server's
OpenAI endpoint on the same model (a differential search over options), keep_alive as the
model's idle time and never as more memory, /api/ps's bytes against the router's own, and
Ollama's error shape under the server's key, Host and Origin rules."""

from __future__ import annotations

import base64
import json
import os
import socket
import subprocess
import sys
import time

import httpx
import ollama
import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pyllmrouter import ModelConfig, ModelSpec, Router, probe
from pyllmrouter.devices import EmulatedInventory

from pyllmrouter.router.options import known_keys
from pyllmrouter.router.services.sources import Sources
from pyllmrouter.server import ollama_wire as wire
from pyllmrouter.tools import scripted, tinymodels
from pyllmrouter.tools.hub import LocalHub

from test_live import serving, wait_for

SHARE_PROBE_CACHE = True
HI = [{"role": "user", "content": "hi"}]
WEATHER = [{"type": "function", "function": {"name": "get_weather", "description": "the weather in a city",
                                             "parameters": {"type": "object",
                                                            "properties": {"city": {"type": "string"}},
                                                            "required": ["city"]}}}]


@pytest.fixture(scope="module")
def models(tiny, projector, tmp_path_factory):
    d = tmp_path_factory.mktemp("ollama")
    think = scripted.write_scripted(d / "think.gguf", scripted.THINK_TEMPLATE, scripted.THINK_SCRIPT)
    tool = scripted.write_scripted(d / "tool.gguf", scripted.TOOL_TEMPLATE, scripted.TOOL_SCRIPT)
    story = scripted.write_scripted(d / "story.gguf", scripted.THINK_TEMPLATE, scripted.STORY_SCRIPT, loop=True)
    return [ModelConfig("think", ModelSpec(str(think), ("-np", "1"), n_ctx=1024)),
            ModelConfig("tool", ModelSpec(str(tool), ("-np", "1"), n_ctx=2048)),
            ModelConfig("story", ModelSpec(str(story), ("-np", "2", "--context-shift"), n_ctx=4096)),  # streams last until stopped
            ModelConfig("llama", ModelSpec(tiny["tiny-llama"], ("-np", "1"), n_ctx=512)),
            ModelConfig("org/vision:Q8_0", ModelSpec(tiny["tiny-llama"], ("-np", "1", "--mmproj", str(projector)),
                                                     n_ctx=512)),
            ModelConfig("bert", ModelSpec(tiny["tiny-bert"], ("--embedding",), n_ctx=512)),
            ModelConfig("pinned", ModelSpec(tiny["tiny-llama"], ("-np", "1"), n_ctx=512), persistent=True, ttl=600)]


@pytest.fixture(scope="module")
def server(models):
    with Router(models, inventory=EmulatedInventory({"GPU0": 1 << 30}), margin=0) as r, \
            serving(r, allowed_hosts=frozenset()) as base:  # serve's Host rule: local names only
        yield r, base


@pytest.fixture(scope="module")
def client(server):
    return ollama.Client(host=server[1], timeout=120)


def post(base: str, path: str, body, **kw) -> httpx.Response:
    return httpx.post(base + path, json=body, timeout=120, **kw)


# -- the client's documented calls ------------------------------------------------------------------

def test_the_clients_chat_whole_and_streamed_say_the_same(client):
    whole = client.chat(model="think", messages=HI)
    assert whole.message.content == "Hello there!" and whole.message.role == "assistant"
    assert whole.message.thinking == scripted.THINK_SCRIPT[1].lstrip("\n")
    assert whole.done and whole.done_reason == "stop"
    assert whole.prompt_eval_count > 0 and whole.eval_count > 0
    assert whole.total_duration >= whole.prompt_eval_duration + whole.eval_duration > 0
    parts = list(client.chat(model="think:latest", messages=HI, stream=True))
    assert [p.done for p in parts] == [False] * (len(parts) - 1) + [True]
    assert "".join(p.message.content for p in parts) == whole.message.content
    assert "".join(p.message.thinking or "" for p in parts) == whole.message.thinking
    assert (parts[-1].prompt_eval_count, parts[-1].eval_count) == (whole.prompt_eval_count, whole.eval_count)


def test_the_readmes_examples_run_unchanged_with_only_ollama_host_set(server):
    """ollama-python's README, as its users run it: the module's own client, found by OLLAMA_HOST."""
    _, base = server
    script = """
import asyncio, ollama
from ollama import chat, ChatResponse, AsyncClient
response: ChatResponse = chat(model='think', messages=[{'role': 'user', 'content': 'Why is the sky blue?'}])
print(response['message']['content'])
print(response.message.content)
stream = chat(model='think', messages=[{'role': 'user', 'content': 'Why is the sky blue?'}], stream=True)
print(''.join(chunk['message']['content'] for chunk in stream))
async def main():
    message = {'role': 'user', 'content': 'Why is the sky blue?'}
    print((await AsyncClient().chat(model='think', messages=[message]))['message']['content'])
    parts = [part['message']['content'] async for part in await AsyncClient().chat(model='think', messages=[message],
                                                                                    stream=True)]
    print(''.join(parts))
asyncio.run(main())
print(ollama.generate(model='think', prompt='Why is the sky blue?')['response'])
print(len(ollama.embed(model='bert', input='The sky is blue because of rayleigh scattering')['embeddings']))
print(sorted(m['model'] for m in ollama.list()['models'])[0])
print(ollama.show('think')['details']['format'])
print(len(ollama.ps()['models']) > 0)
"""
    out = subprocess.run([sys.executable, "-c", script], env={**os.environ, "OLLAMA_HOST": base},
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.splitlines() == ["Hello there!"] * 6 + ["1", "bert:latest", "gguf", "True"], out.stdout


def test_think_false_asks_the_template_for_no_thinking(client):
    out = client.chat(model="think", messages=HI, think=False, options={"num_predict": 8})
    assert not out.message.thinking  # the template closed the think block: none is parsed out


def test_the_clients_generate_whole_streamed_and_raw(client):
    whole = client.generate(model="think", prompt="hi")
    assert whole.response == "Hello there!" and whole.thinking == scripted.THINK_SCRIPT[1].lstrip("\n") and whole.done
    parts = list(client.generate(model="think", prompt="hi", stream=True))
    assert "".join(p.response for p in parts) == whole.response and parts[-1].done
    raw = client.generate(model="llama", prompt="once upon", raw=True, options={"num_predict": 4, "temperature": 0})
    assert raw.done_reason == "length" and raw.eval_count == 4
    again = "".join(p.response for p in client.generate(model="llama", prompt="once upon", raw=True, stream=True,
                                                        options={"num_predict": 4, "temperature": 0}))
    assert again == raw.response


def test_tool_calls_come_with_their_arguments_as_an_object_and_go_back(client):
    out = client.chat(model="tool", messages=[{"role": "user", "content": "the weather in Paris?"}], tools=WEATHER)
    (call,) = out.message.tool_calls
    assert call.function.name == "get_weather" and call.function.arguments == {"city": "Paris"}
    streamed = [p for p in client.chat(model="tool", messages=[{"role": "user", "content": "weather?"}],
                                       tools=WEATHER, stream=True) if p.message.tool_calls]
    assert [c.function.arguments for p in streamed for c in p.message.tool_calls] == [{"city": "Paris"}]
    # the call and its result sent back, as an agent loop does: the template takes both
    follow = client.chat(model="tool", tools=WEATHER, options={"num_predict": 4}, messages=[
        {"role": "user", "content": "the weather in Paris?"}, out.message,
        {"role": "tool", "content": "sunny, 21 C", "tool_name": "get_weather"}])
    assert follow.done


def test_an_image_becomes_prompt_tokens_of_a_model_with_a_projector(client):
    png = base64.b64encode(tinymodels.png(32, 32)).decode()
    text = client.chat(model="org/vision:Q8_0", messages=HI, options={"num_predict": 2})
    seen = client.chat(model="org/vision:Q8_0", messages=[{**HI[0], "images": [png]}], options={"num_predict": 2})
    assert seen.prompt_eval_count >= text.prompt_eval_count + 16  # the image's patches
    assert "vision" in client.show("org/vision:Q8_0").capabilities


def test_embed_and_the_older_embeddings(client, server):
    r, _ = server
    out = client.embed(model="bert", input=["hello world", "good night"])
    assert len(out.embeddings) == 2 and out.prompt_eval_count > 0
    for v in out.embeddings:
        assert abs(sum(x * x for x in v) - 1.0) < 1e-4  # normalized, as Ollama's are
    engine = r.embed("bert", ["hello world"])["data"][0]["embedding"]
    assert out.embeddings[0] == pytest.approx(engine, abs=1e-6)
    legacy = client.embeddings(model="bert", prompt="hello world").embedding
    norm = sum(x * x for x in legacy) ** 0.5
    assert norm != pytest.approx(1.0) and [x / norm for x in legacy] == pytest.approx(out.embeddings[0], abs=1e-5)
    cut = client.embed(model="bert", input="hello world", dimensions=8).embeddings[0]
    assert len(cut) == 8 and abs(sum(x * x for x in cut) - 1.0) < 1e-4


def test_list_show_version_and_the_root_as_ollamas_clients_read_them(client, server, models):
    _, base = server
    listed = {m.model: m for m in client.list().models}
    assert set(listed) == {"think:latest", "tool:latest", "story:latest", "llama:latest", "org/vision:Q8_0",
                           "bert:latest", "pinned:latest"}
    llama = listed["llama:latest"]
    assert llama.details.format == "gguf" and llama.details.family == "llama" and len(llama.digest) == 64
    assert llama.size == os.path.getsize(next(c for c in models if c.name == "llama").spec.path)
    shown = client.show("tool")
    assert shown.capabilities == ["completion", "tools"] and "<tool_call>" in shown.template
    assert shown.modelinfo["general.architecture"] == "llama" and shown.modelinfo["llama.context_length"] > 0
    assert client.show("bert").capabilities == ["embedding"]
    assert "thinking" in client.show("think").capabilities
    assert httpx.get(base + "/api/version").json() == {"version": wire.VERSION}
    assert httpx.get(base + "/").text == "Ollama is running"
    assert httpx.head(base + "/").status_code == 200
    assert "<html" in httpx.get(base + "/", headers={"accept": "text/html"}).text.lower()  # a browser: the page


def test_ps_shows_the_bytes_the_router_holds_to_the_byte(client, server):
    r, _ = server
    client.chat(model="llama", messages=HI, options={"num_predict": 1})
    shown = {m.model: m for m in client.ps().models}
    st = r.status()
    for name, m in st["models"].items():
        key = wire.ollama_name(name)
        if m["state"] != "loaded":
            assert key not in shown
            continue
        assert shown[key].size == sum(m["held"].values()) > 0
        assert shown[key].size_vram == m["held"].get("GPU0", 0)  # the emulated GPU's bytes
        assert shown[key].context_length == wire.slot_context(m["context"])  # a request's, per slot


# -- the same answers as the OpenAI endpoint ---------------------------------------------------------

OPTION_VALUES = {
    "num_predict": st.integers(1, 6), "temperature": st.sampled_from([0.0, 0.7, 1.3]), "top_k": st.integers(1, 50),
    "top_p": st.floats(0.1, 1.0), "min_p": st.floats(0.0, 0.3), "repeat_penalty": st.floats(1.0, 1.5),
    "presence_penalty": st.floats(0.0, 1.0), "frequency_penalty": st.floats(0.0, 1.0),
    "repeat_last_n": st.integers(0, 64), "stop": st.lists(st.sampled_from(["a", "e", " the"]), max_size=2),
}


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(options=st.fixed_dictionaries({}, optional=OPTION_VALUES), stream=st.booleans(),
       prompt=st.sampled_from(["hi", "once upon a time", "tell me"]))
def test_chat_answers_what_the_openai_endpoint_answers_for_any_options(server, options, stream, prompt):
    """The translation adds and loses nothing a client sees: the text, the finish, the counts
    (a fixed seed: the same sampling on both paths)."""
    r, base = server
    messages = [{"role": "user", "content": prompt}]
    ours = post(base, "/api/chat", {"model": "llama", "messages": messages, "stream": stream,
                                     "options": {**options, "seed": 7}})
    assert ours.status_code == 200, ours.text
    objects = [json.loads(line) for line in ours.text.splitlines()] if stream else [ours.json()]
    text = "".join(o["message"]["content"] for o in objects)
    final = objects[-1]
    peer = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0).chat.completions.create(
        model="llama", messages=messages, seed=7,
        extra_body={wire.OPTIONS[k]: v for k, v in options.items()})
    assert text == peer.choices[0].message.content
    assert final["done_reason"] == peer.choices[0].finish_reason
    assert (final["prompt_eval_count"], final["eval_count"]) == (peer.usage.prompt_tokens,
                                                                 peer.usage.completion_tokens)


def test_every_option_is_a_key_llama_cpps_handlers_read():
    keys = known_keys()
    assert keys, "the extension is built: llama.cpp's request keys are known"
    assert set(wire.OPTIONS.values()) <= keys
    assert {"chat_template_kwargs", "reasoning_effort", "response_format", "input_prefix", "input_suffix",
            "embd_normalize", "stream_options"} <= keys


def test_format_constrains_the_answer(client):
    schema = {"type": "string", "enum": ["yes", "no"]}
    out = client.chat(model="think", messages=HI, format=schema, options={"num_predict": 64})
    assert json.loads(out.message.content) in ("yes", "no")
    gen = client.generate(model="think", prompt="hi", format=schema, options={"num_predict": 64})
    assert json.loads(gen.response) in ("yes", "no")


# -- keep_alive: the model's idle time, never more memory ----------------------------------------------

def state(r: Router, name: str) -> str:
    return r.status()["models"][name]["state"]


def test_keep_alive_sets_the_models_idle_time(client, server):
    r, base = server
    client.chat(model="think", messages=HI, keep_alive=-1)
    assert r.status()["models"]["think"]["ttl"] is None
    (ps,) = [m for m in client.ps().models if m.model == "think:latest"]
    assert ps.expires_at.year == 9999
    client.chat(model="think", messages=HI, keep_alive="1h30m")
    assert r.status()["models"]["think"]["ttl"] == 5400
    (ps,) = [m for m in client.ps().models if m.model == "think:latest"]
    assert 5390 < ps.expires_at.timestamp() - time.time() <= 5401
    client.chat(model="think", messages=HI, keep_alive=0)  # unloaded once the answer is given
    wait_for(lambda: state(r, "think") == "unloaded", 10, "the unload after keep_alive 0")
    # no prompt: a load, and with keep_alive 0 an unload, as Ollama's clients preload and unload
    loaded = client.generate(model="think", prompt="")
    assert loaded.done_reason == "load" and state(r, "think") == "loaded"
    assert client.chat(model="think", messages=[], keep_alive=0).done_reason == "unload"
    assert state(r, "think") == "unloaded"
    client.chat(model="think", messages=HI)  # none given: the model's own idle time again
    assert r.status()["models"]["think"]["ttl"] == next(c for c in r.models() if c.name == "think").ttl
    bad = post(base, "/api/chat", {"model": "think", "messages": HI, "keep_alive": "soon"})
    assert bad.status_code == 400 and "invalid duration" in bad.json()["error"]


def test_keep_alive_0_with_no_prompt_unloads_once_the_requests_in_flight_end(client, server):
    r, base = server
    client.chat(model="story", messages=HI, options={"num_predict": 1})
    with httpx.stream("POST", base + "/api/chat", json={"model": "story", "messages": HI,
                                                        "options": {"num_predict": 100000}}, timeout=60) as s:
        next(s.iter_lines())  # under way
        assert client.chat(model="story", messages=[], keep_alive=0).done_reason == "unload"
        assert state(r, "story") == "loaded"  # its stream still runs
    wait_for(lambda: state(r, "story") == "unloaded", 10, "the unload once the stream ended")


def test_a_request_without_keep_alive_puts_the_models_own_idle_time_back_whatever_its_api(client, server):
    r, _ = server
    client.chat(model="llama", messages=HI, options={"num_predict": 1}, keep_alive="90m")
    assert r.status()["models"]["llama"]["ttl"] == 5400
    r.chat("llama", HI, max_tokens=1)  # the OpenAI endpoint's request, through the Python API
    assert r.status()["models"]["llama"]["ttl"] == next(c for c in r.models() if c.name == "llama").ttl != 5400


def test_a_persistent_model_keeps_its_own_idle_time(client, server):
    r, _ = server
    client.chat(model="pinned", messages=HI, options={"num_predict": 1}, keep_alive="1s")
    assert r.status()["models"]["pinned"]["ttl"] == 600
    time.sleep(2.5)
    assert state(r, "pinned") == "loaded"


def test_empty_input_loads_the_embedding_model_and_embeds_nothing(client, server):
    assert client.embed(model="bert", input=[]).embeddings == []
    assert client.embeddings(model="bert", prompt="").embedding == []
    assert client.pull("bert:latest").status == "success"  # listed already: nothing to pull


def test_keep_alive_for_ever_is_still_evicted_for_a_model_that_needs_its_memory(tiny):
    """keep_alive is an idle time, not a pin: admission stays exact."""
    a, b = (ModelConfig(n, ModelSpec(tiny["tiny-llama"], ("-np", "1"), n_ctx=512)) for n in ("a", "b"))
    need = probe(a.spec).total
    with Router([a, b], inventory=EmulatedInventory({"GPU0": need + need // 2}), margin=0) as r, \
            serving(r) as base:
        c = ollama.Client(host=base, timeout=120)
        c.chat(model="a", messages=HI, options={"num_predict": 1}, keep_alive=-1)
        c.chat(model="b", messages=HI, options={"num_predict": 1})
        assert (state(r, "a"), state(r, "b")) == ("unloaded", "loaded")
        assert r.scheduler.check_invariant()["GPU0"] <= need + need // 2


# -- errors, in Ollama's shape -----------------------------------------------------------------------

def test_errors_are_ollamas_and_take_nothing_down(client, server):
    r, base = server
    with pytest.raises(ollama.ResponseError) as e:
        client.chat(model="nope", messages=HI)
    assert e.value.status_code == 404 and "nope" in e.value.error
    cases = [("/api/chat", b"{not json", 400), ("/api/chat", b'{"messages": []}', 400),
             ("/api/chat", b'{"model": "llama", "messages": "hi"}', 400),
             ("/api/generate", b'{"model": "llama", "prompt": "hi", "format": 3}', 400),
             ("/api/generate", b'{"model": "llama", "prompt": "hi", "think": "very"}', 400),
             ("/api/embed", b'{"model": "bert", "input": [1, 2]}', 400),
             ("/api/chat", b'{"model": "llama", "messages": [{"role": "user", "content": "hi"}], '
                           b'"options": {"num_ctx": "big"}}', 400),
             ("/api/create", b'{"model": "x"}', 501), ("/api/copy", b'{"source": "a", "destination": "b"}', 501),
             ("/api/push", b'{"model": "x"}', 501),
             ("/api/chat", b'{"model": "llama", "messages": [{"role": "assistant", "content": "x", '
                           b'"tool_calls": "abc"}]}', 400),
             ("/api/chat", b'{"model": "llama", "messages": [{"role": "assistant", "content": "x", '
                           b'"tool_calls": [{"function": "f"}]}]}', 400),
             ("/api/chat", b'{"model": "llama", "messages": [{"role": "user", "content": 5}]}', 400),
             ("/api/chat", b'{"model": "llama", "messages": [], "tools": "abc"}', 400),
             ("/api/chat", b'{"model": "llama", "messages": [], "stream": "no"}', 400),
             ("/api/chat", b'{"model": "llama", "messages": [], "keep_alive": "nan"}', 400),
             ("/api/generate", b'{"model": "llama", "prompt": "hi", "system": 5}', 400),
             ("/api/chat", b'{"model": "bert", "messages": [{"role": "user", "content": "hi"}]}', 400),
             ("/api/embed", b'{"model": "llama", "input": "hi"}', 400), ("/api/nothing", b"{}", 404)]
    loaded_before = {n for n, m in r.status()["models"].items() if m["state"] == "loaded"}
    for path, body, status in cases:
        got = httpx.post(base + path, content=body, timeout=30)
        assert got.status_code == status, (path, body, got.text)
        assert isinstance(got.json()["error"], str) and got.json()["error"], got.text
    assert httpx.get(base + "/api/chat").status_code == 404 and "error" in httpx.get(base + "/api/chat").json()
    loaded_after = {n for n, m in r.status()["models"].items() if m["state"] == "loaded"}
    assert loaded_before <= loaded_after  # nothing unloaded by any of them
    # the engine's own refusal (a prompt past the context), with its status
    long = post(base, "/api/chat", {"model": "llama", "messages": [{"role": "user", "content": "word " * 2000}],
                                    "stream": False})
    assert long.status_code == 400 and isinstance(long.json()["error"], str)
    assert client.chat(model="llama", messages=HI, options={"num_predict": 1}).done  # still serving


def test_the_servers_key_host_and_origin_rules_hold_in_ollamas_shape(tiny):
    cfg = ModelConfig("m", ModelSpec(tiny["tiny-llama"], ("-np", "1"), n_ctx=512))
    with Router([cfg]) as r, serving(r, api_key="sekrit") as base:
        anonymous = httpx.post(base + "/api/chat", json={"model": "m", "messages": HI})
        assert anonymous.status_code == 401 and isinstance(anonymous.json()["error"], str)
        with pytest.raises(ollama.ResponseError):
            ollama.Client(host=base).list()
        keyed = ollama.Client(host=base, headers={"Authorization": "Bearer sekrit"})
        assert keyed.chat(model="m", messages=HI, options={"num_predict": 1}).done


def test_a_page_of_another_site_and_a_rebound_host_are_refused_in_ollamas_shape(server):
    """No key asked (Ollama's default): a page of another site still cannot drive the API."""
    r, base = server
    foreign = httpx.post(base + "/api/chat", json={"model": "think", "messages": HI},
                         headers={"origin": "https://evil.example"})
    assert foreign.status_code == 403 and isinstance(foreign.json()["error"], str)
    rebound = httpx.get(base + "/api/tags", headers={"host": "evil.example"})
    assert rebound.status_code in (403, 421) and isinstance(rebound.json()["error"], str)
    assert r.status()["models"]["think"]["leases"] == 0


# -- a client that leaves stops the work --------------------------------------------------------------

def test_a_client_gone_from_a_stream_frees_its_slot(server):
    r, base = server
    host, port = base.removeprefix("http://").split(":")
    body = json.dumps({"model": "story", "messages": HI, "options": {"num_predict": 100000}}).encode()

    def busy() -> int:
        reply, _ = r.call("story", "GET", "/slots")
        return sum(1 for s in reply.json() if s["is_processing"])

    s = socket.create_connection((host, int(port)))
    s.sendall(b"POST /api/chat HTTP/1.1\r\nHost: %s:%s\r\nContent-Type: application/json\r\n"
              b"Content-Length: %d\r\n\r\n%s" % (host.encode(), port.encode(), len(body), body))
    got = b""
    while b'"done":false' not in got:  # the answer is under way
        got += s.recv(65536)
    wait_for(lambda: busy() == 1, 30, "the generation")
    s.close()
    wait_for(lambda: busy() == 0, 5, "the slot to be freed")


# -- pull and delete: llama.cpp's cache ------------------------------------------------------------------

@pytest.mark.slow
def test_pull_streams_progress_then_serves_and_delete_removes(tiny, monkeypatch):
    with LocalHub({"test/tiny": {"tiny-Q8_0.gguf": tiny["tiny-llama"]}}) as endpoint:
        monkeypatch.setenv("MODEL_ENDPOINT", endpoint)
        with Router([], inventory=EmulatedInventory({"GPU0": 1 << 30}), margin=0,
                    sources=Sources(cache=True)) as r, serving(r) as base:
            c = ollama.Client(host=base, timeout=120)
            lines = list(c.pull("test/tiny:Q8_0", stream=True))
            assert lines[0].status == "pulling manifest" and lines[-1].status == "success"
            assert "test/tiny:Q8_0" in {m.model for m in c.list().models}
            assert c.chat(model="test/tiny:Q8_0", messages=HI, options={"num_predict": 1}).done
            assert c.pull("test/tiny:Q8_0").status == "success"  # there already
            with pytest.raises(ollama.ResponseError):
                list(c.pull("test/absent:Q8_0", stream=True))
            assert c.delete("test/tiny:Q8_0").status == "success"
            assert "test/tiny:Q8_0" not in {m.model for m in c.list().models}
            with pytest.raises(ollama.ResponseError) as e:
                c.delete("test/tiny:Q8_0")
            assert e.value.status_code == 404


# -- the pure parts ------------------------------------------------------------------------------------

@pytest.mark.parametrize("given_, seconds", [(300, 300.0), ("300", 300.0), ("5m", 300.0), ("1h30m", 5400.0),
                                             ("1.5h", 5400.0), ("-1", -1.0), ("-1m", -60.0), (0, 0.0),
                                             ("0", 0.0), ("250ms", 0.25), (None, None)])
def test_keep_alive_reads_ollamas_durations(given_, seconds):
    assert wire.keep_alive_seconds(given_) == seconds


@pytest.mark.parametrize("bad", ["soon", "5 m", "m", "", True, [1], float("nan"), "nan", "inf", "-inf", "1e999",
                                 float("inf")])
def test_keep_alive_refuses_what_is_no_duration(bad):
    with pytest.raises(wire.OllamaError):
        wire.keep_alive_seconds(bad)


def test_names_as_ollamas_clients_send_them():
    assert wire.ollama_name("llama") == "llama:latest"
    assert wire.ollama_name("org/repo:Q4_K_M") == "org/repo:Q4_K_M"
    assert wire.ollama_name("host:8080/model") == "host:8080/model:latest"
    assert wire.listed_candidates("llama:latest") == ["llama:latest", "llama"]
    assert wire.listed_candidates("llama:7b") == ["llama:7b"]
