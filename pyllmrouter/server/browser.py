"""What a web page may make the router do: the Host and Origin rules (pure).

A router on a user's machine sits beside their browser.  Any page the browser opens
can send requests to ``http://127.0.0.1:PORT``: "simple" ones (a form's POST, a
``fetch`` with a text body) go out without a CORS preflight, and a DNS name rebound to
127.0.0.1 makes the page same-origin with the router.  So, before anything else:

    Host     on a loopback bind, a request whose Host is not a local name or address
             (localhost, *.localhost, 127.0.0.0/8, ::1) or one of --allowed-hosts is
             refused: DNS rebinding (Ollama refuses the same)
    Origin   a request from a page of another origin than the router's own or an allowed
             one (--cors-origins: by default the local ones, any port, as Ollama's
             default; '*' gives llama-server's default back) is refused on every route
             but /health, inference included, unless it carries a valid API key
    body     a browser's request (it has an Origin) that changes state must declare a
             JSON body (Content-Type application/json, or a multipart form where
             llama-server takes one): a page cannot send that without a preflight

Every refusal is a 403 (415 for the body) whose message names the option that allows it.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass
from typing import Callable
from urllib.parse import urlsplit

__all__ = ["Gate", "Blocked", "LOCAL_ORIGINS", "is_loopback_bind"]

LOCAL_ORIGINS = "localhost"  # llama.cpp's own name for "the local origins, any port"
_LOCAL_NAMES = frozenset({"localhost", "localhost.localdomain", "ip6-localhost", "ip6-loopback"})
_STATE_CHANGING = frozenset({"POST", "PUT", "PATCH", "DELETE"})
_FORM_PATHS = frozenset({"/v1/audio/transcriptions", "/audio/transcriptions"})  # multipart, as llama-server


@dataclass(frozen=True)
class Blocked:
    status: int
    message: str
    code: str


_ACCEPTED_MEMO = 64  # distinct acceptable Host headers remembered


def _host_of(authority: str) -> str:
    """'Example.COM:8080' -> 'example.com'; '[::1]:8080' -> '::1'."""
    authority = authority.strip().lower()
    if authority.startswith("["):
        return authority[1:].partition("]")[0]
    if authority.count(":") == 1:
        return authority.partition(":")[0]
    return authority.rstrip(".")


def _is_local(host: str) -> bool:
    if host in _LOCAL_NAMES or host.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def is_loopback_bind(host: str) -> bool:
    """Whether ``serve --host`` (one address or several, comma-separated) binds only
    loopback addresses."""
    names = [h.strip() for h in host.split(",") if h.strip()]
    return bool(names) and all(_is_local(h.removeprefix("[").removesuffix("]").lower()) for h in names)


def _origin_host(origin: str) -> str | None:
    try:
        return urlsplit(origin).hostname
    except ValueError:
        return None


class Gate:
    def __init__(self, cors_origins: str, allowed_hosts: frozenset[str] | None):
        """``cors_origins``: llama.cpp's reading of --cors-origins ('*', 'localhost', or
        origins separated by commas); ``allowed_hosts``: the Host names accepted beside the
        local ones (None: no Host check: the router does not listen on loopback alone)."""
        self.cors_origins = cors_origins.strip()
        self._listed = frozenset(o.strip().lower().rstrip("/") for o in self.cors_origins.split(",") if o.strip())
        self.allowed_hosts = None if allowed_hosts is None else frozenset(_host_of(h) for h in allowed_hosts)
        # Host headers found acceptable (a client sends the same one with every request): a
        # memo of this pure check, bounded, since a client may send any Host
        self._accepted: set[str] = set()

    def host(self, host_header: str | None) -> Blocked | None:
        """The Host check (DNS rebinding): None where the Host is acceptable."""
        if self.allowed_hosts is None or not host_header or host_header in self._accepted:
            return None
        host = _host_of(host_header)
        if _is_local(host) or host in self.allowed_hosts:
            if len(self._accepted) < _ACCEPTED_MEMO:
                self._accepted.add(host_header)
            return None
        return Blocked(403, f"the host {host!r} is not allowed: a request to this router (listening on loopback) "
                            f"must name it by a local name or address (localhost, 127.0.0.1, [::1]); another name "
                            f"is one a page may have rebound to it (DNS rebinding): list it with --allowed-hosts",
                       "host_not_allowed")

    def allows_origin(self, origin: str) -> bool:
        """Whether pages of ``origin`` may use the router (--cors-origins)."""
        if self.cors_origins == "*":
            return True
        if self.cors_origins == LOCAL_ORIGINS:
            host = _origin_host(origin)
            return host is not None and _is_local(host)
        return origin.strip().lower().rstrip("/") in self._listed

    def foreign(self, origin: str | None, host_header: str | None) -> bool:
        """A request sent by a page of another origin than the router's own (its scheme
        aside: the page the router serves sends its own address) or an allowed one."""
        if origin is None:
            return False  # not a browser's cross-origin request: a program, or a page's own GET
        if host_header and urlsplit(origin).netloc.lower() == host_header.strip().lower():
            return False
        return not self.allows_origin(origin)

    def origin(self, origin: str | None, host_header: str | None, has_valid_key: Callable[[], bool]) -> Blocked | None:
        """The Origin check: None where the request may go on (the key is looked at only
        for a foreign page's request)."""
        if not self.foreign(origin, host_header) or has_valid_key():
            return None
        return Blocked(403, f"a request from the web page at {origin} is refused: pages of other origins may not use "
                            f"this router without its API key; allow that origin with --cors-origins "
                            f"(currently {self.cors_origins!r}; '*' allows every origin, as llama-server)",
                       "origin_not_allowed")

    @staticmethod
    def body(method: str, path: str, origin: str | None, content_type: str, has_body: bool) -> Blocked | None:
        """A browser's request that changes state must declare its JSON body."""
        if origin is None or method not in _STATE_CHANGING or not has_body:
            return None
        media = content_type.partition(";")[0].strip().lower()
        if media == "application/json" or media.endswith("+json"):
            return None
        if media == "multipart/form-data" and path in _FORM_PATHS:
            return None
        return Blocked(415, f"a request from a web page that changes state must send its body as JSON "
                            f"(Content-Type: application/json), not {media or 'an undeclared type'!r}",
                       "unsupported_media_type")
