"""Models pulled into llama.cpp's cache (POST /models), each in a short-lived process.

    start(name) ──▶ python -m pyllmrouter.engine.download NAME (llama.cpp's downloader)
                    ◀── JSON lines: progress ... path | error
        progress ──▶ the bus: download_progress {progress: {url: {done, total}}}
        the end  ──▶ the bus: download_finished | download_failed {error}; on_done(name, path, error)
    cancel(name) ──▶ SIGTERM: llama.cpp's downloader cancels, its partial file removed
                     (DELETE /models while it downloads); killed if it does not end
    remove(name) ──▶ python -m pyllmrouter.engine.download --remove NAME

One download per name at a time, and at most ``max_active`` at once (more: Busy, a
429); the last ``max_failed`` failures stay listed.  What a download owns (its process, its progress)
changes under ``_lock`` only; the router process never loads llama.cpp.
"""

from __future__ import annotations

import collections
import json
import logging
import subprocess
import sys
import threading
import time
from typing import Any, Callable

from pyllmrouter.errors import Busy
from pyllmrouter.router.services.events import EventBus

__all__ = ["Downloads"]

_LOG = logging.getLogger(__name__)


class Downloads:
    def __init__(self, bus: EventBus, on_done: Callable[[str, str | None, str | None], None],
                 max_active: int = 4, max_failed: int = 32):
        """``on_done(name, path, error)``: a download ended (path or error), no lock held; called
        before the download leaves the list and its end is published."""
        self._bus = bus
        self._max_active, self._max_failed = max_active, max_failed
        self._on_done = on_done
        self._lock = threading.Lock()
        self._procs: dict[str, subprocess.Popen] = {}
        self._state: dict[str, dict[str, Any]] = {}  # name -> {"status", "progress", "error"}

    def room(self, name: str) -> None:
        """What ``start`` would refuse now, raised (ValueError, Busy), before anything starts."""
        with self._lock:
            self._room(name)

    def _room(self, name: str) -> None:
        if name in self._procs:
            raise ValueError(f"model {name!r} is already being downloaded")
        if len(self._procs) >= self._max_active:
            raise Busy(f"{len(self._procs)} downloads are under way, the most at once: pull {name!r} "
                       f"once one has ended")

    def start(self, name: str) -> None:
        with self._lock:
            self._room(name)
            proc = subprocess.Popen([sys.executable, "-m", "pyllmrouter.engine.download", name],
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            self._procs[name] = proc
            self._state[name] = {"status": "downloading", "progress": {}, "error": None}
        self._bus.publish("status_change", name, status="downloading")
        threading.Thread(target=self._follow, args=(name, proc), name=f"download-{name}", daemon=True).start()

    def _follow(self, name: str, proc: subprocess.Popen) -> None:
        path, error = None, None
        said: collections.deque[str] = collections.deque(maxlen=64)  # llama.cpp's log says why (a 404...)
        reader = threading.Thread(target=lambda: said.extend(proc.stderr), daemon=True)
        reader.start()
        for line in proc.stdout:
            try:
                msg = json.loads(line)
            except ValueError:
                continue
            if "progress" in msg:
                p = msg["progress"]
                with self._lock:
                    st = self._state.get(name)  # none: cancelled meanwhile
                    progress = st["progress"] if st is not None else {}
                    progress[p["url"]] = {"done": p["done"], "total": p["total"]}
                    snapshot = {u: dict(v) for u, v in progress.items()}
                self._bus.publish("download_progress", name, progress=snapshot)
            elif "path" in msg:
                path = msg["path"]
            elif "error" in msg:
                error = msg["error"]
        code = proc.wait()
        reader.join(5)
        if path is None and error is None:
            error = f"{name}: the download stopped (exit code {code})"
        why = [line.strip() for line in said if "error" in line.lower() or "failed" in line.lower()]
        if error is not None and why:
            error = f"{error} ({'; '.join(why[-2:])})"
        try:
            self._on_done(name, path, error)  # a model that came is in the list before it is said to have
        except Exception:  # noqa: BLE001 - its file is in the cache all the same: listed at the next reading
            _LOG.exception("after the download of %s", name)
        finally:  # the slot is free whatever on_done did
            with self._lock:
                self._procs.pop(name, None)
                listed = self._state.pop(name, None) is not None  # not: cancelled (DELETE /models)
                if path is None and listed:  # listed again, at the end: the newest failure
                    self._state[name] = {"status": "failed", "progress": {}, "error": error}
                    failed = [n for n, st in self._state.items() if st["status"] == "failed"]
                    for old in failed[:max(0, len(failed) - self._max_failed)]:
                        del self._state[old]
        # finished: llama.cpp's downloader returned (a model file came, or it found none and
        # said nothing: llama-server's router calls that finished too); failed: it raised
        self._bus.publish("download_finished" if path is not None else "download_failed", name,
                          **({"error": error} if error else {}))

    def cancel(self, name: str) -> bool:
        """Stop a download as llama.cpp cancels one (SIGTERM: its downloader stops at the next
        block and deletes the partial file); killed if it has not ended in ``CANCEL_GRACE``
        seconds (a transfer that never moves).  Whether one was under way."""
        with self._lock:
            proc = self._procs.get(name)
            self._state.pop(name, None)
        if proc is not None:
            proc.terminate()
            threading.Thread(target=_kill_late, args=(proc,), name=f"cancel-{name}", daemon=True).start()
        return proc is not None

    def status(self) -> dict[str, dict[str, Any]]:
        """Downloads under way or failed: name -> {status, progress, error}."""
        with self._lock:
            return {n: {"status": s["status"], "progress": {u: dict(p) for u, p in s["progress"].items()},
                        "error": s["error"]} for n, s in self._state.items()}

    def forget(self, name: str) -> None:
        with self._lock:
            if name not in self._procs:
                self._state.pop(name, None)

    @staticmethod
    def remove(name: str) -> bool:
        """Remove ``name`` from llama.cpp's cache (in a short-lived process)."""
        proc = subprocess.run([sys.executable, "-m", "pyllmrouter.engine.download", "--remove", name],
                              capture_output=True, text=True, timeout=120)
        try:
            return bool(json.loads(proc.stdout.strip().splitlines()[-1])["removed"])
        except (ValueError, IndexError, KeyError):
            raise RuntimeError(f"removing {name} failed: {proc.stderr.strip()[-500:]}") from None

    def close(self, grace: float = 2.0) -> None:
        """Cancel every download (llama.cpp removes their partial files), killing within ``grace``."""
        with self._lock:
            procs = list(self._procs.values())
        for p in procs:
            p.terminate()
        deadline = time.monotonic() + grace
        for p in procs:
            try:
                p.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()


CANCEL_GRACE = 5.0  # seconds a cancelled download has to end before it is killed


def _kill_late(proc: subprocess.Popen) -> None:
    try:
        proc.wait(CANCEL_GRACE)
    except subprocess.TimeoutExpired:
        proc.kill()
