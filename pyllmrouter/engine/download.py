"""A model pulled into llama.cpp's cache, or removed from it: run as a short-lived process.

    python -m pyllmrouter.engine.download org/repo[:tag] [FILE]   one JSON line per progress
        {"progress": {"url", "done", "total"}} ... then {"path": ...} | {"error": ...};
        SIGTERM cancels it (the partial file removed)
    python -m pyllmrouter.engine.download --remove org/repo[:tag]  {"removed": true|false}

llama.cpp's own downloader and cache layout (common/download.cpp, hf-cache.cpp): the
endpoint follows MODEL_ENDPOINT (or HF_ENDPOINT), the cache LLAMA_CACHE (or the Hugging
Face variables), a token HF_TOKEN.  The router reads the lines; it never loads llama.cpp.
"""

from __future__ import annotations

import json
import signal
import sys
import threading
import time

__all__ = ["main"]


def _say(obj: dict) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def main(argv: list[str]) -> int:
    from pyllmrouter.engine.backend import native  # noqa: PLC0415 - this process only

    if argv[:1] == ["--remove"]:
        _say({"removed": bool(native().remove_cached(argv[1]))})
        return 0
    name = argv[0]
    hf_file = argv[1] if len(argv) > 1 else ""  # one file of the repository (llama-server's --hf-file)
    last = [0.0]
    # SIGTERM (DELETE /models while it downloads) cancels as llama.cpp cancels: its downloader
    # stops at the next block and deletes its .downloadInProgress file.  Python runs a
    # signal's handler on the main thread only, between bytecodes: the download runs on a
    # thread of its own (llama.cpp may call back from its own threads), the main thread waits
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())

    def progress(url: str, done: int, total: int) -> bool:
        now = time.monotonic()
        if now - last[0] >= 0.1 or (total and done >= total):  # as llama-server's child throttles
            last[0] = now
            _say({"progress": {"url": url, "done": done, "total": total}})
        return not stop.is_set()

    result: dict = {}

    def download() -> None:
        try:
            result["path"] = native().download_model(name, progress, hf_file)
        except Exception as e:  # noqa: BLE001 - the reason goes to the router
            result["error"] = f"{name}: {e}"

    worker = threading.Thread(target=download, name="download")
    worker.start()
    while worker.is_alive():
        worker.join(0.1)
    _say(result)
    return 0 if "path" in result else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
