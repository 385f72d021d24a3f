"""A differential fuzz of the wire: seeded raw HTTP/1.1 byte streams, each sent to two
servers on the same models, whose answers must be the same (tests/test_wire.py runs a
short seeded run; bench/wire_fuzz.py a long one).

    cases(seed) ──Case: a connection's steps──▶ play(url, case) ──▶ [(status, body)...]
                                                                   normalised, in order
    compare(native, relay) ──▶ "" or what differs

A case is one client connection: requests (valid ones to a model's endpoints, the router's
own, and broken ones: bad JSON, an unknown model or path, duplicate or conflicting
headers, obs-fold, non-ASCII values), framed in every way HTTP/1.1 allows (Content-Length,
chunked, ``Expect: 100-continue``, HTTP/1.0, ``Connection: close``), their bytes split at
random points and sent with pauses or pipelined, some sent only once an earlier answer has
come, and clients that half-close or read late.  The reference is the relay
(``serve --no-native``), where the router reads every request and writes every answer;
the native path (``serve``: a worker writes the answer on the client's connection and reads
its next requests itself) must give the same statuses and bodies, in the same order, on
every connection.  Bodies are compared with what differs between any two runs left out
(ids, times, timings).  A client that half-closes may be answered or not (its server may
see the end of its stream before or after the request): its answers must be a prefix of
the other server's.
"""

from __future__ import annotations

import json
import random
import socket
import time
from dataclasses import dataclass, field

__all__ = ["Case", "cases", "play", "compare", "normalise", "MODEL"]

MODEL = "story"  # a scripted model (tools/scripted.py): its greedy answers are fixed by construction
# what differs between two runs or two servers: ids, times, timings, a process's random marker
_VOLATILE = frozenset({"id", "created", "timings", "system_fingerprint", "time_ms", "t_prompt_processing",
                       "t_token_generation", "media_marker"})
_WORDS = ["once", "upon", "a", "time", "router", "byte", "GPU", "café", "naïve", "日本"]


@dataclass
class Case:
    """One connection's steps: ("send", bytes, pause_s) sends bytes (after a pause);
    ("await", n) waits until n answers have come; ("half_close",) shuts the client's
    writing side; ("late", s) reads nothing for s seconds.  ``requests``: how many
    complete requests it sends (the most answers it can get)."""

    steps: list[tuple] = field(default_factory=list)
    requests: int = 0
    half_closed: bool = False
    text: str = ""  # what it does, for a report


def _body(rng: random.Random) -> tuple[str, dict | bytes, str]:
    """(path, body, what) of a POST, valid or not."""
    words = " ".join(rng.choice(_WORDS) for _ in range(rng.randint(1, 6)))
    n = rng.randint(1, 5)
    stream = rng.random() < 0.4
    choice = rng.randint(0, 13)
    if choice <= 2:
        return "/tokenize", {"model": MODEL, "content": words}, "tokenize"
    if choice == 3:
        return "/detokenize", {"model": MODEL, "tokens": [rng.randint(0, 200) for _ in range(n)]}, "detokenize"
    if choice <= 5:
        return "/v1/completions", {"model": MODEL, "prompt": words, "max_tokens": n, "temperature": 0,
                                   "stream": stream}, f"completions stream={stream}"
    if choice <= 7:
        return "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": words}],
                                        "max_tokens": n, "stream": stream,
                                        **({"return_progress": True} if rng.random() < 0.3 else {})}, \
            f"chat stream={stream}"
    if choice == 8:
        return "/completion", {"model": MODEL, "prompt": words, "n_predict": n, "stream": stream}, "completion"
    if choice == 9:
        return "/apply-template", {"model": MODEL, "messages": [{"role": "user", "content": words}]}, "template"
    if choice == 10:
        return "/v1/completions", {"model": "nobody", "prompt": words}, "unknown model"
    if choice == 11:
        return "/tokenize", b'{"model": "' + MODEL.encode() + b'", "content": ', "bad json"
    if choice == 12:
        return "/tokenize", {"content": words}, "no model"
    return "/nowhere", {"model": MODEL}, "unknown path"


def _request(rng: random.Random, close: bool) -> tuple[bytes, str]:
    """One request's bytes, framed in one of HTTP/1.1's ways (or a broken one)."""
    if rng.random() < 0.12:
        path = rng.choice(["/health", "/v1/models", f"/props?model={MODEL}"])
        head = [f"GET {path} HTTP/1.1".encode(), b"Host: 127.0.0.1"]
        if close:
            head.append(b"Connection: close")
        return b"\r\n".join(head) + b"\r\n\r\n", f"GET {path}"
    path, body, what = _body(rng)
    data = body if isinstance(body, bytes) else json.dumps(body, ensure_ascii=rng.random() < 0.5).encode()
    version = "HTTP/1.0" if rng.random() < 0.05 else "HTTP/1.1"
    head = [f"POST {path} {version}".encode(), b"Host: 127.0.0.1",
            rng.choice([b"Content-Type", b"content-type", b"CONTENT-TYPE"]) + b": application/json"]
    extra = rng.random()
    if extra < 0.08:
        head.append(b"X-Note: caf\xe9")  # a latin-1 byte
    elif extra < 0.14:
        head.append("X-Note: café".encode())  # its UTF-8
    elif extra < 0.18:
        head.append(b"X-Note: one\r\n  folded")  # obs-fold
    elif extra < 0.22:
        head.append(b"Content-Type: application/json")  # the same header twice
    elif extra < 0.25:
        head.append(f"Content-Length: {len(data) + 1}".encode())  # a conflicting length
    elif extra < 0.30:
        head.append(b"X-Pad:    spaced   ")
    if version == "HTTP/1.0" and rng.random() < 0.5:
        head.append(b"Connection: keep-alive")
    if close:
        head.append(b"Connection: close")
    framing = rng.random()
    if framing < 0.15:
        head.append(b"Transfer-Encoding: chunked")
        chunks, at = [], 0
        while at < len(data):
            size = rng.randint(1, max(1, len(data) - at))
            chunks.append(f"{size:x}\r\n".encode() + data[at:at + size] + b"\r\n")
            at += size
        payload = b"".join(chunks) + b"0\r\n\r\n"
        what += " chunked"
    else:
        if framing < 0.25:
            head.append(b"Expect: 100-continue")
            what += " expect"
        head.append(f"Content-Length: {len(data)}".encode())
        payload = data
    return b"\r\n".join(head) + b"\r\n\r\n" + payload, f"{version} {what}"


def _split(rng: random.Random, data: bytes) -> list[bytes]:
    """``data`` cut at 0 to 3 random points (inside heads and bodies alike)."""
    points = sorted({rng.randint(1, len(data) - 1) for _ in range(rng.randint(0, 3))}) if len(data) > 1 else []
    out, last = [], 0
    for p in points:
        out.append(data[last:p])
        last = p
    out.append(data[last:])
    return out


def cases(seed: int, n: int) -> list[Case]:
    """``n`` cases, the same for the same seed."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        case = Case()
        count = rng.randint(1, 5)
        close_last = rng.random() < 0.15
        reqs = [_request(rng, close_last and i == count - 1) for i in range(count)]
        case.requests = count
        case.text = "; ".join(w for _, w in reqs)
        answered = 0
        i = 0
        while i < count:
            mode = rng.random()
            if mode < 0.35 and i + 1 < count:  # pipelined: two or three in one segment
                k = min(count - i, rng.randint(2, 3))
                for part in _split(rng, b"".join(r for r, _ in reqs[i:i + k])):
                    case.steps.append(("send", part, rng.choice([0.0, 0.0, 0.005, 0.03])))
                i += k
            else:
                for part in _split(rng, reqs[i][0]):
                    case.steps.append(("send", part, rng.choice([0.0, 0.0, 0.005, 0.03])))
                i += 1
            if i < count and rng.random() < 0.5:  # the next only once an answer has come
                answered = min(i, answered + 1) if rng.random() < 0.5 else i
                case.steps.append(("await", answered))
        if rng.random() < 0.08:
            case.steps.append(("half_close",))
            case.half_closed = True
        elif rng.random() < 0.1:
            case.steps.append(("late", 0.3))
        out.append(case)
    return out


class _Reader:
    """Responses off one connection, as an HTTP/1.1 client frames them (1xx skipped)."""

    def __init__(self, sock: socket.socket):
        self.sock, self.buf, self.eof = sock, b"", False

    def _fill(self, deadline: float) -> bool:
        if self.eof:
            return False
        self.sock.settimeout(max(0.01, deadline - time.monotonic()))
        try:
            more = self.sock.recv(65536)
        except (socket.timeout, TimeoutError):
            return False
        except OSError:
            more = b""
        if not more:
            self.eof = True
            return False
        self.buf += more
        return True

    def response(self, deadline: float) -> tuple[int, dict, bytes] | None:
        """The next whole response, or None (the connection ended, or the deadline came);
        bytes no HTTP/1.1 client could frame as a response are one of status 0, the rest
        of what came its body."""
        try:
            return self._response(deadline)
        except (ValueError, IndexError):
            while self._fill(deadline):
                pass
            garbled, self.buf, self.eof = self.buf, b"", True
            return 0, {}, garbled

    def _response(self, deadline: float) -> tuple[int, dict, bytes] | None:
        while True:
            while b"\r\n\r\n" not in self.buf:
                if not self._fill(deadline):
                    return None
            head, rest = self.buf.split(b"\r\n\r\n", 1)
            lines = head.split(b"\r\n")
            status = int(lines[0].split()[1])
            headers = {}
            for line in lines[1:]:
                k, _, v = line.decode("latin-1").partition(":")
                headers[k.strip().lower()] = v.strip()
            if 100 <= status < 200:  # 100 Continue
                self.buf = rest
                continue
            self.buf = rest
            if headers.get("transfer-encoding", "").lower() == "chunked":
                body = b""
                while True:
                    while b"\r\n" not in self.buf:
                        if not self._fill(deadline):
                            return None
                    size_line, self.buf = self.buf.split(b"\r\n", 1)
                    size = int(size_line.split(b";")[0], 16)
                    while len(self.buf) < size + 2:
                        if not self._fill(deadline):
                            return None
                    body += self.buf[:size]
                    self.buf = self.buf[size + 2:]
                    if size == 0:
                        return status, headers, body
            if "content-length" in headers:
                n = int(headers["content-length"])
                while len(self.buf) < n:
                    if not self._fill(deadline):
                        return None
                body, self.buf = self.buf[:n], self.buf[n:]
                return status, headers, body
            while self._fill(deadline):  # delimited by the close
                pass
            body, self.buf = self.buf, b""
            return status, headers, body


def normalise(body: bytes) -> object:
    """A body with what differs between runs left out: JSON without ids, times and timings;
    an SSE stream as its events, each so; anything else as it is."""
    def clean(v):
        if isinstance(v, dict):
            return {k: clean(x) for k, x in v.items() if k not in _VOLATILE}
        if isinstance(v, list):
            return [clean(x) for x in v]
        return v
    try:
        return clean(json.loads(body))
    except ValueError:
        pass
    if body.startswith(b"data: ") or b"\n\ndata: " in body or body.startswith(b"event: "):
        events = []
        for event in body.split(b"\n\n"):
            for line in event.split(b"\n"):
                if line.startswith(b"data: "):
                    try:
                        events.append(clean(json.loads(line[6:])))
                    except ValueError:
                        events.append(line[6:].decode("latin-1"))
                elif line:
                    events.append(line.decode("latin-1"))
        return events
    return body.decode("latin-1")


def play(url: str, case: Case, timeout: float = 30.0) -> list[tuple[int, object]]:
    """The case on one new connection: its answers, (status, normalised body), in order."""
    host, port = url.removeprefix("http://").split(":")
    out: list[tuple[int, object]] = []
    deadline = time.monotonic() + timeout
    with socket.create_connection((host, int(port)), timeout=timeout) as sock:
        reader = _Reader(sock)

        def take(n: int) -> None:
            while len(out) < n:
                r = reader.response(deadline)
                if r is None:
                    return
                out.append((r[0], normalise(r[2])))

        for step in case.steps:
            if step[0] == "send":
                if step[2]:
                    time.sleep(step[2])
                try:
                    sock.sendall(step[1])
                except OSError:
                    break  # the server closed the connection (a 400): what it said is read below
            elif step[0] == "await":
                take(step[1])
            elif step[0] == "half_close":
                try:
                    sock.shutdown(socket.SHUT_WR)
                except OSError:
                    pass
            elif step[0] == "late":
                time.sleep(step[1])
        take(case.requests)
        # nothing more may come: an extra answer would be one nobody asked for
        extra = reader.response(time.monotonic() + 0.2) if not reader.eof else None
        if extra is not None:
            out.append((extra[0], normalise(extra[2])))
    return out


def compare(native: list, relay: list, half_closed: bool = False) -> str:
    """What differs between two servers' answers on one case ("": nothing)."""
    if half_closed:
        n = min(len(native), len(relay))
        if native[:n] != relay[:n]:
            return f"answers differ within their common prefix: {_short(native[:n])} != {_short(relay[:n])}"
        return ""
    if native == relay:
        return ""
    if len(native) != len(relay):
        return f"{len(native)} answers against {len(relay)}: {_short(native)} != {_short(relay)}"
    i = next(i for i, (a, b) in enumerate(zip(native, relay)) if a != b)
    return f"answer {i} differs: {_short(native[i])} != {_short(relay[i])}"


def _short(x: object, n: int = 400) -> str:
    text = repr(x)
    return text if len(text) <= n else text[:n] + "..."
