"""A request's body, counted as it streams in (Content-Length or chunked alike) and
refused at the limit, before any of it reaches a handler; then given to the handler
as one message.

    read_body(receive, limit) ──▶ bytes | None (the client left) | TooLarge (at the limit:
                                  413, nothing more is read)
    replay(body, then) ──▶ a receive that gives the body once, then ``then()``'s messages
"""

from __future__ import annotations

import json
from typing import Any, Awaitable, Callable

from pyllmrouter.server.api_errors import ApiError, error_response

__all__ = ["BODY_METHODS", "TooLarge", "read_body", "read_or_refuse", "replay", "form", "engine_body", "json_value",
           "json_object", "model_in", "model_named", "departed"]

BODY_METHODS = frozenset({"POST", "PUT", "PATCH", "DELETE"})

Receive = Callable[[], Awaitable[dict[str, Any]]]


class TooLarge(Exception):
    def __init__(self, limit: int):
        super().__init__(f"request body exceeds the limit of {limit} bytes")
        self.limit = limit


async def read_body(receive: Receive, limit: int) -> bytes | None:
    """The whole body; TooLarge as soon as more than ``limit`` bytes have come; None if
    the client left first."""
    chunks: list[bytes] = []
    total = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        chunk = message.get("body", b"")
        total += len(chunk)
        if total > limit:
            raise TooLarge(limit)
        if chunk:
            chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)


async def read_or_refuse(scope: dict, receive: Receive, send, limit: int) -> bytes | None:
    """A request's body within ``limit`` (b"" for a method without one); None when it is
    answered already: 413 sent (past the limit, read no further) or the client gone."""
    if scope["method"] not in BODY_METHODS:
        return b""
    try:
        return await read_body(receive, limit)
    except TooLarge as e:
        await error_response(ApiError(413, str(e), code="body_too_large"))(scope, receive, send)
        return None


def replay(body: bytes, then: Receive) -> Receive:
    """A receive for a handler: the body as one message, then what ``then`` gives (the
    client's disconnect)."""
    given = False

    async def receive() -> dict[str, Any]:
        nonlocal given
        if not given:
            given = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await then()
    return receive


def form(content_type: str, body: bytes) -> tuple[dict[str, Any], dict[str, tuple[str, str, bytes]]]:
    """A multipart/form-data body as llama-server's HTTP layer hands it to a handler: its
    fields (a name given twice: a list of values) and its files (field name -> (filename,
    content type, bytes)).  ValueError: not a multipart body."""
    import email.parser  # noqa: PLC0415 - only multipart requests need it
    import email.policy  # noqa: PLC0415

    head = f"Content-Type: {content_type}\r\nMIME-Version: 1.0\r\n\r\n".encode("latin-1", "replace")
    message = email.parser.BytesParser(policy=email.policy.HTTP).parsebytes(head + body)
    if not message.is_multipart():
        raise ValueError("the body is not multipart/form-data")
    fields: dict[str, Any] = {}
    files: dict[str, tuple[str, str, bytes]] = {}
    for part in message.iter_parts():
        name = part.get_param("name", header="content-disposition")
        if not name:
            continue
        data = part.get_payload(decode=True) or b""
        filename = part.get_filename()
        if filename is not None:
            files[name] = (filename, part.get_content_type(), data)
        elif name in fields:
            fields[name] = [*fields[name], data.decode(errors="replace")] if isinstance(fields[name], list) \
                else [fields[name], data.decode(errors="replace")]
        else:
            fields[name] = data.decode(errors="replace")
    return fields, files


def engine_body(content_type: str, raw: bytes) -> tuple[bytes, dict[str, tuple[str, str, bytes]], Any]:
    """What a model's engine gets of a POST body, as llama-server's HTTP layer gives it:
    (body, files, the body read).  A multipart form becomes its fields as JSON, and its
    files; anything else goes as it came, read as JSON (any value: an array too)."""
    if content_type.lower().startswith("multipart/form-data"):
        try:
            fields, files = form(content_type, raw)
        except ValueError as e:
            raise ApiError(400, f"request body is not a valid multipart form: {e}", code="invalid_form") from None
        return json.dumps(fields).encode(), files, fields
    return raw, {}, json_value(raw)


def json_value(raw: bytes) -> Any:
    """A request body as JSON (empty: {}), or the 400 that says what is wrong."""
    try:
        return json.loads(raw or b"{}")
    except ValueError as e:
        raise ApiError(400, f"request body is not valid JSON: {e}", code="invalid_json") from None
    except RecursionError:
        raise ApiError(400, "request body is nested too deeply to read", code="invalid_json") from None


def json_object(raw: bytes) -> dict[str, Any]:
    """A request body as a JSON object (empty: {}), or the 400 that says what is wrong."""
    data = json_value(raw)
    if not isinstance(data, dict):
        raise ApiError(400, "request body must be a JSON object", code="invalid_json")
    return data


def model_in(data: Any, query: dict[str, str]) -> str | None:
    """The model a request names: its JSON object's "model", else ?model= (a body that names
    none, an array), as llama-server's router reads it."""
    model = data.get("model") if isinstance(data, dict) else None
    return model if isinstance(model, str) and model else query.get("model") or None


def model_named(content_type: str, raw: bytes, query: dict[str, str]) -> str | None:
    """The model a POST names, as ``engine_post`` reads it: a JSON body's (or a multipart
    form's) "model", else ?model= (400 for a body that is neither)."""
    return model_in(engine_body(content_type, raw)[2], query)


async def departed(receive) -> None:
    """Returns once ``receive`` says the client has closed its connection."""
    while (await receive())["type"] != "http.disconnect":
        pass
