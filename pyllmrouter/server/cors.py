"""CORS as llama-server's HTTP layer answers it (tools/server/server-http.cpp, its
pre-routing handler), from what llama.cpp's parser made of the router's arguments
(``--cors-origins``, ``--cors-methods``, ``--cors-headers``, ``--cors-credentials``;
localhost by default once server tools or MCP servers are on):

- origins ``*`` with credentials: the request's Origin is echoed back;
- origins ``localhost``: echoed only when its host is localhost, 127.0.0.1 or ::1;
- any other value: sent as it is;
- a preflight (OPTIONS) is answered at once, before the API key is checked (browsers
  send none), with the credentials, methods and headers allowed and an empty body.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import urlsplit

__all__ = ["Cors"]

_LOCAL_HOSTS = frozenset({"localhost", "127.0.0.1", "::1"})


def _is_localhost(origin: str) -> bool:
    try:
        return urlsplit(origin).hostname in _LOCAL_HOSTS
    except ValueError:
        return False


class Cors:
    def __init__(self, settings: dict[str, Any]):
        """``settings``: llama.cpp's reading of the arguments (router/services.settings)."""
        self.origins = str(settings["cors_origins"])
        self.credentials = bool(settings["cors_credentials"])
        self.methods = str(settings["cors_methods"])
        self.headers = str(settings["cors_headers"])

    def allow_origin(self, origin: str | None) -> str | None:
        """The Access-Control-Allow-Origin for a request with this Origin (None: not sent)."""
        if self.credentials and self.origins == "*":
            return origin or ""
        if self.origins == "localhost":
            return origin if origin and _is_localhost(origin) else None
        return self.origins

    def headers_for(self, origin: str | None, preflight: bool) -> list[tuple[bytes, bytes]]:
        """The response headers llama-server adds to a request (a preflight: all of them),
        spelled as llama-server spells them."""
        out = []
        allow = self.allow_origin(origin)
        if allow is not None:
            out.append((b"Access-Control-Allow-Origin", allow.encode("latin-1", "replace")))
        if preflight:
            out += [(b"Access-Control-Allow-Credentials", b"true" if self.credentials else b"false"),
                    (b"Access-Control-Allow-Methods", self.methods.encode("latin-1", "replace")),
                    (b"Access-Control-Allow-Headers", self.headers.encode("latin-1", "replace"))]
        return out
