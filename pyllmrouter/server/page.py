"""The page at ``/`` (for a browser: a request that accepts HTML; a program that does not
gets Ollama's "Ollama is running", as Ollama's clients probe it): static files of the package (``server/ui/``), no build step, nothing
fetched from elsewhere.  Public, as llama-server's web UI is: the page holds no secret;
it asks for the API key and sends it with each of its API calls (server/ui/app.js).
"""

from __future__ import annotations

from importlib import resources

from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse, Response

__all__ = ["mount", "is_public"]

_TYPES = {"index.html": "text/html; charset=utf-8", "app.js": "text/javascript; charset=utf-8",
          "app.css": "text/css; charset=utf-8"}


def is_public(path: str) -> bool:
    """The page's own paths: served without the API key."""
    return path == "/" or (path.startswith("/ui/") and path[4:] in _TYPES)


def _file(name: str) -> Response:
    body = resources.files("pyllmrouter.server").joinpath("ui", name).read_bytes()
    return Response(body, media_type=_TYPES[name], headers={"cache-control": "no-cache"})


def mount(app: FastAPI) -> None:
    @app.api_route("/", methods=["GET", "HEAD"], include_in_schema=False)
    async def index(request: Request):
        if "text/html" not in request.headers.get("accept", ""):  # a program: Ollama's answer, as its clients probe
            return PlainTextResponse("Ollama is running")
        return _file("index.html")

    @app.get("/ui/{name}", include_in_schema=False)
    async def asset(name: str):
        if name not in _TYPES or name == "index.html":
            return Response(b'{"error": {"message": "not found", "type": "not_found_error", "code": 404}}',
                            404, media_type="application/json")
        return _file(name)
