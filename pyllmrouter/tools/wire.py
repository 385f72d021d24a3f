"""A differential fuzz of the wire: seeded raw HTTP/1.1 byte streams, each sent to two
servers on the same models, whose answers must be the same to any correct client
(tests/native/test_wire.py runs a short seeded run; bench/wire_fuzz.py a long one).

    cases(seed) ──Case: a connection's steps──▶ play(url, case) ──▶ Transcript
                                                  answers (status, headers, body), in order,
                                                  and how the connection ended
    compare(native, relay, case) ──▶ "" or what differs

A case is one client connection: requests (valid ones to a model's endpoints, the router's
own, HEAD, and broken ones: bad JSON, an unknown model or path, duplicate or conflicting
headers, obs-fold, non-ASCII values, Transfer-Encoding with Content-Length), framed in every
way HTTP/1.1 allows (Content-Length, chunked with extensions and trailers, ``Expect:
100-continue``, HTTP/1.0, ``Connection: close``), their bytes split at random points or sent
a byte at a time, with pauses or pipelined, some sent only once an earlier answer has come
(a worker then follows the connection; a pipelined request of another shape crosses its
follow's boundary), large answers read by clients with a small receive buffer that read
slowly or stall, and clients that half-close or reset.  The reference is the relay (``serve
--no-native``), where the router reads every request and writes every answer; the native
path (``serve``: a worker writes the answer on the client's connection and reads its next
requests itself) must give what a client can tell apart from it in no way.

What is compared: each answer's status, its header fields (every one, each name's values
in order), its body, the number and order of answers, and how the connection ended (kept
open, closed by the server, or closed in the middle of an answer).  What is not, and why
(nothing else is tolerated):
- The values two runs of one server differ in: a body's ids, creation times, timings and
  fingerprints, and the slot that served a request and what its cache held (llama.cpp
  picks a slot by each one's history, which a client stopped mid-request at a racing point
  makes part ways) (``_VOLATILE``), and so ``Content-Length``'s value, which follows from them
  (each side's is checked against its own body, and its presence compared); ``Date``'s
  value (its presence and form are compared).
- A header name's case (RFC 9110 5.1: case-insensitive) and the order between fields of
  different names (RFC 9110 5.3: only a name's own values are ordered).
- A client that half-closes is one that has gone to both paths (llama-server's own
  connection check reads the end of a client's stream so, and so does uvicorn): each path
  answers the requests it finished before it saw the end, and no other.  Which those are
  is a race between the end and the answers, so each side's answers must be a prefix of
  the other's (each one whole and the same), and both connections end closed: between
  answers, or in the middle of a stream that was under way when the end was seen (left
  unfinished, never framed as whole).
- A client that resets its connection reads nothing: its cases compare nothing but the
  servers' health after it (``play``'s caller asks ``/health``).
"""

from __future__ import annotations

import json
import random
import re
import socket
import struct
import time
from dataclasses import dataclass, field

__all__ = ["Case", "Transcript", "ResponseReader", "cases", "play", "compare", "normalise", "large_request", "MODEL", "CLASSES",
           "LARGE"]

MODEL = "story"  # a scripted model (tools/scripted.py): its greedy answers are fixed by construction
# what differs between two runs or two servers: ids, times, timings, a process's random marker; and
# which of a model's slots served a request and what its cache held (llama.cpp picks a slot by each
# one's history, and a client that leaves mid-request is stopped at a point that races, so two
# servers' slots part ways after one)
_VOLATILE = frozenset({"id", "created", "timings", "system_fingerprint", "time_ms", "t_prompt_processing",
                       "t_token_generation", "media_marker", "id_slot", "tokens_cached", "cached_tokens"})
_CACHED_PROGRESS = frozenset({"cache", "processed"})  # a prompt_progress's counts that follow the slot's cache
_WORDS = ["once", "upon", "a", "time", "router", "byte", "GPU", "café", "naïve", "日本"]
_IMF_DATE = re.compile(r"(Mon|Tue|Wed|Thu|Fri|Sat|Sun), \d\d (Jan|Feb|Mar|Apr|May|Jun|Jul|Aug|Sep|Oct|Nov|Dec) "
                       r"\d{4} \d\d:\d\d:\d\d GMT")
LARGE = 3_600_000  # bytes of a message whose /apply-template answer is larger than the kernel's buffers
# the kinds of case, and how often each comes (cases() draws them in these proportions)
CLASSES = {"mixed": 50, "half-close": 8, "large, small buffer": 6, "follow boundary": 10, "byte by byte": 8,
           "reset": 4, "framing": 14}


@dataclass
class Case:
    """One connection's steps: ("send", bytes, pause_s) sends bytes (after a pause);
    ("await", n) waits until n answers have come; ("half_close",) shuts the client's
    writing side; ("late", s) reads nothing for s seconds; ("reset",) ends the connection
    with a reset (nothing read after it).  ``requests``: how many complete requests it
    sends (the most answers it can get); ``rcvbuf``: the client's receive buffer (None: the
    system's); ``slow``: it reads a little at a time, pausing between reads."""

    kind: str = "mixed"
    steps: list[tuple] = field(default_factory=list)
    requests: int = 0
    half_closed: bool = False
    reset: bool = False
    rcvbuf: int | None = None
    slow: bool = False
    methods: list[str] = field(default_factory=list)  # each request's, in order (a HEAD's answer has no body)
    text: str = ""  # what it does, for a report


@dataclass
class Transcript:
    """What a client saw on one connection: its answers, (status, header fields, body),
    normalised (``normalise``), and how the connection ended: "open" (kept alive), "closed"
    (by the server, between answers), "cut" (closed in the middle of an answer) or
    "garbled" (bytes no HTTP/1.1 client could frame)."""

    answers: list[tuple[int, tuple, object]] = field(default_factory=list)
    end: str = "open"


def _body(rng: random.Random) -> tuple[str, dict | bytes, str]:
    """(path, body, what) of a POST, valid or not."""
    words = " ".join(rng.choice(_WORDS) for _ in range(rng.randint(1, 6)))
    n = rng.randint(1, 5)
    stream = rng.random() < 0.4
    choice = rng.randint(0, 13)
    if choice <= 2:
        return "/tokenize", {"model": MODEL, "content": words, **({"with_pieces": True} if rng.random() < 0.3
                                                                   else {})}, "tokenize"
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


def _chunked(rng: random.Random, data: bytes, extensions: bool) -> bytes:
    """``data`` in chunks of random sizes; with ``extensions``, chunk extensions and trailer
    fields (which a server must read past and may ignore)."""
    chunks, at = [], 0
    while at < len(data):
        size = rng.randint(1, max(1, len(data) - at))
        ext = rng.choice([b";x=1", b";name", b';q="a b"']) if extensions else b""
        chunks.append(f"{size:x}".encode() + ext + b"\r\n" + data[at:at + size] + b"\r\n")
        at += size
    trailer = b"X-Trailer: done\r\n" if extensions else b""
    return b"".join(chunks) + b"0" + (b";end" if extensions else b"") + b"\r\n" + trailer + b"\r\n"


def _request(rng: random.Random, close: bool, framing: bool = False) -> tuple[bytes, str]:
    """One request's bytes, framed in one of HTTP/1.1's ways (or a broken one); ``framing``:
    the rarer framings more often."""
    if rng.random() < 0.12:
        path = rng.choice(["/health", "/v1/models", f"/props?model={MODEL}"])
        method = "HEAD" if rng.random() < 0.3 else "GET"
        head = [f"{method} {path} HTTP/1.1".encode(), b"Host: 127.0.0.1"]
        if close:
            head.append(b"Connection: close")
        return b"\r\n".join(head) + b"\r\n\r\n", f"{method} {path}"
    path, body, what = _body(rng)
    data = body if isinstance(body, bytes) else json.dumps(body, ensure_ascii=rng.random() < 0.5).encode()
    version = "HTTP/1.0" if rng.random() < (0.25 if framing else 0.05) else "HTTP/1.1"
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
    framing_roll = rng.random() * (0.5 if framing else 1.0)
    if framing_roll < 0.05:  # both framings: a request smuggler's, refused
        head += [b"Transfer-Encoding: chunked", f"Content-Length: {len(data)}".encode()]
        payload = _chunked(rng, data, False)
        what += " TE+CL"
    elif framing_roll < 0.20:
        head.append(b"Transfer-Encoding: chunked")
        extensions = rng.random() < 0.5
        payload = _chunked(rng, data, extensions)
        what += " chunked" + (" ext+trailer" if extensions else "")
    else:
        if framing_roll < 0.30:
            head.append(b"Expect: 100-continue")
            what += " expect"
        head.append(f"Content-Length: {len(data)}".encode())
        payload = data
    return b"\r\n".join(head) + b"\r\n\r\n" + payload, f"{version} {what}"


def _followable(rng: random.Random, i: int) -> bytes:
    """A request a worker may follow: the same request line and headers each time, the same
    model (its body differs)."""
    body = json.dumps({"model": MODEL, "content": f"{rng.choice(_WORDS)} {i}"}).encode()
    return (b"POST /tokenize HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)


def large_request() -> bytes:
    """A request whose answer is megabytes (``LARGE``), cheap to make."""
    body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "x" * LARGE}]}).encode()
    return (b"POST /apply-template HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)


def _split(rng: random.Random, data: bytes) -> list[bytes]:
    """``data`` cut at 0 to 3 random points (inside heads and bodies alike)."""
    points = sorted({rng.randint(1, len(data) - 1) for _ in range(rng.randint(0, 3))}) if len(data) > 1 else []
    out, last = [], 0
    for p in points:
        out.append(data[last:p])
        last = p
    out.append(data[last:])
    return out


def _send(case: Case, rng: random.Random, data: bytes) -> None:
    for part in _split(rng, data):
        case.steps.append(("send", part, rng.choice([0.0, 0.0, 0.005, 0.03])))


def _mixed(case: Case, rng: random.Random, framing: bool = False) -> None:
    count = rng.randint(1, 5)
    close_last = rng.random() < 0.15
    reqs = [_request(rng, close_last and i == count - 1, framing) for i in range(count)]
    case.requests = count
    case.methods += [_method(r) for r, _ in reqs]
    case.text = "; ".join(w for _, w in reqs)
    answered, i = 0, 0
    while i < count:
        if rng.random() < 0.35 and i + 1 < count:  # pipelined: two or three in one segment
            k = min(count - i, rng.randint(2, 3))
            _send(case, rng, b"".join(r for r, _ in reqs[i:i + k]))
            i += k
        else:
            _send(case, rng, reqs[i][0])
            i += 1
        if i < count and rng.random() < 0.5:  # the next only once an answer has come
            answered = min(i, answered + 1) if rng.random() < 0.5 else i
            case.steps.append(("await", answered))
    if rng.random() < 0.1:
        case.steps.append(("late", 0.3))


def _make(kind: str, rng: random.Random) -> Case:
    case = Case(kind=kind)
    if kind in ("mixed", "framing"):
        _mixed(case, rng, framing=kind == "framing")
    elif kind == "half-close":
        _mixed(case, rng)
        case.steps.append(("half_close",))
        case.half_closed = True
    elif kind == "reset":
        _mixed(case, rng)
        case.steps.insert(rng.randint(1, len(case.steps)), ("reset",))
        case.reset = True
    elif kind == "byte by byte":  # every byte its own segment
        data, what = _request(rng, rng.random() < 0.2)
        case.steps += [("send", data[i:i + 1], 0.0) for i in range(len(data))]
        case.requests, case.methods, case.text = 1, [_method(data)], what + ", a byte at a time"
    elif kind == "follow boundary":  # answers a worker follows, then a request of another shape behind one
        n = rng.randint(1, 3)
        for i in range(n):
            case.steps += [("send", _followable(rng, i), 0.0), ("await", i + 1)]
        other, what = _request(rng, False)
        _send(case, rng, _followable(rng, n) + other)
        case.requests, case.methods = n + 2, ["POST"] * (n + 1) + [_method(other)]
        case.text = f"{n} followed, then one more with {what} behind it"
    elif kind == "large, small buffer":  # an answer of megabytes relayed, a small one behind it
        small, what = _request(rng, False)
        case.steps += [("send", large_request() + small, 0.0), ("late", 0.3)]
        case.rcvbuf, case.slow = 4096, rng.random() < 0.5
        case.requests, case.methods = 2, ["POST", _method(small)]
        case.text = f"large template then {what}, receive buffer 4096, {'slow' if case.slow else 'stalled'} reader"
    return case


def cases(seed: int, n: int) -> list[Case]:
    """``n`` cases, the same for the same seed, of every kind in ``CLASSES``'s proportions."""
    rng = random.Random(seed)
    kinds, weights = list(CLASSES), list(CLASSES.values())
    return [_make(rng.choices(kinds, weights)[0], rng) for _ in range(n)]


class ResponseReader:
    """Responses off one connection, as an HTTP/1.1 client frames them (1xx skipped)."""

    def __init__(self, sock: socket.socket, slow: bool):
        self.sock, self.buf, self.eof, self.slow = sock, b"", False, slow

    def _fill(self, deadline: float) -> bool:
        if self.eof:
            return False
        self.sock.settimeout(max(0.01, deadline - time.monotonic()))
        if self.slow:
            time.sleep(0.002)
        try:
            more = self.sock.recv(16384 if self.slow else 262144)
        except (socket.timeout, TimeoutError):
            return False
        except OSError:
            more = b""
        if not more:
            self.eof = True
            return False
        self.buf += more
        return True

    def response(self, deadline: float, head_only: bool = False) -> tuple[int, list, bytes] | str | None:
        """The next whole response; "cut" where the connection ended in its middle; None
        where it ended before one, or the deadline came.  Bytes no HTTP/1.1 client could
        frame as a response are one of status 0, the rest of what came its body."""
        try:
            return self._response(deadline, head_only)
        except (ValueError, IndexError):
            while self._fill(deadline):
                pass
            garbled, self.buf, self.eof = self.buf, b"", True
            return 0, [], garbled

    def _more(self, deadline: float) -> bool | str:
        """More bytes, or why not: "cut" (the server closed) or False (the deadline)."""
        if self._fill(deadline):
            return True
        return "cut" if self.eof else False

    def _response(self, deadline: float, head_only: bool):
        while True:
            while b"\r\n\r\n" not in self.buf:
                more = self._more(deadline)
                if more is not True:
                    return ("cut" if self.buf else None) if more == "cut" else None
            head, rest = self.buf.split(b"\r\n\r\n", 1)
            lines = head.split(b"\r\n")
            status = int(lines[0].split()[1])
            fields = []
            for line in lines[1:]:
                k, _, v = line.decode("latin-1").partition(":")
                fields.append((k.strip().lower(), v.strip()))
            headers = dict(fields)
            self.buf = rest
            if 100 <= status < 200:  # 100 Continue
                continue
            if head_only or status in (204, 304):
                return status, fields, b""
            if headers.get("transfer-encoding", "").lower() == "chunked":
                body = b""
                while True:
                    while b"\r\n" not in self.buf:
                        if (more := self._more(deadline)) is not True:
                            return more or None
                    size_line, self.buf = self.buf.split(b"\r\n", 1)
                    size = int(size_line.split(b";")[0], 16)
                    if size == 0:  # trailer fields, then the empty line
                        while b"\r\n" not in self.buf or (not self.buf.startswith(b"\r\n")
                                                          and b"\r\n\r\n" not in self.buf):
                            if (more := self._more(deadline)) is not True:
                                return more or None
                        self.buf = self.buf[2:] if self.buf.startswith(b"\r\n") else self.buf.split(b"\r\n\r\n", 1)[1]
                        return status, fields, body
                    while len(self.buf) < size + 2:
                        if (more := self._more(deadline)) is not True:
                            return more or None
                    body += self.buf[:size]
                    self.buf = self.buf[size + 2:]
            if "content-length" in headers:
                n = int(headers["content-length"])
                while len(self.buf) < n:
                    if (more := self._more(deadline)) is not True:
                        return more or None
                body, self.buf = self.buf[:n], self.buf[n:]
                return status, fields, body
            while self._fill(deadline):  # delimited by the close
                pass
            body, self.buf = self.buf, b""
            return status, fields, body


def normalise(body: bytes) -> object:
    """A body with what differs between runs left out: JSON without ids, times and timings;
    an SSE stream as its events, each so; anything else as it is."""
    def clean(v, progress: bool = False):
        if isinstance(v, dict):
            return {k: clean(x, k == "prompt_progress") for k, x in v.items()
                    if k not in _VOLATILE and not (progress and k in _CACHED_PROGRESS)}
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


def _fields(fields: list[tuple[str, str]], body: bytes) -> tuple:
    """Header fields as a client may tell them apart: names in lower case, sorted by name
    (each name's values in their order); Date's value as its form, Content-Length's as
    whether it frames the body it came with."""
    out = []
    for name, value in fields:
        if name == "date":
            value = "<date>" if _IMF_DATE.fullmatch(value) else f"<not a date: {value!r}>"
        elif name == "content-length":
            value = "<the body's>" if value == str(len(body)) else f"<{value}, not the body's {len(body)}>"
        out.append((name, value))
    return tuple(sorted(out, key=lambda f: f[0]))


def play(url: str, case: Case, timeout: float = 30.0) -> Transcript:
    """The case on one new connection: what its client saw."""
    host, port = url.removeprefix("http://").split(":")
    out = Transcript()
    deadline = time.monotonic() + timeout
    methods = case.methods
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        if case.rcvbuf:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, case.rcvbuf)
        sock.settimeout(timeout)
        sock.connect((host, int(port)))
        reader = ResponseReader(sock, case.slow)

        def take(n: int) -> bool:
            while len(out.answers) < n:
                r = reader.response(deadline, head_only=len(out.answers) < len(methods)
                                    and methods[len(out.answers)] == "HEAD")
                if r is None or r == "cut":
                    out.end = "cut" if r == "cut" else ("closed" if reader.eof else out.end)
                    return False
                status, fields, body = r
                if status == 0:
                    out.end = "garbled"
                out.answers.append((status, _fields(fields, body), normalise(body)))
            return True

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
            elif step[0] == "reset":
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                return out  # closed with a reset on leaving: nothing more is read
        if case.rcvbuf and not case.slow:  # the stall is over: read at speed (a small window's reads crawl)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
        if take(case.requests) and out.end == "open":
            # nothing more may come: an extra answer would be one nobody asked for; or the close
            extra = reader.response(time.monotonic() + 0.2)
            if extra == "cut":
                out.end = "cut"
            elif extra is not None:
                out.answers.append((extra[0], _fields(extra[1], extra[2]), normalise(extra[2])))
            elif reader.eof:
                out.end = "closed"
    return out


def _method(request: bytes) -> str:
    return request.split(b" ", 1)[0].decode("latin-1")


def compare(native: Transcript, relay: Transcript, case: Case) -> str:
    """What a client could tell apart between two servers' answers on one case ("": nothing)."""
    if case.reset:
        return ""
    for name, seen in (("natively", native), ("relayed", relay)):
        if seen.end == "open" and len(seen.answers) < case.requests:  # neither answered nor closed: a hang
            return f"{len(seen.answers)} of {case.requests} answers {name}, the connection still open"
    if case.half_closed:
        # the answers read before the client's end were owed whole (fewer only where both closed sooner)
        before = max([s[1] for s in case.steps[:case.steps.index(("half_close",))] if s[0] == "await"], default=0)
        if len(native.answers) != len(relay.answers) and min(len(native.answers), len(relay.answers)) < before:
            return f"{len(native.answers)} and {len(relay.answers)} answers, {before} read before the half-close"
        n = min(len(native.answers), len(relay.answers))
        if native.answers[:n] != relay.answers[:n]:
            return f"answers differ within their common prefix: {_short(native.answers[:n])} != " \
                   f"{_short(relay.answers[:n])}"
        if "open" in (native.end, relay.end) or "garbled" in (native.end, relay.end):
            return f"a half-closed connection ended {native.end!r} natively, {relay.end!r} relayed"
        return ""
    if native.answers == relay.answers and native.end == relay.end:
        return ""
    if len(native.answers) != len(relay.answers):
        return f"{len(native.answers)} answers against {len(relay.answers)}: {_short(native.answers)} != " \
               f"{_short(relay.answers)}"
    if native.answers != relay.answers:
        i = next(i for i, (a, b) in enumerate(zip(native.answers, relay.answers)) if a != b)
        return f"answer {i} differs: {_short(native.answers[i])} != {_short(relay.answers[i])}"
    return f"the connection ended {native.end!r} natively, {relay.end!r} relayed"


def _short(x: object, n: int = 600) -> str:
    text = repr(x)
    return text if len(text) <= n else text[:n] + "..."
