"""What a user declares: models, and how the router may use the devices."""

from __future__ import annotations

from dataclasses import dataclass, field

from pyllmrouter.spec import ModelSpec

__all__ = ["ModelConfig", "RouterOptions", "MiB", "GiB"]

MiB = 1 << 20
GiB = 1 << 30


@dataclass(frozen=True)
class ModelConfig:
    """One servable model.

    ``devices`` pins the model to a device set (inventory names: ``CUDA0``,
    ``GPU1``, ``CPU``); unpinned models go wherever they fit best.  Every
    llama-server argument (context, slots, chat template, sampling defaults...)
    is in the spec's ``args``, parsed by llama.cpp's own parser.
    """

    name: str
    spec: ModelSpec
    aliases: tuple[str, ...] = ()
    devices: tuple[str, ...] | None = None
    ttl: float | None = None  # seconds idle before unloading; None: never
    persistent: bool = False  # never evicted
    load_on_startup: bool = False
    stop_timeout: float = 10.0  # seconds an explicit unload waits for requests in flight
    source: str = "api"  # where it was listed: preset, models_dir, cache (llama.cpp's downloads), api
    # a cache model whose file a preset with dedup-cache-models uses: served, not listed (GET /models)
    hidden: bool = False
    priority: int = 0  # among requests waiting for the same devices, a higher priority goes first
    max_queue: int | None = None  # most of its requests that may wait (in the router or its engine); None: no bound
    replicas: int = 1  # most instances of it at once, each on a device set of its own, loaded by demand

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name or self.name.strip() != self.name:
            raise ValueError(f"bad model name {self.name!r}: empty or padded with spaces")
        if not isinstance(self.spec, ModelSpec):
            raise ValueError(f"model {self.name!r}: its spec is a {type(self.spec).__name__} ({self.spec!r}), not a "
                             f"ModelSpec: ModelConfig({self.name!r}, ModelSpec(path, (llama-server arguments...)))")
        if self.ttl is not None and self.ttl <= 0:
            raise ValueError(f"model {self.name!r}: ttl must be > 0 seconds")
        if self.replicas < 1:
            raise ValueError(f"model {self.name!r}: replicas must be at least 1")
        for name in ("aliases", "devices"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, tuple):
                object.__setattr__(self, name, tuple(value))


@dataclass(frozen=True)
class RouterOptions:
    margin: int = 1024 * MiB  # kept free on every device (llama.cpp's fit default)
    budgets: dict[str, int] = field(default_factory=dict, hash=False)  # per-device caps
    max_models: int = 0  # 0: no count limit (llama-server --models-max)
    queue_timeout: float = 60.0  # seconds a request may wait for admission
    turn: float = 5.0  # seconds a busy model keeps taking new requests once another waits for its memory
    load_timeout: float = 600.0
    autoload: bool = True
    # seconds a worker may stay empty (no model, nothing in flight) before it stops and gives
    # its devices back; 0: at once; -1: kept for the router's life
    worker_idle_timeout: float = 300.0
    heartbeat: float = 5.0  # seconds a worker has to answer a ping before it is killed as hung; 0: off
    # prompt states kept across eviction (slot saves): bytes in host RAM (None: an eighth of
    # the host memory free at start; 0: off), and a directory on disk for what overflows,
    # with its cap in bytes
    kv_keep_ram: int | None = None
    kv_keep_dir: str | None = None
    kv_keep_disk: int = 4 * GiB
    # seconds at least between two sends of one model's stream chunks from its worker: tokens
    # that come faster leave together (one pipe message, one write); 0: each as it comes
    stream_interval: float = 0.001
    # llama-server's test hook (LLAMA_SERVER_DEBUG_FAKE_TIMING, which llama.cpp's server test
    # suite sets): seconds each request waits busy on its model before it goes to the engine,
    # and each load waits before it starts, as llama-server's router does; 0: off
    debug_fake_timing: float = 0.0
    # most requests that may wait at once, all models together (0: no bound): for a load, or
    # past a model's parallel slots
    max_queue: int = 0
    # seconds of waiting that lift a request one priority level (none waits forever)
    priority_age: float = 10.0
