"""The endpoint table (pyllmrouter/endpoints.py) is the one word on each route: the engine's
own route lists in C++ say the same, and every reader of the table classes alike."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from pyllmrouter import endpoints

CSRC = Path(__file__).resolve().parents[2] / "csrc"


def _engine_routes() -> set[tuple[str, str]]:
    """(method, path) of every route csrc/engine.cpp's tables send to llama.cpp's handlers."""
    text = (CSRC / "engine.cpp").read_text()
    routes = re.findall(r'\{"(GET|POST|DELETE) (/[^"]*)",', text)
    return {(m, re.sub(r":([a-z_]+)", r"{\1}", p)) for m, p in routes}


def _conduit_slot_paths() -> set[str]:
    """The paths csrc/conduit.cpp's ``takes_slot`` holds back for a free slot."""
    text = (CSRC / "conduit.cpp").read_text()
    body = re.search(r"bool takes_slot\(const std::string & path\) \{(.*?)\n\}", text, re.S).group(1)
    return set(re.findall(r'"(/[^"]*)"', body))


def test_the_engines_route_table_is_the_tables_engine_routes():
    ours = {(e.method, e.path) for e in endpoints.ENDPOINTS if e.engine}
    assert _engine_routes() == ours


def test_the_native_paths_slot_list_is_the_tables():
    """Every POST the table says runs in a slot, the native path waits for a slot for (the
    transcriptions included: a transcription is a generation)."""
    ours = {e.path for e in endpoints.ENDPOINTS if e.engine and e.method == "POST" and e.slot}
    assert _conduit_slot_paths() == ours
    assert endpoints.takes_slot("/v1/audio/transcriptions")


def test_a_difference_is_found():
    """(The reading of the C++ lists finds what is there: a test of the two tests above.)"""
    assert ("POST", "/slots/{id_slot}") in _engine_routes() and ("GET", "/v1/stream") in _engine_routes()
    assert "/v1/chat/completions" in _conduit_slot_paths() and "/tokenize" not in _conduit_slot_paths()


@pytest.mark.parametrize("method,path,headers,repeats", [
    ("POST", "/v1/chat/completions", {}, True), ("POST", "/v1/completions", {}, True),
    ("POST", "/v1/embeddings", {}, True), ("POST", "/v1/messages", {}, True), ("POST", "/api/chat", {}, True),
    ("POST", "/api/embed", {}, True), ("GET", "/slots", {}, True), ("GET", "/props", {}, True),
    ("POST", "/tokenize", {}, True), ("POST", "/v1/audio/transcriptions", {}, True),
    ("POST", "/v1/chat/completions", {"x-conversation-id": "c1"}, False),  # it writes the conversation's stream
    ("POST", "/models/load", {}, False), ("POST", "/models", {}, False), ("POST", "/models/unload", {}, False),
    ("DELETE", "/models", {}, False), ("POST", "/slots/0", {}, False), ("POST", "/lora-adapters", {}, False),
    ("POST", "/props", {}, False), ("POST", "/v1/chat/completions/control", {}, False),
    ("POST", "/api/pull", {}, False), ("DELETE", "/api/delete", {}, False),
    ("POST", "/v1/streams/lookup", {}, False), ("POST", "/nowhere", {}, False),
])
def test_the_idempotency_classes(method, path, headers, repeats):
    assert endpoints.repeatable(method, path, headers) is repeats


@pytest.mark.parametrize("path,slot", [
    ("/v1/chat/completions", True), ("/completion", True), ("/v1/embeddings", True), ("/rerank", True),
    ("/api/generate", True), ("/tokenize", False), ("/apply-template", False), ("/v1/messages/count_tokens", False),
    ("/v1/responses/input_tokens", False), ("/slots/0", False), ("/props", False), ("/nowhere", False),
])
def test_which_requests_take_a_slot(path, slot):
    assert endpoints.takes_slot(path) is slot


@pytest.mark.parametrize("path,body,only", [
    ("/api/chat", {}, True), ("/api/chat", {"messages": []}, True), ("/api/chat", {"messages": None}, True),
    ("/api/chat", {"messages": [{"role": "user", "content": "hi"}]}, False),
    ("/api/generate", {"prompt": ""}, True), ("/api/generate", {"suffix": "x"}, False),
    ("/api/generate", {"prompt": "hi"}, False), ("/api/embed", {"input": []}, True),
    ("/api/embed", {"input": "x"}, False), ("/api/embeddings", {"prompt": "x"}, False),
    ("/v1/chat/completions", {}, False),  # llama-server's own routes have no load-only form
])
def test_ollamas_load_only_rule(path, body, only):
    """One rule for the server and the cluster's ingress: no prompt, only a load."""
    assert endpoints.load_only(path, body) is only


def test_every_engine_post_is_handed_to_the_engine():
    assert all(endpoints.is_engine_post(p.replace("{id_slot}", "3")) for p in endpoints.ENGINE_POST)
    assert not endpoints.is_engine_post("/models/load") and not endpoints.is_engine_post("/api/chat")
