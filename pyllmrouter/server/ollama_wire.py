"""Ollama's API in llama-server's terms and back (pure: no I/O, no clock of its own).

    /api/chat, /api/generate ──chat_request / generate_request──▶ (engine path, body)
        /v1/chat/completions (messages, tools, format, think, images), /completion (raw),
        /infill (suffix); ``options`` renamed to llama.cpp's request keys (OPTIONS), load-time
        options (num_gpu, num_thread...) named back as ignored: the model is loaded already
    engine reply ──Translator.feed(SSE chunk) / Translator.whole(JSON)──▶ Ollama's objects
        one NDJSON object per delta ("message" or "response", "thinking"), tool calls whole
        (arguments as an object), then the final one: done_reason, counts, durations (ns)

Nothing here restates a llama.cpp default: an option absent from the request is absent
from the engine's, and llama.cpp's parser decides it.
"""

from __future__ import annotations

import base64
import json
import math
import re
from datetime import datetime, timezone
from collections.abc import Callable, Iterable
from typing import Any

__all__ = ["OllamaError", "VERSION", "OPTIONS", "IGNORED", "ollama_name", "listed_candidates", "keep_alive_seconds",
           "chat_request", "generate_request", "embed_request", "Translator", "timestamp", "details",
           "capabilities", "model_info", "normalize", "lines", "parameters", "streamed", "truncating", "refusal",
           "slot_context", "context_asked", "total_context", "exceeded", "turn_starts", "kept_turns", "cut_prompt",
           "TOO_LONG"]

VERSION = "0.12.6"  # the Ollama API this mirrors (/api/version): its chat, generate, embed, think, tools
# Ollama's options -> llama.cpp's request keys (tools/server's params_from_json_cmpl), by name only
OPTIONS = {
    "num_predict": "n_predict", "temperature": "temperature", "top_k": "top_k", "top_p": "top_p", "min_p": "min_p",
    "typical_p": "typical_p", "seed": "seed", "stop": "stop", "repeat_penalty": "repeat_penalty",
    "repeat_last_n": "repeat_last_n", "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty", "mirostat": "mirostat", "mirostat_tau": "mirostat_tau",
    "mirostat_eta": "mirostat_eta", "num_keep": "n_keep",
}
# options of a model's load (or gone from llama.cpp): the model here is loaded as its preset says
IGNORED = frozenset({"num_gpu", "main_gpu", "num_thread", "num_batch", "use_mmap", "use_mlock", "low_vram",
                     "vocab_only", "numa", "f16_kv", "logits_all", "embedding_only", "penalize_newline", "tfs_z",
                     "num_gqa", "rope_frequency_base", "rope_frequency_scale"})
_DURATION = re.compile(r"([0-9]*\.?[0-9]+)(ns|us|µs|ms|s|m|h)")
TOO_LONG = "the input length exceeds the context length"  # Ollama's errorInputTooLong (400)
_BATCH = re.compile(r"\((\d+) tokens\) is too large to process.*current batch size: (\d+)")
_UNITS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}


class OllamaError(Exception):
    """A request refused in Ollama's shape: ``{"error": message}`` with ``status``."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status, self.message = status, message


# -- names --------------------------------------------------------------------------------

def ollama_name(name: str) -> str:
    """A listed model as Ollama's clients name it: ``name:tag``, ``:latest`` where it has none."""
    return name if ":" in name.rsplit("/", 1)[-1] else f"{name}:latest"


def listed_candidates(name: str) -> list[str]:
    """The names a client's ``name`` may mean here, in order: as given, then without ``:latest``."""
    out = [name]
    if name.endswith(":latest"):
        out.append(name[: -len(":latest")])
    return out


def keep_alive_seconds(value: Any) -> float | None:
    """Ollama's keep_alive: seconds (a number, or a string of one), or a Go duration
    ("5m", "1h30m", "-1s"); below 0, for ever.  None: absent."""
    if value is None:
        return None
    if isinstance(value, bool):
        raise OllamaError(400, f"keep_alive: {value!r} is not a duration")
    if isinstance(value, (int, float)):
        if not math.isfinite(value):
            raise OllamaError(400, f"keep_alive: {value!r} is not a duration")
        return float(value)
    if not isinstance(value, str):
        raise OllamaError(400, f"keep_alive: {value!r} is not a duration")
    text = value.strip()
    try:
        seconds = float(text)
    except ValueError:
        sign = -1.0 if text.startswith("-") else 1.0
        body = text.lstrip("+-")
        parts = _DURATION.findall(body)
        if not body or "".join(n + u for n, u in parts) != body:
            raise OllamaError(400, f'time: invalid duration "{value}"') from None
        seconds = sign * sum(float(n) * _UNITS[u] for n, u in parts)
    if not math.isfinite(seconds):
        raise OllamaError(400, f'time: invalid duration "{value}"')
    return seconds


# -- requests -----------------------------------------------------------------------------

def _options(req: dict[str, Any]) -> tuple[dict[str, Any], list[str], int | None]:
    """(llama.cpp's keys, the options ignored, num_ctx asked)."""
    options = req.get("options") or {}
    if not isinstance(options, dict):
        raise OllamaError(400, "options must be an object")
    out, ignored = {}, []
    for key, value in options.items():
        if key in OPTIONS:
            out[OPTIONS[key]] = value
        elif key != "num_ctx":
            ignored.append(key)
    num_ctx = options.get("num_ctx")
    if num_ctx is not None and (isinstance(num_ctx, bool) or not isinstance(num_ctx, int)):
        raise OllamaError(400, f"options.num_ctx must be an integer, not {num_ctx!r}")
    return out, sorted(ignored), num_ctx


def _format(fmt: Any) -> dict[str, Any] | None:
    if fmt in (None, ""):
        return None
    if fmt == "json":
        return {"type": "json_object"}
    if isinstance(fmt, dict):
        return {"type": "json_schema", "json_schema": {"name": "format", "schema": fmt}}
    raise OllamaError(400, f'format must be "json" or a JSON schema, not {fmt!r}')


def _think(think: Any) -> dict[str, Any]:
    if think is None:
        return {}
    if isinstance(think, bool):
        return {"chat_template_kwargs": {"enable_thinking": think}}
    if think in ("low", "medium", "high"):
        return {"reasoning_effort": think}
    if think == "max":  # Ollama's most: the highest effort llama.cpp's templates take
        return {"reasoning_effort": "high"}
    raise OllamaError(400, f'think must be true, false, "low", "medium", "high" or "max", not {think!r}')


def _image_url(image: Any) -> dict[str, Any]:
    if not isinstance(image, str):
        raise OllamaError(400, "images must be base64-encoded strings")
    try:
        head = base64.b64decode(image[:24] + "=" * (-len(image[:24]) % 4), validate=False)
    except ValueError:
        raise OllamaError(400, "an image is not valid base64") from None
    kind = "png" if head.startswith(b"\x89PNG") else "gif" if head.startswith(b"GIF8") else \
        "webp" if head[8:12] == b"WEBP" else "bmp" if head.startswith(b"BM") else "jpeg"
    return {"type": "image_url", "image_url": {"url": f"data:image/{kind};base64,{image}"}}


def _content(text: Any, images: Any) -> Any:
    if images in (None, []):
        return text if text is not None else ""
    if not isinstance(images, list):
        raise OllamaError(400, "images must be a list of base64-encoded strings")
    parts: list[dict[str, Any]] = [_image_url(i) for i in images]
    if text:
        parts.append({"type": "text", "text": text})
    return parts


def _message(m: Any, i: int) -> dict[str, Any]:
    if not isinstance(m, dict) or not isinstance(m.get("role"), str):
        raise OllamaError(400, f"messages[{i}] must be an object with a role")
    if m.get("content") is not None and not isinstance(m["content"], str):
        raise OllamaError(400, f"messages[{i}].content must be a string")
    out: dict[str, Any] = {"role": m["role"], "content": _content(m.get("content"), m.get("images"))}
    calls = m.get("tool_calls")
    if calls:
        if not isinstance(calls, list):
            raise OllamaError(400, f"messages[{i}].tool_calls must be a list")
        out["tool_calls"] = []
        for j, call in enumerate(calls):
            fn = call.get("function") if isinstance(call, dict) else None
            if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                raise OllamaError(400, f"messages[{i}].tool_calls[{j}] must be an object with a function "
                                       f"that has a name")
            args = fn.get("arguments", {})
            if not isinstance(args, (dict, str)):
                raise OllamaError(400, f"messages[{i}].tool_calls[{j}].function.arguments must be an object")
            out["tool_calls"].append({"id": call.get("id") or f"call_{i}_{j}", "type": "function",
                                      "function": {"name": fn.get("name", ""),
                                                   "arguments": args if isinstance(args, str) else json.dumps(args)}})
    for key, to in (("tool_name", "name"), ("tool_call_id", "tool_call_id"), ("thinking", "reasoning_content")):
        if m.get(key) is not None and not isinstance(m[key], str):
            raise OllamaError(400, f"messages[{i}].{key} must be a string")
        if m.get(key):
            out[to] = m[key]
    return out


def _common(req: dict[str, Any], model: str, stream: bool) -> tuple[dict[str, Any], list[str], int | None]:
    sampling, ignored, num_ctx = _options(req)
    body: dict[str, Any] = {"model": model, "stream": stream, **sampling}
    return body, ignored, num_ctx


def _flag(req: dict[str, Any], key: str) -> bool:
    """``key``: true unless false (Ollama's default for ``stream`` and ``truncate``);
    anything but a boolean is refused."""
    value = req.get(key, True)
    if value is None:
        return True
    if not isinstance(value, bool):
        raise OllamaError(400, f"{key} must be true or false, not {value!r}")
    return value


def streamed(req: dict[str, Any]) -> bool:
    return _flag(req, "stream")


def chat_request(req: dict[str, Any], model: str, stream: bool) -> tuple[str, dict[str, Any], list[str], int | None]:
    """/api/chat as llama-server's /v1/chat/completions: (path, body, options ignored, num_ctx)."""
    messages = req.get("messages") or []
    if not isinstance(messages, list):
        raise OllamaError(400, "messages must be a list")
    body, ignored, num_ctx = _common(req, model, stream)
    body["messages"] = [_message(m, i) for i, m in enumerate(messages)]
    tools = req.get("tools")
    if tools:
        if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
            raise OllamaError(400, "tools must be a list of objects")
        body["tools"] = tools
    return _templated(req, body, stream), body, ignored, num_ctx


def _templated(req: dict[str, Any], body: dict[str, Any], stream: bool) -> str:
    """``body`` (messages set) completed for /v1/chat/completions: format, think, usage."""
    fmt = _format(req.get("format"))
    if fmt is not None:
        body["response_format"] = fmt
    body.update(_think(req.get("think")))
    if stream:
        body["stream_options"] = {"include_usage": True}
    return "/v1/chat/completions"


def generate_request(req: dict[str, Any], model: str,
                     stream: bool) -> tuple[str, dict[str, Any], list[str], int | None]:
    """/api/generate: the prompt in the model's chat template (/v1/chat/completions), as it
    is (``raw``: /completion), or between ``prompt`` and ``suffix`` (/infill)."""
    prompt, suffix = req.get("prompt") or "", req.get("suffix")
    if not isinstance(prompt, str) or any(req.get(k) is not None and not isinstance(req[k], str)
                                          for k in ("suffix", "system", "template")):
        raise OllamaError(400, "prompt, suffix, system and template must be strings")
    body, ignored, num_ctx = _common(req, model, stream)
    if req.get("template"):
        ignored.append("template")
    fmt = _format(req.get("format"))  # checked for every form of the request
    if suffix:
        body.update(input_prefix=prompt, input_suffix=suffix)
        return "/infill", body, ignored, num_ctx
    if req.get("raw"):
        if req.get("images"):
            raise OllamaError(400, "images need the model's template: raw prompts take none")
        body["prompt"] = prompt
        if fmt is not None:
            body["response_format"] = fmt
        return "/completion", body, ignored, num_ctx
    messages = [{"role": "system", "content": req["system"]}] if req.get("system") else []
    messages.append({"role": "user", "content": _content(prompt, req.get("images"))})
    body["messages"] = messages
    return _templated(req, body, stream), body, ignored, num_ctx


def embed_request(req: dict[str, Any], model: str, legacy: bool) -> dict[str, Any]:
    """/api/embed (``input``: a string or a list) or /api/embeddings (``prompt``) as
    /v1/embeddings; the legacy endpoint's vector is not normalized, as Ollama's is not."""
    if legacy:
        text = req.get("prompt", "")
        if not isinstance(text, str):
            raise OllamaError(400, "prompt must be a string")
        return {"model": model, "input": text, "embd_normalize": -1}
    given = req.get("input", "")
    if not isinstance(given, (str, list)) or (isinstance(given, list) and
                                              not all(isinstance(t, str) for t in given)):
        raise OllamaError(400, "input must be a string or a list of strings")
    return {"model": model, "input": given}


def normalize(vector: list[float], dimensions: int | None) -> list[float]:
    """``vector`` cut to ``dimensions`` and scaled to length 1, as Ollama's ``dimensions`` does."""
    if not dimensions:
        return vector
    cut = vector[:dimensions]
    norm = math.sqrt(sum(x * x for x in cut)) or 1.0
    return [x / norm for x in cut]


# -- context: what a request gets, and what does not fit --------------------------------------

def truncating(req: dict[str, Any]) -> bool:
    return _flag(req, "truncate")


def refusal(model: str, caps: list[str], req: dict[str, Any], kind: str) -> OllamaError | None:
    """What Ollama answers a request that asks ``model`` for what its capabilities
    (``capabilities``) lack: an embedding model's chat or generate, thinking, images."""
    if "completion" not in caps:
        return OllamaError(400, f'"{model}" does not support {kind}: it is an embedding model')
    if req.get("think") not in (None, False) and "thinking" not in caps:
        return OllamaError(400, f'"{model}" does not support thinking')
    messages = req.get("messages") if isinstance(req.get("messages"), list) else []
    images = req.get("images") or any(isinstance(m, dict) and m.get("images") for m in messages)
    if images and "vision" not in caps:
        return OllamaError(400, f"{model} does not support vision")
    return None


def slot_context(context: dict[str, Any] | None) -> int | None:
    """The tokens one request may hold in the engine (``context``: a model's status
    ``context``): llama.cpp's n_ctx_seq, its context over its slots unless their KV is
    unified, and never past the training context (llama-server caps it there).  None: unknown."""
    if not context or not context.get("n_ctx"):
        return None
    streams = 1 if context.get("unified") else max(1, int(context.get("slots") or 1))
    per_slot = int(context["n_ctx"]) // streams
    train = context.get("n_ctx_train")
    return min(per_slot, int(train)) if train else per_slot


def context_asked(num_ctx: int | None, context: dict[str, Any] | None) -> int | None:
    """The context per slot a request's ``num_ctx`` needs the model loaded with (capped at
    the training context, as Ollama caps it); None: the loaded one gives it already."""
    have = slot_context(context)
    if num_ctx is None or have is None:
        return None
    if num_ctx < 1:
        raise OllamaError(400, f"options.num_ctx must be at least 1, not {num_ctx}")
    train = (context or {}).get("n_ctx_train")
    want = min(num_ctx, int(train)) if train else num_ctx
    return want if want > have else None


def total_context(context: dict[str, Any], per_slot: int) -> int:
    """The ``-c`` that gives each of the model's slots ``per_slot`` tokens."""
    return per_slot if context.get("unified") else per_slot * max(1, int(context.get("slots") or 1))


def exceeded(status: int, body: bytes) -> tuple[int, int] | None:
    """(the input's tokens, the most the engine takes) where the engine refused a request
    for its length (llama-server's exceed_context_size_error, or an embedding longer than
    its batch); None for any other reply."""
    if status < 400:
        return None
    try:
        err = json.loads(body).get("error")
    except (ValueError, AttributeError):
        return None
    if not isinstance(err, dict):
        return None
    if err.get("type") == "exceed_context_size_error" and err.get("n_ctx"):
        return int(err.get("n_prompt_tokens") or 0), int(err["n_ctx"])
    found = _BATCH.search(str(err.get("message") or ""))
    return (int(found.group(1)), int(found.group(2))) if found else None


def turn_starts(messages: list[dict[str, Any]]) -> list[int]:
    """Where a conversation may begin once its oldest turns are dropped: at each user
    message after the first message that is not a system one (a turn is a user message and
    what follows it, so an assistant's tool call stays with its result), oldest first."""
    first = next((i for i, m in enumerate(messages) if m.get("role") != "system"), len(messages))
    return [i for i, m in enumerate(messages) if i > first and m.get("role") == "user"]


def kept_turns(messages: list[dict[str, Any]], start: int) -> list[dict[str, Any]]:
    """The conversation from ``start`` on, with every system message before it kept."""
    return [m for m in messages[:start] if m.get("role") == "system"] + messages[start:]


def cut_prompt(tokens: list[int], drop: int, keep: int) -> list[int]:
    """A prompt's tokens with ``drop`` of them removed after its first ``keep`` (Ollama's
    num_keep), as Ollama's runner truncates a prompt longer than its context."""
    keep = max(0, min(keep, len(tokens)))
    return tokens[:keep] + tokens[keep + drop:]


# -- replies ------------------------------------------------------------------------------

def timestamp(seconds: float) -> str:
    """RFC 3339 in UTC, to the microsecond, as Ollama writes ``created_at``."""
    return datetime.fromtimestamp(seconds, timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def _ns(ms: Any) -> int:
    return int(round(float(ms) * 1e6)) if isinstance(ms, (int, float)) else 0


class Translator:
    """One engine reply as Ollama's objects.  ``kind``: "chat" (a ``message``) or
    "generate" (a ``response``); ``engine``: the engine path it came from; ``clock``: the
    wall clock each object's ``created_at`` reads (the caller's); ``load_ns``: the time the
    request waited for its model (a load, if it needed one), measured by the caller.
    ``feed`` takes each SSE event's JSON and returns the objects to write; ``end`` the final one."""

    def __init__(self, kind: str, engine: str, model: str, clock: Callable[[], float], load_ns: int = 0):
        self.kind, self.engine, self.model, self.clock, self.load_ns = kind, engine, model, clock, load_ns
        self.calls: dict[int, dict[str, Any]] = {}  # tool calls as their deltas come: index -> id, name, arguments
        self.finish: str | None = None
        self.usage: dict[str, Any] = {}
        self.timings: dict[str, Any] = {}

    def _object(self, content: str = "", thinking: str = "", calls: list | None = None) -> dict[str, Any]:
        out: dict[str, Any] = {"model": self.model, "created_at": timestamp(self.clock())}
        if self.kind == "chat":
            message: dict[str, Any] = {"role": "assistant", "content": content}
            if thinking:
                message["thinking"] = thinking
            if calls:
                message["tool_calls"] = calls
            out["message"] = message
        else:
            out["response"] = content
            if thinking:
                out["thinking"] = thinking
        out["done"] = False
        return out

    def feed(self, event: dict[str, Any]) -> list[dict[str, Any]]:
        """The objects one engine event makes (an ``error`` event: OllamaError)."""
        if "error" in event:
            err = event["error"]
            raise OllamaError(int(err.get("code") or 500) if isinstance(err, dict) else 500,
                              err.get("message", str(err)) if isinstance(err, dict) else str(err))
        self.timings = event.get("timings") or self.timings
        if self.engine != "/v1/chat/completions":  # /completion, /infill: {"content", "stop", "stop_type"}
            if event.get("stop"):
                self.finish = "length" if event.get("stop_type") == "limit" else "stop"
                self.usage = {"prompt_tokens": event.get("tokens_evaluated"),
                              "completion_tokens": event.get("tokens_predicted")}
            return [self._object(event["content"])] if event.get("content") else []
        self.usage = event.get("usage") or self.usage
        out = []
        for choice in event.get("choices") or ():
            delta = choice.get("delta") or {}
            for call in delta.get("tool_calls") or ():
                slot = self.calls.setdefault(call.get("index", len(self.calls)), {"id": "", "name": "", "arguments": ""})
                slot["id"] = call.get("id") or slot["id"]
                fn = call.get("function") or {}
                slot["name"] += fn.get("name") or ""
                slot["arguments"] += fn.get("arguments") or ""
            if delta.get("content") or delta.get("reasoning_content"):
                out.append(self._object(delta.get("content") or "", delta.get("reasoning_content") or ""))
            if choice.get("finish_reason"):
                self.finish = choice["finish_reason"]
        return out

    def _tool_calls(self) -> list[dict[str, Any]]:
        calls = []
        for index in sorted(self.calls):
            c = self.calls[index]
            try:
                args = json.loads(c["arguments"]) if c["arguments"] else {}
            except ValueError:
                args = c["arguments"]  # not JSON: as the model wrote it
            calls.append({"id": c["id"], "function": {"index": index, "name": c["name"], "arguments": args}})
        return calls

    def end(self, total_ns: int) -> list[dict[str, Any]]:
        """The tool calls (if any), then the final object, with ``total_ns`` as its total."""
        out = []
        if self.calls:
            out.append(self._object(calls=self._tool_calls()))
        final = self._object()
        prompt_ns, eval_ns = _ns(self.timings.get("prompt_ms")), _ns(self.timings.get("predicted_ms"))
        final.update(done=True, done_reason="length" if self.finish == "length" else "stop",
                     total_duration=total_ns, load_duration=self.load_ns,
                     prompt_eval_count=int(self.usage.get("prompt_tokens") or self.timings.get("prompt_n") or 0),
                     prompt_eval_duration=prompt_ns,
                     eval_count=int(self.usage.get("completion_tokens") or self.timings.get("predicted_n") or 0),
                     eval_duration=eval_ns)
        out.append(final)
        return out

    def whole(self, reply: dict[str, Any], total_ns: int) -> dict[str, Any]:
        """A reply that came whole (``stream: false``) as Ollama's one object."""
        self.timings, self.usage = reply.get("timings") or {}, reply.get("usage") or {}
        thinking = ""
        if self.engine != "/v1/chat/completions":
            objects = self.feed({**reply, "stop": True})
            text = objects[0]["response"] if objects else ""
        else:
            choice = (reply.get("choices") or [{}])[0]
            message = choice.get("message") or {}
            self.finish = choice.get("finish_reason")
            for i, call in enumerate(message.get("tool_calls") or ()):
                fn = call.get("function") or {}
                self.calls[i] = {"id": call.get("id", ""), "name": fn.get("name", ""),
                                 "arguments": fn.get("arguments", "")}
            text, thinking = message.get("content") or "", message.get("reasoning_content") or ""
        final = self.end(total_ns)[-1]
        if self.kind == "chat":
            final["message"] = {"role": "assistant", "content": text}
            if thinking:
                final["message"]["thinking"] = thinking
            if self.calls:
                final["message"]["tool_calls"] = self._tool_calls()
        else:
            final["response"] = text
            if self.engine == "/v1/chat/completions" and thinking:
                final["thinking"] = thinking
        return final


# -- what a model is ------------------------------------------------------------------------

def _size_label(parameters: int) -> str:
    for scale, unit in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if parameters >= scale:
            return f"{parameters / scale:.1f}{unit}".replace(".0", "")
    return str(parameters)


def _quantization(file_type: Any) -> str:
    from gguf.constants import LlamaFileType  # the router's own dependency, loaded when asked

    try:
        name = LlamaFileType(file_type).name
    except (ValueError, TypeError):
        return "unknown"
    return name.removeprefix("MOSTLY_").removeprefix("ALL_")


def details(kv: dict[str, Any], parameters: int) -> dict[str, Any]:
    """Ollama's ``details`` of a GGUF file (its header's keys and parameter count)."""
    arch = kv.get("general.architecture") or "unknown"
    return {"parent_model": "", "format": "gguf", "family": arch, "families": [arch],
            "parameter_size": kv.get("general.size_label") or _size_label(parameters),
            "quantization_level": _quantization(kv.get("general.file_type"))}


def capabilities(kv: dict[str, Any], projector: bool) -> list[str]:
    """What Ollama's /api/show says a model can do, from its GGUF header: "embedding" for a
    model that pools (an encoder), else "completion"; "tools" and "thinking" where its chat
    template takes them; "insert" where it has fill-in-the-middle tokens; "vision" with a
    projector."""
    arch = kv.get("general.architecture", "")
    caps = ["embedding"] if f"{arch}.pooling_type" in kv else ["completion"]
    template = kv.get("tokenizer.chat_template") or ""
    if "tools" in template:
        caps.append("tools")
    if "<think>" in template or "enable_thinking" in template or "reasoning" in template:
        caps.append("thinking")
    if "tokenizer.ggml.fim_pre_token_id" in kv:
        caps.append("insert")
    if projector:
        caps.append("vision")
    return caps


def model_info(kv: dict[str, Any], parameters: int, context: int | None = None,
               arrays: dict[str, list] | None = None) -> dict[str, Any]:
    """Ollama's ``model_info``: the header's keys (the template apart; arrays as None, or
    as ``arrays`` gives them: Ollama's ``verbose``), ``general.parameter_count``, and
    ``{arch}.context_length`` as the context a request gets (``context``, where known)."""
    out = {k: v for k, v in kv.items() if k != "tokenizer.chat_template"}
    out.update(arrays or {})
    out["general.parameter_count"] = parameters
    arch = kv.get("general.architecture")
    if context and arch:
        out[f"{arch}.context_length"] = context
    return out


def parameters(args: list[str]) -> str:
    """A model's llama-server arguments as /api/show's ``parameters``: one option a line,
    with its value."""
    out: list[str] = []
    for arg in args:
        flag = arg.startswith("-") and not arg[1:2].isdigit()
        if out and not flag and " " not in out[-1]:
            out[-1] += f" {arg}"
        else:
            out.append(arg)
    return "\n".join(out)


def lines(objects: Iterable[dict[str, Any]]) -> bytes:
    """Objects as NDJSON."""
    return b"".join(json.dumps(o, separators=(",", ":")).encode() + b"\n" for o in objects)
