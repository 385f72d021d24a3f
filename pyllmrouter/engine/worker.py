"""The worker process: one per device set, hosting models in-process.

    main thread:  conn.recv() ─┬─ LoadModel ──▶ loader thread: Engine(spec args + args).load()
                               │                 ─▶ Loaded | Failed
                               ├─ Call ───────▶ the model's EngineHost (hosting.py): a thread
                               │                 per request ─▶ Chunk* Result | Failed
                               ├─ UnloadModel ▶ unloader thread: EngineHost.close ─▶ Unloaded
                               │                 (a load under way: cancelled, its engine freed
                               │                 once it lands, then Unloaded)
                               ├─ StartServices ▶ llama-server's /tools and /cors-proxy, hosted
                               │                 as the model named SERVICES ─▶ Result | Failed
                               ├─ Cancel ─────▶ the request's StopFlag
                               ├─ Probe / Fit ▶ probe thread ─▶ Result | Failed
                               ├─ Ping ───────▶ Result(None), at once (the heartbeat)
                               └─ Shutdown / EOF (router gone) ──▶ os._exit, models and all
    router-watch thread: the router's process ended (killed, and a fork of it holding
                         our pipe) ──▶ os._exit, models and all

Each model is llama.cpp's own server engine (a server_context with its slot
loop on its own thread), so it answers every request as llama-server does;
the models of one worker share its backends (one context per device).  The
device mask is applied to the environment before llama_cpp is imported, so
this process can only ever see (and create contexts on) its own devices.  The
app's signals are not its own: it runs in a session of its own with SIGINT and
SIGTERM ignored from its first instruction (router/workers/handle.py).
"""

from __future__ import annotations

import logging
import os
import select
import sys
import threading
import time
from typing import Any, Callable

from pyllmrouter.engine.hosting import EngineHost
from pyllmrouter.engine.slots import restore_all, save_all
from pyllmrouter.protocol import (SERVICES, Call, Cancel, ErrorKind, Failed, Fit, LoadModel, Loaded, Ping, Probe,
                                  Progress, Ready, Result, Shutdown, StartServices, Unloaded, UnloadModel)

__all__ = ["main", "worker_main"]

_LOG = logging.getLogger(__name__)


def _rss() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


# The models of a worker share its cores.  llama.cpp's threads poll for work after each step
# (--poll, right for llama-server's one model per process); here the threads of a model that
# has stepped would spin against the next model's.  They wait without polling unless the
# model's own arguments set --poll.
SHARED_CORES = ("--poll", "0")

class _Worker:
    def __init__(self, conn, conduit):
        self.conn = conn
        self.conduit = conduit  # the native data path: requests answered on the client's socket
        self.send_lock = threading.Lock()
        self.models: dict[str, EngineHost] = {}  # main thread and loader threads, under models_lock
        # a load under way: (cancelled, ended), set by an UnloadModel and by the loader thread
        self.loading: dict[str, tuple[threading.Event, threading.Event]] = {}
        self.models_lock = threading.Lock()

    def send(self, msg: Any) -> None:
        with self.send_lock:
            self.conn.send(msg)

    def _load(self, msg: LoadModel) -> None:
        from pyllmrouter.engine.backend import native  # noqa: PLC0415
        from pyllmrouter.engine.loader import load  # noqa: PLC0415
        from pyllmrouter.memory import aggregate
        from pyllmrouter.engine.probe import live_breakdown  # noqa: PLC0415

        try:
            t0 = time.perf_counter()
            shared = () if "--poll" in msg.spec.args else SHARED_CORES
            engine = load(msg.spec, *shared, name=msg.alias or msg.name,
                          progress=lambda p: self.send(Progress(msg.req_id, p)))
            pools = {d.device: d.total for d in aggregate(live_breakdown(engine))}
            restored, refused = restore_all(engine, list(msg.restore)) if msg.restore else ({}, {})
            with self.models_lock:
                taken = msg.name in self.models
                cancelled = msg.name in self.loading and self.loading[msg.name][0].is_set()
                if not (taken or cancelled):
                    self.models[msg.name] = EngineHost(msg.name, engine, native(), self.send, msg.keep_dir,
                                                       restored=len(restored), stream_interval=msg.stream_interval,
                                                       conduit=self.conduit)
            if taken or cancelled:
                engine.close()
                raise RuntimeError(f"the load of {msg.name!r} was cancelled (it did not end in time)" if cancelled
                                   else f"model {msg.name!r} is already loaded in this worker")
            self.send(Loaded(msg.req_id, msg.name, pools, time.perf_counter() - t0, restored, refused))
        except (ValueError, RuntimeError, OSError) as e:  # llama.cpp's refusal: arguments, file, memory
            self.send(Failed(msg.req_id, ErrorKind.LOAD_FAILED, f"{type(e).__name__}: {e}"))
        except Exception as e:  # noqa: BLE001 - a bug: logged, and the load fails
            _LOG.exception("loading %s", msg.name)
            self.send(Failed(msg.req_id, ErrorKind.INTERNAL, f"{type(e).__name__}: {e}"))
        finally:
            with self.models_lock:
                _, ended = self.loading.pop(msg.name, (None, None))
            if ended is not None:
                ended.set()

    def _unload_loading(self, msg: UnloadModel, ended: threading.Event) -> None:
        """An UnloadModel for a load under way: it is cancelled (its engine freed once it
        lands); Unloaded once the loader thread is done with it."""
        ended.wait()
        with self.models_lock:
            host = self.models.pop(msg.name, None)  # none: the cancel came in time
        if host is not None:
            self._unload(msg, host)
        else:
            self.send(Unloaded(msg.req_id, msg.name))

    def _start_services(self, msg: StartServices) -> None:
        from pyllmrouter.engine.backend import native  # noqa: PLC0415

        try:
            services = native().Services(list(msg.args))
        except (ValueError, RuntimeError) as e:  # llama.cpp's refusal (an MCP server that does not start...)
            self.send(Failed(msg.req_id, ErrorKind.LOAD_FAILED, f"{type(e).__name__}: {e}"))
            return
        with self.models_lock:
            self.models[SERVICES] = EngineHost("services", services, native(), self.send)
        self.send(Result(msg.req_id, None))

    def close_services(self) -> None:
        with self.models_lock:
            host = self.models.pop(SERVICES, None)
        if host is not None:
            host.engine.close()

    def _unload(self, msg: UnloadModel, host: EngineHost) -> None:
        kept: list = []
        try:
            if msg.keep and host.keep_dir:
                directory = msg.directory or host.keep_dir
                kept = host.close(lambda engine: save_all(engine, directory, msg.budget)) or []
            else:
                host.close()
        except Exception:  # noqa: BLE001 - a state not saved is a state not kept; the unload goes on
            _LOG.exception("saving the slots of %s", msg.name)
        finally:
            self.send(Unloaded(msg.req_id, msg.name, tuple(kept), host.hits))

    def _probe(self, msg: Probe | Fit) -> None:
        from pyllmrouter.engine.fit import FitError, fit_here  # noqa: PLC0415
        from pyllmrouter.memory import ProbeError
        from pyllmrouter.engine.probe import probe  # noqa: PLC0415

        try:
            if isinstance(msg, Fit):
                self.send(Result(msg.req_id, fit_here(msg.spec, msg.grants).to_dict()))
            else:
                self.send(Result(msg.req_id, probe(msg.spec).to_dict()))
        except FitError as e:
            self.send(Failed(msg.req_id, ErrorKind.NO_FIT, str(e)))
        except ProbeError as e:
            self.send(Failed(msg.req_id, ErrorKind.PROBE_FAILED, str(e)))
        except Exception as e:  # noqa: BLE001 - a bug: logged, and the request fails
            _LOG.exception("probing %s", msg.spec.path)
            self.send(Failed(msg.req_id, ErrorKind.INTERNAL, f"{type(e).__name__}: {e}"))

    def serve(self) -> None:
        while True:
            try:
                msg = self.conn.recv()
            except (EOFError, OSError):
                return  # the router is gone: so are we
            if isinstance(msg, Shutdown):
                return
            if isinstance(msg, Ping):
                self.send(Result(msg.req_id, None))
            elif isinstance(msg, Cancel):
                with self.models_lock:
                    hosts = list(self.models.values())
                any(h.cancel(msg.req_id) for h in hosts)
            elif isinstance(msg, LoadModel):
                with self.models_lock:  # before the thread: an UnloadModel read next finds it
                    self.loading[msg.name] = (threading.Event(), threading.Event())
                threading.Thread(target=self._load, args=(msg,), daemon=True).start()
            elif isinstance(msg, StartServices):
                threading.Thread(target=self._start_services, args=(msg,), daemon=True).start()
            elif isinstance(msg, (Probe, Fit)):
                threading.Thread(target=self._probe, args=(msg,), daemon=True).start()
            elif isinstance(msg, UnloadModel):
                with self.models_lock:
                    loading = self.loading.get(msg.name)
                    host = self.models.pop(msg.name, None) if loading is None else None
                if loading is not None:
                    loading[0].set()
                    threading.Thread(target=self._unload_loading, args=(msg, loading[1]), daemon=True).start()
                elif host is None:
                    self.send(Unloaded(msg.req_id, msg.name))
                else:
                    threading.Thread(target=self._unload, args=(msg, host), daemon=True).start()
            elif isinstance(msg, Call):
                with self.models_lock:
                    host = self.models.get(msg.name)
                if host is None:
                    self.send(Failed(msg.req_id, ErrorKind.NOT_LOADED, f"model {msg.name!r} is not loaded here"))
                else:
                    host.call(msg)


def main() -> None:
    """The process's entry point (router/workers/handle.py starts it: the device mask is already in
    its environment, SIGINT and SIGTERM are ignored, and its last arguments are the router's
    pid, the conduit's descriptor and the pipe's)."""
    from multiprocessing.connection import Connection  # noqa: PLC0415

    worker_main(Connection(int(sys.argv[-1])), int(sys.argv[-2]), int(sys.argv[-3]))


def _watch_router(router_pid: int, leave: Callable[[], None]) -> None:
    """``leave()`` once process ``router_pid``, our parent, has ended (however it ended:
    SIGKILL too, and whoever else holds a copy of our pipe, a fork of the router, say).
    Its pidfd is readable once it has ended; where there is none (a kernel before 5.3),
    our parent is polled.  A parent already gone is seen at once (we were handed over)."""
    fd = None
    try:
        fd = os.pidfd_open(router_pid)
    except (AttributeError, OSError):
        pass  # no pidfd here: polled below
    if fd is not None and os.getppid() == router_pid:  # the pidfd is our parent's, not a reused pid's
        ended = select.poll()
        ended.register(fd, select.POLLIN)
        ended.poll()
    while os.getppid() == router_pid:
        time.sleep(0.5)
    leave()


def _leave(worker: _Worker, code: int) -> None:
    """End the process: its MCP servers stopped (processes of ours), no interpreter
    finalisation (each model's slot loop is a C++ thread still running: C++ static
    destructors under them would make std::terminate abort the process, a core and a
    backtrace for every exit)."""
    worker.close_services()
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(code)


def worker_main(conn, conduit_fd: int, router_pid: int | None = None) -> None:
    """Serve the router on ``conn`` until it says Shutdown or goes (its end of the pipe
    closed, or its process ``router_pid`` ended); ``conduit_fd``: the worker's end of the
    native data path (client connections handed over)."""
    os.set_inheritable(conduit_fd, False)
    # the pipe came through pass_fds, inheritable: a process this worker starts (an MCP
    # server, a tool's shell) would hold it open, and the router would not see us end
    os.set_inheritable(conn.fileno(), False)
    from pyllmrouter.engine.backend import bindings_only, native  # noqa: PLC0415 - llama_cpp under the mask
    from pyllmrouter.devices import RPC_ENV  # noqa: PLC0415

    bindings_only()  # nothing here uses llama_cpp's Llama: its imports are not paid for
    rpc = [e for e in os.environ.get(RPC_ENV, "").split(",") if e]
    if rpc:
        native().add_rpc_servers(rpc)  # this worker's devices: its rpc-servers, as RPC0, RPC1...
    native().devices()  # initialise the backends now, so the overhead below is real
    worker = _Worker(conn, native().Conduit(conduit_fd))
    if router_pid is not None:  # from here on (a router gone meanwhile is seen at once)
        threading.Thread(target=_watch_router, args=(router_pid, lambda: _leave(worker, 0)), name="router-watch",
                         daemon=True).start()
    worker.send(Ready(os.getpid(), {"CPU": _rss()}))
    code = 0
    try:
        worker.serve()
    except BaseException:  # a bug, or a message cut off by a router that died mid-send
        _LOG.exception("worker %d", os.getpid())
        code = 1
    finally:
        _leave(worker, code)
