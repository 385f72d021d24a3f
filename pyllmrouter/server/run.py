"""``pyllmrouter serve``: options (llama-server's names and LLAMA_ARG_* variables)
-> Router -> FastAPI app -> uvicorn, with graceful shutdown on SIGTERM/SIGINT."""

from __future__ import annotations

import argparse
import asyncio
import functools
import contextlib
import os
import signal
import socket
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Callable, Sequence

from pyllmrouter.config import MiB, RouterOptions
from pyllmrouter.devices import EmulatedInventory, RpcInventory, SystemInventory, parse_budgets
from pyllmrouter.errors import WorkerDied
from pyllmrouter.router.services.tools import Services, settings, wanted
from pyllmrouter.router.services.sources import Sources
from pyllmrouter.server.browser import is_loopback_bind
from pyllmrouter.server.starting import Starting

if TYPE_CHECKING:
    from pyllmrouter.router.api import Router

__all__ = ["add_serve_arguments", "allowed_hosts", "parse_serve_args", "router_from_args", "serve"]

# the seconds llama-server's router sleeps per request and per load under its test hook
# LLAMA_SERVER_DEBUG_FAKE_TIMING (tools/server/server-models.cpp)
_FAKE_TIMING = 2.0


def _env(name: str, default: Any = None) -> Any:
    return os.environ.get(name, default)


def _env_bool(name: str, default: bool) -> bool:
    v = os.environ.get(name)
    return default if v is None else v.strip().lower() in ("1", "true", "on", "yes", "enabled")


def add_serve_arguments(p: argparse.ArgumentParser) -> None:
    """``pyllmrouter serve``'s own options, by subject (in the order ``--help`` lists them)."""
    _model_arguments(p)
    _listen_arguments(p)
    _scheduling_arguments(p)
    _serving_arguments(p)


def _model_arguments(p: argparse.ArgumentParser) -> None:
    """The models served, the memory kept free for them, the devices they go to."""
    p.add_argument("--models-preset", default=_env("LLAMA_ARG_MODELS_PRESET"), help="llama-server preset INI")
    p.add_argument("--models-dir", default=_env("LLAMA_ARG_MODELS_DIR"), help="directory of GGUF models")
    p.add_argument("--models-max", type=int, default=int(_env("LLAMA_ARG_MODELS_MAX", 0)),
                   help="most models loaded at once (0 = no count limit; memory still limits)")
    p.add_argument("--models-memory-margin", type=int, default=None, metavar="MiB",
                   help="MiB kept free on every device (default 1024, or the preset's memory-margin)")
    p.add_argument("--device-budget", default=_env("PYLLMROUTER_DEVICE_BUDGET"),
                   help="per-device caps, e.g. CUDA0=20GiB,CPU=32GiB")
    p.add_argument("--emulate-devices", default=_env("PYLLMROUTER_EMULATE_DEVICES"),
                   help="virtual devices run by the CPU backend, e.g. GPU0=24GiB,GPU1=24GiB[,CPU=32GiB]")
    p.add_argument("--rpc-devices", default=_env("PYLLMROUTER_RPC_DEVICES"),
                   help="llama.cpp rpc-servers as devices RPC0, RPC1..., e.g. 10.0.0.2:50052=20GiB,10.0.0.3:50052=20GiB")
    p.add_argument("--models-autoload", dest="autoload", action=argparse.BooleanOptionalAction,
                   default=_env_bool("LLAMA_ARG_MODELS_AUTOLOAD", True))
    p.add_argument("--models-cache", action=argparse.BooleanOptionalAction,
                   default=_env_bool("PYLLMROUTER_MODELS_CACHE", True),
                   help="serve the models of llama.cpp's cache of downloads too, as llama-server's router does")
    p.add_argument("--watch", action=argparse.BooleanOptionalAction, default=False,
                   help="read the preset, the models directory and the cache again when they change "
                        "(GET /models?reload=1 always does)")


def _listen_arguments(p: argparse.ArgumentParser) -> None:
    """Where the server listens, and who may call it."""
    p.add_argument("--host", default=_env("LLAMA_ARG_HOST", "127.0.0.1"))
    p.add_argument("--port", type=int, default=int(_env("LLAMA_ARG_PORT", 8080)))
    p.add_argument("--api-key", default=_env("LLAMA_API_KEY"), help="required as Bearer token or X-Api-Key")
    p.add_argument("--allowed-hosts", default=_env("PYLLMROUTER_ALLOWED_HOSTS"), metavar="NAMES",
                   help="Host names a request may give beside the local ones (comma-separated): on a loopback "
                        "bind any other is refused (DNS rebinding); on another bind, given, only these and the "
                        "local ones are accepted")


def _scheduling_arguments(p: argparse.ArgumentParser) -> None:
    """How the router schedules (RouterOptions): how long and how many requests wait and in
    what order, workers' lives (an emulated one's overhead too), prompt states kept across
    eviction, stream pacing."""
    p.add_argument("--queue-timeout", type=float, default=60.0, help="seconds a request may wait for its model")
    p.add_argument("--max-queue", type=int, default=int(_env("PYLLMROUTER_MAX_QUEUE", 0)), metavar="N",
                   help="most requests that may wait at once, all models together (for a load, or past a model's "
                        "parallel slots); past it, 503 with Retry-After (0: no bound; a model's own: preset key "
                        "max-queue, past it 429)")
    p.add_argument("--priority-age", type=float, default=RouterOptions.priority_age, metavar="S",
                   help="seconds of waiting that lift a request one priority level (a preset's priority key), "
                        "so a low priority never waits forever (0: no lift)")
    p.add_argument("--worker-idle-timeout", type=float, default=300.0, metavar="S",
                   help="a worker with no model stops after S seconds and gives its devices back "
                        "(0: at once; -1: kept; admission stops an empty worker sooner when that makes room)")
    p.add_argument("--emulate-worker-overhead", type=int, default=0, metavar="MiB",
                   help="with --emulate-devices: what each worker holds on each of its devices before any model, "
                        "as a GPU context would")
    p.add_argument("--heartbeat", type=float, default=5.0,
                   help="seconds a worker has to answer a ping before it is killed as hung (0: off)")
    p.add_argument("--turn", type=float, default=5.0,
                   help="seconds a busy model keeps taking requests once another model waits for its memory")
    p.add_argument("--kv-keep-ram", type=int, default=None, metavar="MiB",
                   help="host RAM for prompt states kept across eviction (default: an eighth of the free host "
                        "memory; 0: off)")
    p.add_argument("--kv-keep-dir", default=_env("PYLLMROUTER_KV_KEEP_DIR"),
                   help="directory for kept prompt states that overflow the RAM (default: none, they are dropped)")
    p.add_argument("--kv-keep-disk", type=int, default=4096, metavar="MiB", help="cap of --kv-keep-dir (MiB)")
    p.add_argument("--stream-interval-ms", type=float, default=1.0, metavar="MS",
                   help="a worker sends a model's stream chunks at most once per MS: tokens that come faster "
                        "leave together (0: each as it comes)")


def _serving_arguments(p: argparse.ArgumentParser) -> None:
    """How responses reach the client (a worker writing them itself, following its
    connection) and the HTTP server's own: its log, request bodies, shutdown."""
    p.add_argument("--native", action=argparse.BooleanOptionalAction, default=True,
                   help="a worker writes a model's response to the client's connection itself (default); "
                        "--no-native relays every response through the router process")
    p.add_argument("--follow-ms", type=int, default=1000, metavar="MS",
                   help="a worker that answered a request on a keep-alive connection reads the client's next "
                        "requests itself while each is like the last (the same model, path and headers, within "
                        "20 ms of the last answer), and tells the router of its answers every MS; the router ends "
                        "it where it must see the model's requests again: an unload, a drain for a waiter (at the "
                        "end of its --turn), a new replica (0: the router reads every request)")
    p.add_argument("--access-log", action=argparse.BooleanOptionalAction, default=False,
                   help="log a line per request (off by default, as in llama-server)")
    p.add_argument("--max-body-mb", type=float, default=8.0, help="largest request body (MiB)")
    p.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="seconds to let requests in flight finish on SIGTERM/SIGINT")


def parse_serve_args(argv: Sequence[str]) -> argparse.Namespace:
    """``pyllmrouter serve``'s arguments (without the command's name), parsed; the rest are
    llama-server's arguments for every model (``llama_args``)."""
    parser = argparse.ArgumentParser(prog="pyllmrouter serve")
    add_serve_arguments(parser)
    args, rest = parser.parse_known_args(list(argv))
    args.llama_args = rest
    return args


def router_from_args(a: argparse.Namespace) -> Router:
    if not (a.models_preset or a.models_dir or a.models_cache):
        raise SystemExit("pyllmrouter serve: no models: give --models-preset and/or --models-dir")
    try:
        sources = Sources(a.models_preset, a.models_dir, a.models_cache, tuple(getattr(a, "llama_args", ())))
    except ValueError as e:  # an argument llama.cpp does not know
        raise SystemExit(f"pyllmrouter serve: {e}") from None
    models, router_kw = sources.read()
    if a.emulate_devices and a.rpc_devices:
        raise SystemExit("pyllmrouter serve: --emulate-devices and --rpc-devices exclude each other")
    if a.rpc_devices:
        inventory = RpcInventory.parse(a.rpc_devices)
    elif a.emulate_devices:
        inventory = EmulatedInventory.parse(a.emulate_devices, a.emulate_worker_overhead * MiB)
    else:
        inventory = SystemInventory()
    options = RouterOptions(
        margin=a.models_memory_margin * MiB if a.models_memory_margin is not None else router_kw.get("margin",
                                                                                                      1024 * MiB),
        budgets=parse_budgets(a.device_budget) if a.device_budget else {},
        max_models=a.models_max, queue_timeout=a.queue_timeout, max_queue=max(0, a.max_queue), turn=a.turn,
        priority_age=max(0.0, a.priority_age),
        autoload=a.autoload,
        heartbeat=a.heartbeat, worker_idle_timeout=a.worker_idle_timeout, kv_keep_ram=None if a.kv_keep_ram is None else a.kv_keep_ram * MiB,
        kv_keep_dir=a.kv_keep_dir, kv_keep_disk=a.kv_keep_disk * MiB, stream_interval=a.stream_interval_ms / 1e3,
        debug_fake_timing=_FAKE_TIMING if _env("LLAMA_SERVER_DEBUG_FAKE_TIMING") else 0.0,
    )
    try:
        from pyllmrouter.router.api import Router  # noqa: PLC0415  (after serve listens)

        return Router(models, inventory=inventory, options=options, sources=sources, watch=1.0 if a.watch else 0.0)
    except ValueError as e:  # device settings that cannot work
        raise SystemExit(f"pyllmrouter serve: {e}") from None


def allowed_hosts(bind: str, listed: str | None) -> frozenset[str] | None:
    """The Host names accepted beside the local ones: on a loopback bind, those listed (none
    by default); on another, those listed if any, else no Host check (None)."""
    names = frozenset(h.strip() for h in (listed or "").split(",") if h.strip())
    return names if names or is_loopback_bind(bind) else None


def hosts(host: str) -> list[str]:
    """``--host`` as llama-server reads it: one address or several, separated by commas
    (``127.0.0.1,::1``; an IPv6 one may be bracketed)."""
    out = [h.strip().removeprefix("[").removesuffix("]") for h in host.split(",") if h.strip()]
    if not out:
        raise SystemExit("pyllmrouter serve: --host names no address")
    return out


def listen(host: str, port: int) -> list[socket.socket]:
    """A listening socket on each address of ``--host`` (the same port), as llama-server
    listens on each; OSError names the address that cannot be had."""
    sockets: list[socket.socket] = []
    try:
        for h in hosts(host):
            for family, kind, proto, _, addr in socket.getaddrinfo(h, port, type=socket.SOCK_STREAM,
                                                                   flags=socket.AI_PASSIVE)[:1]:
                s = socket.socket(family, kind, proto)
                sockets.append(s)
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                if family == socket.AF_INET6:
                    s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)  # [::1] and 127.0.0.1 apart
                try:
                    s.bind(addr)
                except OSError as e:
                    raise OSError(e.errno, f"{h}: {e.strerror}") from None
                s.listen(2048)
    except BaseException:
        for s in sockets:
            s.close()
        raise
    return sockets


def _server_modules() -> None:
    import uvicorn  # noqa: F401, PLC0415

    import pyllmrouter.server.app  # noqa: F401, PLC0415


def _settings_and_router(a: argparse.Namespace) -> tuple[dict[str, Any], Router]:
    """What llama-server's HTTP layer makes of the arguments (CORS, keys, tools...) and the
    router, read side by side (each asks llama.cpp in a short-lived process) while the
    server's own modules are imported."""
    with ThreadPoolExecutor(2) as pool:
        checked = pool.submit(settings, a.llama_args)
        imported = pool.submit(_server_modules)
        router = router_from_args(a)
        try:
            cfg = checked.result()
        except ValueError as e:
            router.close()
            raise SystemExit(f"pyllmrouter serve: {e}") from None
        imported.result()
    return cfg, router


def _built(a: argparse.Namespace):
    """The router, its services and the uvicorn server of its app."""
    import uvicorn  # noqa: PLC0415

    from pyllmrouter.server.app import DEFAULT_HEADERS, HTTP_PROTOCOL, create_app  # noqa: PLC0415

    cfg, router = _settings_and_router(a)
    services = _started_services(a, cfg, router)
    app = create_app(router, api_key=a.api_key, max_body=int(a.max_body_mb * MiB), settings=cfg, services=services,
                     allowed_hosts=allowed_hosts(a.host, a.allowed_hosts), native=a.native,
                     follow_ms=max(0, a.follow_ms))
    # proxy_headers off: as llama-server, X-Forwarded-* are a client's headers like any other (uvicorn's
    # middleware would rewrite the client's address and scheme from them, on every request)
    config = uvicorn.Config(app, host=a.host, port=a.port, log_level="info", access_log=a.access_log,
                            timeout_graceful_shutdown=a.shutdown_timeout, http=HTTP_PROTOCOL, proxy_headers=False,
                            headers=DEFAULT_HEADERS)
    return _uvicorn_server(config, router, services), router, services


async def _take_held(server, held: list[socket.socket]) -> None:
    """Each connection of ``held`` (taken from it) read from its first byte by ``server``'s
    protocol, as a connection it accepted itself."""
    loop = asyncio.get_running_loop()
    protocol = functools.partial(server.config.http_protocol_class, config=server.config,
                                 server_state=server.server_state, app_state=server.lifespan.state)
    while held:
        conn = held.pop(0)
        conn.setblocking(False)
        await loop.connect_accepted_socket(protocol, conn)


def _uvicorn_server(config, router: Router, services: Services | None):
    """uvicorn's server for ``config``, ending as llama-server ends: on SIGTERM/SIGINT the
    connections workers follow are given back, tool calls end at once, requests in
    flight drain, and the process exits 0."""
    import uvicorn  # noqa: PLC0415

    class Server(uvicorn.Server):
        """SIGTERM/SIGINT: drain, shut down, exit 0 (uvicorn would re-raise the signal).
        Idle, it wakes once a second (the Date header's second), not uvicorn's ten times."""

        wake: Callable[[], None] = staticmethod(lambda: None)  # main_loop's: an exit is asked
        held: list = []  # connections accepted while the app was built (server/starting.py)

        async def startup(self, sockets=None) -> None:
            """uvicorn's; then the connections held while the app was built are its own."""
            held, self.held = self.held, []
            try:
                await super().startup(sockets)
                await _take_held(self, held)
            finally:
                for conn in held:  # the server did not start: nobody will answer them
                    conn.close()

        async def shutdown(self, sockets=None) -> None:
            """uvicorn's, the connections workers follow given back first (then closed)."""
            router.scheduler.end_all_follows()
            await super().shutdown(sockets)

        async def main_loop(self) -> None:
            """uvicorn's, woken by an exit at once rather than polling for it every 0.1 s."""
            exiting, loop = asyncio.Event(), asyncio.get_running_loop()
            self.wake = lambda: loop.call_soon_threadsafe(exiting.set)
            counter, should_exit = 0, await self.on_tick(0)
            while not should_exit:
                counter = (counter + 10) % 864000  # on_tick: every tenth tick, the Date header
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(exiting.wait(), 1.0)
                should_exit = await self.on_tick(counter)

        def handle_exit(self, sig, frame) -> None:
            super().handle_exit(sig, frame)
            with contextlib.suppress(RuntimeError):  # the loop is closed: nothing waits
                self.wake()
            router.scheduler.bus.end_listeners()  # /models/sse clients would hold the drain
            if services is not None:  # as llama-server: tool calls end now, while generations drain
                threading.Thread(target=services.close, daemon=True).start()

        @contextlib.contextmanager
        def capture_signals(self):
            previous = {s: signal.signal(s, self.handle_exit) for s in (signal.SIGINT, signal.SIGTERM)}
            try:
                yield
            finally:
                for s, handler in previous.items():
                    signal.signal(s, handler)

    return Server(config)


def _started_services(a: argparse.Namespace, cfg: dict[str, Any], router: Router) -> Services | None:
    """The tool services (MCP servers) the settings ask for, started: as llama-server, before
    it serves (None: none asked for).  One that cannot start ends the command."""
    if not wanted(cfg):
        return None
    services = Services(tuple(a.llama_args), router.scheduler.inventory.mask_env(frozenset()))
    try:
        services.start()
    except (RuntimeError, WorkerDied) as e:
        router.close()
        raise SystemExit(f"pyllmrouter serve: {e}") from None
    return services


def serve(a: argparse.Namespace) -> int:
    """Listen first, /health answered from then on (server/starting.py), then the router
    and the app built; uvicorn serves from there, the connections held meanwhile included."""
    try:
        sockets = listen(a.host, a.port)
    except OSError as e:
        raise SystemExit(f"pyllmrouter serve: cannot listen on {a.host} port {a.port}: {e}") from None
    starting = Starting(sockets).start()
    try:
        server, router, services = _built(a)
    except BaseException:
        for s in [*starting.stop(), *sockets]:
            s.close()
        raise
    server.held = starting.stop()
    try:
        server.run(sockets=sockets)
    finally:
        if services is not None:
            services.close()
        router.close()  # idempotent: the app's shutdown closed it already
    return 0
