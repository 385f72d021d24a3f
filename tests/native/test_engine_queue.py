"""llama.cpp's task queue as the engine runs it here (cmake/llama_engine.cmake's second change):
a slot that frees puts back every deferred task, so a slot action (save, restore, erase),
which frees no slot when it ends, never leaves a completion deferred behind it waiting for
some other task to end."""

from __future__ import annotations

import threading
import time

from pyllmrouter import ModelConfig, ModelSpec, Router
from pyllmrouter.tools import tinymodels

SHARE_PROBE_CACHE = True


def busy(r: Router) -> bool:
    return any(s["is_processing"] for s in r.call("m", "GET", "/slots")[0].json())


def test_a_completion_deferred_behind_a_slot_save_runs_once_the_slot_frees(tmp_path):
    model = tinymodels.write_llama(tmp_path / "m.gguf", tinymodels.LLAMA_100M)
    spec = ModelSpec(str(model), ("-np", "1", "-c", "2048", "--slot-save-path", f"{tmp_path}/"))
    with Router([ModelConfig("m", spec)]) as r:
        r.complete("m", "warm", max_tokens=2)
        out: dict = {}

        def run(key, fn):
            t = threading.Thread(target=lambda: out.__setitem__(key, (fn(), time.monotonic())), daemon=True)
            t.start()
            return t

        first = run("first", lambda: r.complete("m", "a long story", max_tokens=400, ignore_eos=True))
        while not busy(r):
            time.sleep(0.01)
        # the slot is busy: the save is deferred, then the second completion behind it
        save = run("save", lambda: r.call("m", "POST", "/slots/0", {"filename": "s.bin"}, {"action": "save"})[0])
        time.sleep(0.3)
        second = run("second", lambda: r.complete("m", "short", max_tokens=2))
        time.sleep(0.3)
        assert "second" not in out and busy(r)  # both wait behind the first
        first.join(120)
        ended = time.monotonic()
        save.join(30)
        second.join(30)  # without the change: deferred until another request comes, here never
        assert out["save"][0].status == 200 and (tmp_path / "s.bin").exists()
        assert "second" in out, "the completion deferred behind the slot save never ran"
        assert out["second"][1] - ended < 10
