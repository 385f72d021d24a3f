"""The app's process is the app's: an app that embeds a Router keeps its own signals, forks
and exits.  Each case runs a user's script in a fresh interpreter of its own session
(so a signal to its process group reaches the app alone, and its workers if they were in
it), with SIGINT and SIGTERM set by the script itself, whatever the shell that started
the tests set."""

from __future__ import annotations

import fcntl
import glob
import json
import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import httpx
import pytest

from pyllmrouter.router.workers.handle import WORKER_ENTRY
from pyllmrouter.tools.loopback import free_port, wait_healthy

pytestmark = pytest.mark.slow

PRELUDE = """
    import glob, json, os, signal, sys, tempfile, threading, time
    signal.signal(signal.SIGINT, signal.default_int_handler)  # as a terminal starts it
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    from pyllmrouter import ModelConfig, ModelSpec, Router, RouterForked, WorkerDied
    from pyllmrouter.devices import EmulatedInventory
    M = {model!r}
    def router(*args):
        return Router([ModelConfig("m", ModelSpec(M, ("-c", "32768", "-np", "1", *args)))],
                      inventory=EmulatedInventory({{"GPU0": 4 << 30}}), margin=0, kv_keep_ram=64 << 20)
    def kept_dir():
        for d in glob.glob("/dev/shm/pyllmrouter-kv-*") + glob.glob(tempfile.gettempdir() + "/pyllmrouter-kv-*"):
            try:
                if open(d + "/.owner").read().strip() == str(os.getpid()):
                    return d
            except OSError:
                pass
    def say(**kw):
        print(json.dumps(kw), flush=True)
    LONG = dict(max_tokens=20000, ignore_eos=True)
"""


def start(tiny, body: str) -> subprocess.Popen:
    """The app's script, started in a session of its own."""
    code = textwrap.dedent(PRELUDE.format(model=str(tiny["tiny-llama"]))) + textwrap.dedent(body)
    return subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)


def said(proc: subprocess.Popen) -> dict:
    line = proc.stdout.readline()
    assert line, proc.communicate(timeout=30)[1][-3000:]
    return json.loads(line)


def ended(proc: subprocess.Popen, timeout: float = 60) -> tuple[list[dict], str]:
    """What the app said to the end, and its stderr (it exited 0)."""
    try:
        out, err = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err[-3000:]
    return [json.loads(line) for line in out.splitlines()], err


def gone(pid: int, within: float) -> bool:
    """Whether process ``pid`` has ended (or is a zombie) within ``within`` seconds."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rpartition(")")[2].split()[0] == "Z":
                    return True
        except FileNotFoundError:
            return True
        time.sleep(0.05)
    return False


def test_a_group_sigterm_lets_the_app_drain_its_stream(tiny):
    """``kill -TERM -PGID`` (as systemd stops a service): the app's handler lets its stream
    go on, and it does (before: the worker died with the app's signal, WorkerDied after
    a few events)."""
    proc = start(tiny, """
        asked = threading.Event()
        signal.signal(signal.SIGTERM, lambda *_: asked.set())
        with router() as r:
            with r.complete("m", "Once", stream=True, **LONG) as events:
                next(events)
                say(streaming=True)
                asked.wait(30)
                t0, n, error = time.monotonic(), 0, None
                try:
                    for _ in range(200):
                        next(events)
                        n += 1
                except (WorkerDied, StopIteration) as e:
                    error = repr(e)
            say(asked=asked.is_set(), events=n, error=error, took=time.monotonic() - t0)
    """)
    assert said(proc) == {"streaming": True}
    os.killpg(proc.pid, signal.SIGTERM)
    out, _ = ended(proc)
    assert out[-1]["asked"] and out[-1]["error"] is None and out[-1]["events"] == 200, out


def test_a_ctrl_c_while_a_worker_starts_leaves_the_worker_alone(tiny):
    """Ctrl-C (SIGINT to the app's group) while its worker starts: the app gets its
    KeyboardInterrupt, the worker starts all the same and serves; no traceback of the
    worker's (before: it died with exit code -2, printing its own traceback)."""
    proc = start(tiny, """
        from pyllmrouter.router.workers.handle import WORKER_ENTRY
        def starting_worker():
            while True:
                for p in os.listdir("/proc"):
                    try:
                        with open(f"/proc/{p}/cmdline", "rb") as f:
                            argv = f.read().split(b"\\0")
                    except OSError:
                        continue
                    if WORKER_ENTRY.encode() in argv:
                        return int(p)
                time.sleep(0.001)
        seen = []
        def ctrl_c():
            seen.append(starting_worker())
            os.killpg(os.getpgrp(), signal.SIGINT)  # the terminal's Ctrl-C: its whole group
        with router("-c", "512") as r:
            try:  # (the worker may be up before the thread has started: the router starts it early)
                threading.Thread(target=ctrl_c, daemon=True).start()
                r.load("m")
                interrupted = False
            except KeyboardInterrupt:
                interrupted = True
            r.load("m")
            reply = r.complete("m", "hi", max_tokens=2)
            counters = r.status()["counters"]
            say(interrupted=interrupted, seen=seen, tokens=reply["usage"]["completion_tokens"],
                failed=counters["load_failures"], died=counters["worker_deaths"])
    """)
    out, err = ended(proc)
    assert out[-1]["seen"] and out[-1]["interrupted"] and out[-1]["tokens"] == 2, out
    assert out[-1]["failed"] == out[-1]["died"] == 0, out
    assert "worker" not in err.lower() and err.count("Traceback") == 0, err


def test_a_forked_child_is_refused_at_once_and_the_parent_keeps_its_states(tiny):
    """After ``os.fork()`` (and in a fork-based Pool) the child's calls on the inherited
    Router raise RouterForked at once; the child leaving the ``with`` block and exiting
    touches nothing of the parent's: its kept-state directory stays, its router serves
    (before: the child's call hung, and its exit removed the parent's directory)."""
    proc = start(tiny, """
        import multiprocessing
        def use():
            t0 = time.monotonic()
            try:
                r.complete("m", "hi", max_tokens=2)
                return None, time.monotonic() - t0
            except RouterForked as e:
                return str(e), time.monotonic() - t0
        with router("-c", "512") as r:
            r.load("m")
            mine = kept_dir()
            pid = os.fork()
            if pid == 0:
                error, took = use()
                say(child=error, took=took)
                sys.exit(0)  # through the with block's close() and the interpreter's exit
            os.waitpid(pid, 0)
            with multiprocessing.get_context("fork").Pool(1) as pool:
                try:
                    pooled = pool.apply(use)[0]
                except RouterForked as e:
                    pooled = str(e)
            reply = r.complete("m", "hi", max_tokens=2)
            say(kept=bool(mine) and os.path.isdir(mine), pooled=pooled, tokens=reply["usage"]["completion_tokens"])
    """)
    out, _ = ended(proc)
    child, parent = out
    assert "fork" in child["child"] and "Build a Router in the child" in child["child"] and child["took"] < 1, out
    assert parent["kept"] and parent["tokens"] == 2, out
    assert parent["pooled"] and "fork" in parent["pooled"], out


def test_a_killed_app_leaves_no_worker_with_its_forked_child(tiny):
    """The app SIGKILLed while a child it forked lives: its worker ends at once, and its
    kept-state directory's lock is free for the next router (before: both lived as long
    as the child held copies of the pipe and the lock)."""
    proc = start(tiny, """
        with router("-c", "512") as r:
            r.load("m")
            if os.fork() == 0:
                time.sleep(60)
                os._exit(0)
            say(worker=r.status()["workers"][0]["pid"], kept=kept_dir())
            time.sleep(60)
    """)
    try:
        got = said(proc)
        proc.kill()
        proc.wait(10)
        assert gone(got["worker"], 5), "the worker outlived its router"
        fd = os.open(Path(got["kept"], ".owner"), os.O_RDONLY)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # BlockingIOError: a child still holds it
        finally:
            os.close(fd)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # the forked child
        proc.communicate(timeout=10)


def test_a_router_never_closed_leaves_no_kept_state_directory(tiny):
    """A script that never closes its Router: its kept-state directory is removed at the
    interpreter's exit (before: left in /dev/shm until a later router started)."""
    proc = start(tiny, """
        r = router("-c", "512")
        r.load("m")
        say(kept=kept_dir())
    """)
    out, _ = ended(proc)
    assert out[0]["kept"] and not os.path.exists(out[0]["kept"]), out


# ``pyllmrouter serve`` as a service manager or a terminal runs it: in a session of its own,
# its SIGINT and SIGTERM as a terminal gives them (uvicorn's handlers replace them)
SERVE = ("import signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); "
         "signal.signal(signal.SIGTERM, signal.SIG_DFL); from pyllmrouter.cli import main; sys.exit(main(sys.argv[1:]))")


def serve_alone(story, tmp_path) -> tuple[subprocess.Popen, str]:
    """``pyllmrouter serve`` of the story model in a session of its own, once it serves;
    its stderr in ``tmp_path/serve.err``."""
    preset = tmp_path / "models.ini"
    preset.write_text(f"[story]\nmodel = {story}\nc = 4096\n")
    port = free_port()
    with open(tmp_path / "serve.err", "w") as err:
        proc = subprocess.Popen([sys.executable, "-c", SERVE, "serve", "--models-preset", str(preset),
                                 "--no-models-cache", "--models-memory-margin", "0", "--emulate-devices", "GPU0=4GiB",
                                 "--kv-keep-ram", "64", "--port", str(port)],
                                stdout=subprocess.DEVNULL, stderr=err, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(base, proc)
    except BaseException:
        os.killpg(proc.pid, signal.SIGKILL)
        raise
    return proc, base


def workers_of(pid: int) -> list[int]:
    """The live worker processes whose parent is ``pid``."""
    out = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/stat") as f:
                state, ppid = f.read().rpartition(")")[2].split()[:2]
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
        except OSError:
            continue
        if int(ppid) == pid and state != "Z" and WORKER_ENTRY.encode() in argv:
            out.append(int(entry))
    return out


def kept_dirs_of(pid: int) -> list[str]:
    """The kept-state directories process ``pid`` made (their ``.owner`` names it)."""
    out = []
    for d in glob.glob("/dev/shm/pyllmrouter-kv-*") + glob.glob(tempfile.gettempdir() + "/pyllmrouter-kv-*"):
        try:
            if Path(d, ".owner").read_text().strip() == str(pid):
                out.append(d)
        except OSError:
            pass
    return out


def stream_then(base: str, proc: subprocess.Popen, signals: list[int], max_tokens: int) -> dict:
    """A streaming chat of ``max_tokens`` tokens; after its first events, ``signals`` sent to
    serve's whole process group, one by one. What the client read, and serve's workers then."""
    events, done, error, workers, kept, t0 = 0, False, None, [], [], time.monotonic()
    try:
        with httpx.stream("POST", base + "/v1/chat/completions", timeout=30,
                          json={"model": "story", "messages": [{"role": "user", "content": "a story"}],
                                "max_tokens": max_tokens, "stream": True}) as r:
            for line in r.iter_lines():
                if not line.startswith("data: "):
                    continue
                events += 1
                done = done or line == "data: [DONE]"
                if events == 5:
                    workers = workers_of(proc.pid)
                    kept = kept_dirs_of(proc.pid)
                    t0 = time.monotonic()
                    for i, sig in enumerate(signals):
                        if i:
                            time.sleep(0.05)
                        os.killpg(proc.pid, sig)
    except httpx.HTTPError as e:
        error = repr(e)
    try:
        proc.wait(30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    return dict(events=events, done=done, error=error, workers=workers, kept=kept, took=time.monotonic() - t0)


def test_serve_drains_its_stream_when_its_process_group_gets_sigterm(story, tmp_path):
    """``pyllmrouter serve`` stopped as systemd stops a service (KillMode=control-group: SIGTERM
    to every process of the group at once): uvicorn drains the stream in flight to its end,
    serve exits 0 by itself, and leaves no worker and no kept-state directory (before: the
    worker died with the group's signal, the stream was cut and serve exited at once)."""
    proc, base = serve_alone(story, tmp_path)
    got = stream_then(base, proc, [signal.SIGTERM], 1500)
    err = (tmp_path / "serve.err").read_text()[-3000:]
    assert got["error"] is None and got["done"] and got["events"] > 1000, (got, err)
    assert proc.returncode == 0, err
    assert got["workers"] and all(gone(p, 5) for p in got["workers"]), got
    assert got["kept"] and not kept_dirs_of(proc.pid), got


def test_serve_ends_quickly_on_two_ctrl_cs_and_leaves_no_worker(story, tmp_path):
    """Two Ctrl-Cs (SIGINT twice to serve's group) while a stream runs: uvicorn quits without
    draining, serve exits at once, and leaves no worker and no kept-state directory."""
    proc, base = serve_alone(story, tmp_path)
    got = stream_then(base, proc, [signal.SIGINT, signal.SIGINT], 20000)
    err = (tmp_path / "serve.err").read_text()[-3000:]
    assert proc.returncode == 0 and got["took"] < 5 and not got["done"], (got, err)
    assert got["workers"] and all(gone(p, 5) for p in got["workers"]), got
    assert got["kept"] and not kept_dirs_of(proc.pid), got
