"""OpenAI request parameters -> the keyword arguments the worker serves, checked.

    Router.request(model, method, kwargs) ──normalize()──▶ kwargs ──▶ worker
                                              └─ BadRequest(param, why): nothing
                                                 leased, loaded or evicted

Pure: no I/O, no llama_cpp.  Every parameter a client commonly sends is checked
for type and range here, in the router process, so that a bad request fails
with a message naming the parameter before any model is loaded for it, and the
batched path and llama_cpp's own methods receive the same normalized values:

- ``prompt``: a string, a list of token ids, or a list holding one of those
  (OpenAI's batch shapes); several prompts in one request are refused here
  (the HTTP server splits them into one request each: server/fanout.py).
- ``messages``: objects with a ``role``; ``content`` as text parts is joined
  into one string (with newlines, as llama.cpp does for templates that take
  text); other part types are refused: these models read text only.
- ``response_format``: ``json_schema`` (OpenAI's structured outputs) becomes
  llama_cpp's ``json_object`` with that schema; ``text`` means none.
- ``logit_bias`` keys become token ids; ``stop`` a list of non-empty strings.

Token ids are checked against the vocabulary in the worker, which knows it.
Parameters not listed here pass through unchanged.
"""

from __future__ import annotations

import math
from typing import Any

from .errors import BadRequest

__all__ = ["normalize", "check_tokens", "is_tokens"]

_NUMBERS = ("temperature", "presence_penalty", "frequency_penalty", "repeat_penalty", "mirostat_tau",
            "mirostat_eta", "tfs_z")
_UNIT = ("top_p", "min_p", "typical_p")  # probabilities: 0..1
_INTS = ("top_k", "seed", "max_tokens")
_ROLES = ("system", "developer", "user", "assistant", "tool", "function")


def normalize(method: str, kwargs: dict[str, Any]) -> dict[str, Any]:
    """A checked copy of ``kwargs`` for ``method`` (chat, complete or embed)."""
    out = dict(kwargs)
    for k in [k for k, v in out.items() if v is None and k not in ("messages", "prompt", "input")]:
        del out[k]  # None is "the default" (max_tokens: as many as the context holds)
    if method == "embed":
        out["input"] = _embed_input(kwargs.get("input"))
        return out
    for k in _NUMBERS:
        if k in out:
            out[k] = _number(k, out[k])
    for k in _UNIT:
        if k in out:
            out[k] = _number(k, out[k], 0.0, 1.0)
    for k in _INTS:
        if k in out:
            out[k] = _int(k, out[k])
    if "mirostat_mode" in out:
        out["mirostat_mode"] = _int("mirostat_mode", out["mirostat_mode"], 0, 2)
    if "stop" in out:
        out["stop"] = _stop(out["stop"])
    if "logit_bias" in out:
        out["logit_bias"] = _logit_bias(out["logit_bias"])
    if "response_format" in out:
        fmt = _response_format(out["response_format"])
        if fmt is None:
            del out["response_format"]
        else:
            out["response_format"] = fmt
    if method == "chat":
        out["messages"] = _messages(kwargs.get("messages"))
        if "logprobs" in out and not isinstance(out["logprobs"], bool):
            raise BadRequest("logprobs", "'logprobs' must be true or false")
        if "top_logprobs" in out:
            out["top_logprobs"] = _int("top_logprobs", out["top_logprobs"], 0, 20)
    elif method == "complete":
        out["prompt"] = _prompt(kwargs.get("prompt"))
        out.setdefault("max_tokens", None)  # as llama-server and chat: until the end of text (llama_cpp: 16)
        if "logprobs" in out:
            out["logprobs"] = _int("logprobs", out["logprobs"], 0, None)
        for k, kind in (("echo", bool), ("suffix", str)):
            if k in out and not isinstance(out[k], kind):
                raise BadRequest(k, f"'{k}' must be a {'boolean' if kind is bool else 'string'}")
    else:
        raise BadRequest("method", f"unknown method {method!r}")
    return out


def check_tokens(tokens: list[int], n_vocab: int) -> list[int]:
    """``tokens``, if every id is in a vocabulary of ``n_vocab`` (checked where the model is)."""
    bad = next((t for t in tokens if not 0 <= t < n_vocab), None)
    if bad is not None:
        raise BadRequest("prompt", f"'prompt' token id {bad} is not in the model's vocabulary of {n_vocab} tokens")
    return tokens


def _number(name: str, v: Any, lo: float | None = None, hi: float | None = None) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise BadRequest(name, f"'{name}' must be a number, not {v!r}")
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        raise BadRequest(name, f"'{name}' must be between {lo:g} and {hi:g}, not {v!r}")
    return float(v)


def _int(name: str, v: Any, lo: int | None = None, hi: int | None = None) -> int:
    if isinstance(v, float) and v.is_integer():
        v = int(v)
    if isinstance(v, bool) or not isinstance(v, int):
        raise BadRequest(name, f"'{name}' must be an integer, not {v!r}")
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        bounds = f"at least {lo}" if hi is None else f"between {lo} and {hi}"
        raise BadRequest(name, f"'{name}' must be {bounds}, not {v!r}")
    return v


def _stop(v: Any) -> list[str]:
    stops = [v] if isinstance(v, str) else v
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise BadRequest("stop", "'stop' must be a string or a list of strings")
    return [s for s in stops if s]  # an empty one would match at once (llama_cpp) or never


def _logit_bias(v: Any) -> dict[int, float]:
    if not isinstance(v, dict):
        raise BadRequest("logit_bias", "'logit_bias' must map token ids to numbers")
    out = {}
    for k, b in v.items():
        try:
            token = int(k)
        except (TypeError, ValueError):
            raise BadRequest("logit_bias", f"'logit_bias' keys are token ids; {k!r} is not one") from None
        if token < 0:
            raise BadRequest("logit_bias", f"'logit_bias' keys are token ids; {k!r} is negative")
        out[token] = _number("logit_bias", b)
    return out


def _response_format(v: Any) -> dict[str, Any] | None:
    kind = v.get("type") if isinstance(v, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        if v.get("schema") is not None and not isinstance(v["schema"], dict):
            raise BadRequest("response_format", "'response_format.schema' must be an object")
        return v
    if kind == "json_schema":
        spec = v.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise BadRequest("response_format", "'response_format.json_schema.schema' must be an object")
        return {"type": "json_object", "schema": schema}
    raise BadRequest("response_format", "'response_format.type' must be 'text', 'json_object' or 'json_schema'")


def is_tokens(v: Any) -> bool:
    """Whether ``v`` is a list of token ids (an empty list is one)."""
    return isinstance(v, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in v)


def _prompt(v: Any) -> str | list[int]:
    if isinstance(v, list) and len(v) == 1 and (isinstance(v[0], str) or is_tokens(v[0])):
        v = v[0]  # one prompt in OpenAI's batch shape
    if isinstance(v, str):
        return v
    if is_tokens(v):
        if any(t < 0 for t in v):
            raise BadRequest("prompt", "'prompt' token ids must not be negative")
        return v if v else ""  # no tokens: as an empty string (the start-of-text token alone)
    if isinstance(v, list) and v and all(isinstance(p, (str, list)) for p in v):
        raise BadRequest("prompt", f"one prompt per request is supported; this one has {len(v)}")
    raise BadRequest("prompt", "'prompt' must be a string or a list of token ids")


def _messages(v: Any) -> list[dict[str, Any]]:
    if not isinstance(v, list) or not v:
        raise BadRequest("messages", "'messages' must be a non-empty list of messages")
    out = []
    for i, m in enumerate(v):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise BadRequest("messages", f"{where} must be an object with 'role' and 'content'")
        role = m.get("role")
        if role not in _ROLES:
            raise BadRequest("messages", f"{where}.role must be one of {', '.join(_ROLES)}, not {role!r}")
        content = m.get("content")
        if isinstance(content, list):
            m = {**m, "content": _text_parts(content, where)}
        elif content is not None and not isinstance(content, str):
            raise BadRequest("messages", f"{where}.content must be a string or a list of text parts")
        out.append(m)
    return out


def _text_parts(parts: list[Any], where: str) -> str:
    texts = []
    for j, p in enumerate(parts):
        kind = p.get("type") if isinstance(p, dict) else None
        if kind != "text" or not isinstance(p.get("text"), str):
            raise BadRequest("messages", f"{where}.content[{j}] must be a text part ({{'type': 'text', 'text': ...}}); "
                                         f"this server's models read text only, not {kind or type(p).__name__!r}")
        texts.append(p["text"])
    return "\n".join(texts)


def _embed_input(v: Any) -> str | list[str]:
    if isinstance(v, str) or (isinstance(v, list) and v and all(isinstance(s, str) for s in v)):
        return v
    raise BadRequest("input", "'input' must be a string or a non-empty list of strings")
