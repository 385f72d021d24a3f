"""Errors the router raises; each message names the model and the reason."""

from __future__ import annotations

__all__ = [
    "RouterError", "UnknownModel", "NeverFits", "QueueTimeout", "LoadFailed", "WorkerDied", "Unclaimed", "RequestFailed",
    "RouterClosed", "RouterForked", "NotLoaded", "Withdrawn", "ModelRemoved", "Busy", "QueueFull", "RequestTimeout",
]


class RouterError(RuntimeError):
    """Base of every router error."""


class UnknownModel(RouterError, KeyError):
    def __init__(self, name: str, known: list[str]):
        super().__init__(f"unknown model {name!r}; known models: {', '.join(sorted(known)) or 'none'}")
        self.name = name

    def __str__(self) -> str:  # KeyError would quote the message
        return self.args[0]


class ModelRemoved(RouterError):
    """The model was removed from the router's list while the request waited for it."""

    def __init__(self, name: str):
        super().__init__(f"model {name!r} was removed from the router's model list")
        self.name = name


class NeverFits(RouterError):
    """The model is bigger than a device's budget even with nothing else loaded."""

    def __init__(self, name: str, device: str, need: int, capacity: int, detail: str):
        super().__init__(f"model {name!r} can never fit: {detail}")
        self.name, self.device, self.need, self.capacity = name, device, need, capacity


class QueueTimeout(RouterError):
    """The model would fit once busy models finish, but not within the wait allowed."""

    def __init__(self, name: str, waited: float, why: str):
        super().__init__(f"model {name!r} not admitted within {waited:.1f} s: {why}")
        self.name, self.waited = name, waited


class Withdrawn(RouterError):
    """The caller left while its request waited for the model: it took no lease and
    caused no load and no eviction."""

    def __init__(self, name: str):
        super().__init__(f"model {name!r}: the caller left while waiting")
        self.name = name


class LoadFailed(RouterError):
    def __init__(self, name: str, reason: str):
        super().__init__(f"model {name!r} failed to load: {reason}")
        self.name, self.reason = name, reason


class NotLoaded(RouterError):
    """The model is not loaded and loading on demand is off (autoload=false)."""

    def __init__(self, name: str, state: str):
        super().__init__(f"model {name!r} is {state} and autoload is off: load it first (Router.load({name!r}), "
                         f"or POST /models/load over HTTP)")
        self.name = name


class QueueFull(RouterError):
    """Too many requests wait already: the model's own bound (its preset's max-queue) or the
    router's (--max-queue); retry later."""

    def __init__(self, name: str, scope: str, limit: int, waiting: int):
        where = (f"model {name!r} has {waiting} requests waiting, its limit (max-queue = {limit})" if scope == "model"
                 else f"the router has {waiting} requests waiting, its limit (--max-queue {limit})")
        super().__init__(f"{where}: retry later")
        self.name, self.scope, self.limit, self.waiting = name, scope, limit, waiting


class Busy(RouterError):
    """The router takes no more of this kind of work now (e.g. downloads at their limit):
    retry later."""


class RouterForked(RouterError):
    """A Router used in a process other than the one that built it: a fork's child
    (os.fork, a fork-based multiprocessing pool, a pre-forking server)."""

    def __init__(self, built: int, here: int):
        super().__init__(f"this Router was built in process {built}, and this is process {here}, a fork of it "
                         f"(os.fork, a fork-based multiprocessing pool, a pre-forking server): its workers, threads "
                         f"and pipes stayed with the parent. Build a Router in the child process (or start children "
                         f"with multiprocessing's 'spawn' or 'forkserver' method)")
        self.built, self.here = built, here

    def __reduce__(self):  # a Pool's child sends it back to the parent
        return RouterForked, (self.built, self.here)


class WorkerDied(RouterError):
    """The worker process ended while requests were in flight."""


class Unclaimed(RouterError):
    """A cluster's request that its node may not run: the ingress's ledger gave it to
    another node, or did not answer (ray/ledger.py).  It did not run: try it again."""

    def __init__(self, name: str):
        super().__init__(f"model {name!r}: the cluster's ledger did not let this node run the request "
                         f"(it was given up, or the ledger did not answer); it did not run here")
        self.name = name


class RequestFailed(RouterError):
    """A request failed: llama.cpp's error status and message (``kind`` "HTTP <status>"),
    or the model's worker failed while serving it."""

    def __init__(self, name: str, kind: str, message: str, status: int = 500):
        super().__init__(f"model {name!r}: {kind}: {message}")
        self.name, self.kind, self.message, self.status = name, kind, message, status


class RequestTimeout(RouterError, TimeoutError):
    """A request that was not done within its ``timeout`` (the Python API's): it was
    stopped (its generation ended) and nothing more of it comes."""

    def __init__(self, name: str, timeout: float):
        super().__init__(f"model {name!r}: the request was not done within {timeout:g} s (timeout=); it was stopped")
        self.name, self.timeout = name, timeout


class RouterClosed(RouterError):
    pass
