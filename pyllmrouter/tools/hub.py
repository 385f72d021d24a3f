"""A Hugging Face hub on loopback, serving local files as repositories, in the layout
llama.cpp's downloader reads (common/hf-cache.cpp, download.cpp): for the tests and the
llama.cpp server suite, offline.

    GET  /api/models/{org}/{repo}/refs                     {"branches": [{"name": "main", "targetCommit"}]}
    GET  /api/models/{org}/{repo}/tree/{commit}?recursive  [{"type": "file", "path", "oid", "lfs": {...}}]
    HEAD /{org}/{repo}/resolve/{commit}/{path}             size and ETag
    GET  /{org}/{repo}/resolve/{commit}/{path}             the file (Range: bytes=A-B honoured,
                                                           a 206 with that part)

    with LocalHub({"org/repo": {"model-Q8_0.gguf": "/path/to/file.gguf"}}) as endpoint:
        os.environ["MODEL_ENDPOINT"] = endpoint      # llama.cpp downloads from here

Requests are counted per path (``hits``), and the body bytes sent per file (``served``,
by the file's path in its repository), so a test can tell whether a file was fetched and
how much of it.  ``ranges=False`` makes it a hub that ignores Range (the whole file, 200);
``token`` one that answers 401 to a request without ``Authorization: Bearer <token>``.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Mapping
from urllib.parse import unquote, urlparse

__all__ = ["LocalHub"]


def _oid(path: Path) -> str:
    """A stable 64-hex id of the file (its path, size and time: no need to read it)."""
    st = path.stat()
    return hashlib.sha256(f"{path.resolve()}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()


class LocalHub:
    def __init__(self, repos: Mapping[str, Mapping[str, str | os.PathLike]], host: str = "127.0.0.1",
                 rate: int | None = None, ranges: bool = True, token: str | None = None):
        """``rate``: bytes per second a file's body is sent at (None: at once), so a test can
        act while a download is under way; ``ranges``: whether Range is honoured; ``token``:
        the bearer token every request must carry (None: none)."""
        self.repos = {repo: {name: Path(p) for name, p in files.items()} for repo, files in repos.items()}
        self.rate = rate
        self.ranges = ranges
        self.token = token
        self.hits: dict[str, int] = {}
        self.served: dict[str, int] = {}
        self._lock = threading.Lock()
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:  # quiet
                pass

            def do_HEAD(self) -> None:
                hub.serve(self, body=False)

            def do_GET(self) -> None:
                hub.serve(self, body=True)

        self._server = ThreadingHTTPServer((host, 0), Handler)
        self.endpoint = f"http://{host}:{self._server.server_address[1]}/"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @staticmethod
    def commit(repo: str) -> str:
        return hashlib.sha1(repo.encode()).hexdigest()

    def __enter__(self) -> str:
        self._thread.start()
        return self.endpoint

    def __exit__(self, *exc) -> None:
        self._server.shutdown()
        self._server.server_close()

    def _reply(self, h: BaseHTTPRequestHandler, status: int, data: bytes, ctype: str, body: bool,
               extra: dict[str, str] | None = None) -> None:
        h.send_response(status)
        h.send_header("Content-Type", ctype)
        h.send_header("Content-Length", str(len(data)))
        for k, v in (extra or {}).items():
            h.send_header(k, v)
        h.end_headers()
        if body:
            h.wfile.write(data)

    def _send(self, h: BaseHTTPRequestHandler, data: bytes, name: str) -> None:
        """``data`` sent in steps (at ``rate``), each step counted in ``served[name]`` once
        written: a reader that stops early (a header read from a hub without Range) is
        charged only what it took."""
        step = 1 << 16 if self.rate is None else max(1, self.rate // 20)
        try:
            for i in range(0, len(data), step):
                h.wfile.write(data[i:i + step])
                h.wfile.flush()
                with self._lock:
                    self.served[name] = self.served.get(name, 0) + len(data[i:i + step])
                if self.rate is not None:
                    time.sleep(step / self.rate)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the reader stopped

    def serve(self, h: BaseHTTPRequestHandler, body: bool) -> None:
        path = unquote(urlparse(h.path).path)
        with self._lock:
            self.hits[path] = self.hits.get(path, 0) + 1
        parts = path.strip("/").split("/")
        if self.token is not None and h.headers.get("Authorization") != f"Bearer {self.token}":
            return self._reply(h, 401, json.dumps({"error": "Invalid credentials in Authorization header"}).encode(),
                               "application/json", body)
        if parts[:2] == ["api", "models"] and len(parts) >= 5:
            repo = "/".join(parts[2:4])
            if repo not in self.repos:
                return self._reply(h, 404, json.dumps({"error": "Repository not found"}).encode(),
                                   "application/json", body)
            if parts[4] == "refs":
                doc = {"branches": [{"name": "main", "ref": "refs/heads/main", "targetCommit": self.commit(repo)}]}
            else:
                doc = [{"type": "file", "path": name, "size": p.stat().st_size,
                        "oid": hashlib.sha1(name.encode()).hexdigest(),
                        "lfs": {"oid": _oid(p), "size": p.stat().st_size}} for name, p in self.repos[repo].items()]
            return self._reply(h, 200, json.dumps(doc).encode(), "application/json", body)
        if len(parts) >= 5 and parts[2] == "resolve":
            repo, name = "/".join(parts[:2]), "/".join(parts[4:])
            file = self.repos.get(repo, {}).get(name)
            if file is None:
                return self._reply(h, 404, b"Entry not found", "text/plain", body)
            return self._file(h, name, file, body)
        return self._reply(h, 404, b"Not found", "text/plain", body)

    def _file(self, h: BaseHTTPRequestHandler, name: str, file: Path, body: bool) -> None:
        """The file, or the part Range asks for (one range, as the hub serves it)."""
        size = file.stat().st_size
        start, end = 0, size - 1
        wanted = re.fullmatch(r"bytes=(\d+)-(\d*)", h.headers.get("Range", "").strip())
        partial = self.ranges and wanted is not None
        if partial:
            start = int(wanted[1])
            end = min(size - 1, int(wanted[2])) if wanted[2] else size - 1
            if start >= size or end < start:
                return self._reply(h, 416, b"", "text/plain", body, {"Content-Range": f"bytes */{size}"})
        h.send_response(206 if partial else 200)
        h.send_header("Content-Type", "application/octet-stream")
        h.send_header("Content-Length", str(end - start + 1))
        h.send_header("ETag", f'"{_oid(file)}"')
        h.send_header("Accept-Ranges", "bytes" if self.ranges else "none")
        if partial:
            h.send_header("Content-Range", f"bytes {start}-{end}/{size}")
        h.end_headers()
        if body:
            with open(file, "rb") as f:
                f.seek(start)
                data = f.read(end - start + 1)
            self._send(h, data, name)
        return None
