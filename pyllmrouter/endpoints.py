"""Every route of a model the project serves, in one table, and what each one is.

    ENDPOINTS ──▶ server/app.py      which POSTs and GETs go to a model's engine
              ──▶ server/metrics.py  the routes labelled by name
              ──▶ server/ollama.py   which body keys carry the prompt (none: load only)
              ──▶ ray/failover.py    which requests may run on another node, which take a slot
              ──▶ ray/ingress.py, ray/replica.py   (through failover and ``ENGINE_POSTS``)
    csrc/engine.cpp's route table and csrc/conduit.cpp's ``takes_slot`` say the same of the
    engine's routes: tests/http/test_endpoints.py reads them and fails on any difference.

A route's facts:
  - ``engine``: llama-server's handler of the model answers it (its engine's route table);
    the others are the router's own (the management API, Ollama's API).
  - ``slot``: it runs in one of the engine's slots for as long as it runs (a generation, an
    embedding, a rerank, a transcription): the native path waits for a free slot before it
    hands it over, and a cluster node claims it before it runs (ray/ledger.py).  Counting,
    template and tokenizer endpoints take none.
  - ``writes``: it changes something beyond its reply (a load, a pull, a slot action, the
    LoRA scales, the props, a stream's control, a delete).  A request that writes nothing
    and runs twice is unobservable: it may be sent to another node after a loss
    (``repeatable``), unless it belongs to a conversation (X-Conversation-Id).
  - ``local``: it is answered from one process's own state (a resumable stream's session):
    never sent to another node.
  - ``prompt``: for Ollama's model routes, the body keys that carry the prompt; a request
    with none of them loads its model (or, with keep_alive 0, unloads it) and runs nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

__all__ = ["Endpoint", "ENDPOINTS", "HEALTH", "ENGINE_POST", "ENGINE_GET", "ENGINE_POSTS", "LABELLED", "lookup",
           "is_engine_post", "takes_slot", "repeatable", "load_only"]


@dataclass(frozen=True)
class Endpoint:
    method: str
    path: str  # as llama-server writes it; "{id_slot}": a path parameter
    engine: bool = True
    slot: bool = False
    writes: bool = False
    prompt: tuple[str, ...] = ()
    local: bool = False


# liveness: no API key asked (llama-server's), answered from serve's first moment
# (server/starting.py) and by the app after it
HEALTH = frozenset({"/health", "/v1/health"})


def _engine(method: str, *paths: str, slot: bool = False, writes: bool = False,
            local: bool = False) -> tuple[Endpoint, ...]:
    return tuple(Endpoint(method, p, True, slot, writes, local=local) for p in paths)


ENDPOINTS: tuple[Endpoint, ...] = (
    # llama-server's per-model endpoints (tools/server/server.cpp), served by the model's engine
    *_engine("POST", "/v1/chat/completions", "/chat/completions", "/v1/completions", "/completions", "/completion",
             "/v1/responses", "/responses", "/v1/messages", "/infill", "/v1/embeddings", "/embeddings",
             "/embedding", "/v1/rerank", "/v1/reranking", "/rerank", "/reranking", "/v1/audio/transcriptions",
             "/audio/transcriptions", slot=True),
    *_engine("POST", "/v1/messages/count_tokens", "/tokenize", "/detokenize", "/apply-template",
             "/chat/completions/input_tokens", "/v1/chat/completions/input_tokens", "/responses/input_tokens",
             "/v1/responses/input_tokens"),
    *_engine("POST", "/v1/chat/completions/control", "/lora-adapters", "/slots/{id_slot}", "/props", writes=True),
    *_engine("GET", "/slots", "/lora-adapters"),
    # for the model named by ?model= (without it, the router's own)
    *_engine("GET", "/props", "/metrics"),
    # the router's own that the engine's table has too (a model's own llama-server answers them)
    *_engine("GET", *sorted(HEALTH), "/models", "/v1/models"),
    # the resumable streams (llama-server wires them for a model's own server)
    *_engine("GET", "/v1/stream", local=True), *_engine("POST", "/v1/streams/lookup", local=True),
    *_engine("DELETE", "/v1/stream", writes=True, local=True),
    # Ollama's model routes (server/ollama.py): translated to the engine's, each a generation
    Endpoint("POST", "/api/chat", False, True, False, ("messages",)),
    Endpoint("POST", "/api/generate", False, True, False, ("prompt", "suffix")),
    Endpoint("POST", "/api/embed", False, True, False, ("input",)),
    Endpoint("POST", "/api/embeddings", False, True, False, ("prompt",)),
    # the management API (server/manage.py) and Ollama's: loads, pulls, deletes
    *(Endpoint("POST", p, False, False, True) for p in ("/models", "/models/load", "/models/unload", "/api/pull",
                                                         "/api/create", "/api/copy")),
    *(Endpoint("DELETE", p, False, False, True) for p in ("/models", "/api/delete")),
)

_BY_KEY: dict[tuple[str, str], Endpoint] = {(e.method, e.path): e for e in ENDPOINTS}

# what the server hands to a model's engine: every engine POST (a /slots/N is /slots/{id_slot}),
# and the GETs of a model named by ?model= that only the engine answers
ENGINE_POST: tuple[str, ...] = tuple(e.path for e in ENDPOINTS if e.engine and e.method == "POST" and not e.local)
ENGINE_GET: tuple[str, ...] = ("/slots", "/lora-adapters")
ENGINE_POSTS: frozenset[str] = frozenset(p for p in ENGINE_POST if "{" not in p)
# the routes metrics label by name (anything else is "other")
LABELLED: frozenset[str] = ENGINE_POSTS | frozenset(ENGINE_GET) | {"/metrics", "/props", "/v1/stream",
                                                                   "/v1/streams/lookup"}


def lookup(method: str, path: str) -> Endpoint | None:
    """The route ``method path`` is (a /slots/N is /slots/{id_slot}), None: none of the table's."""
    if path.startswith("/slots/") and path.count("/") == 2:
        path = "/slots/{id_slot}"
    return _BY_KEY.get((method, path))


def is_engine_post(path: str) -> bool:
    """Whether a POST to ``path`` goes to its model's engine."""
    return path in ENGINE_POSTS or path.startswith("/slots/")


def takes_slot(path: str) -> bool:
    """Whether a model's POST at ``path`` runs in one of its engine's slots."""
    e = lookup("POST", path)
    return e is not None and e.slot


def repeatable(method: str, path: str, headers: Mapping[str, str]) -> bool:
    """Whether running the request twice is unobservable (``headers`` by lower-case name): a
    GET (it reads), or a model's POST that writes nothing, outside any conversation."""
    if method == "GET":
        return True
    if method != "POST" or "x-conversation-id" in headers:
        return False
    e = lookup(method, path)
    return e is not None and not e.writes and not e.local and (e.engine or bool(e.prompt))


def load_only(path: str, body: Mapping[str, Any]) -> bool:
    """Whether an Ollama model request only loads (or unloads) its model: it has none of the
    keys that carry its route's prompt, or each is empty (None, "", [])."""
    e = lookup("POST", path)
    return e is not None and bool(e.prompt) and not any(body.get(k) not in (None, "", [], {}) for k in e.prompt)
