"""Who waits, in what order, and how many may wait (pure: no clock, no lock).

    rank(priority, created, seq, now, age)   a waiting request's place: the higher priority
                                             first (a preset's ``priority``), then first come
                                             first served (by arrival: a request sent on from
                                             another node arrived when it first did); every
                                             ``age`` seconds of waiting lift it one level, so
                                             none waits forever
    waiting(tickets, leases, slots, loaded)  requests of one model that hold no slot: those
                                             queued in the router for a load, and those past
                                             its parallel slots, queued in its engine
    tally(model, queued, instances)          (the model's, everyone's) waiting requests: an
                                             instance's own load is no request, never counted
    refusal(...)                             the limit a new request would cross, if any:
                                             the model's ``max-queue`` (429) or the router's
                                             ``--max-queue`` (503)

Starvation bound: a request of priority p behind a stream of requests of priority
q > p is admitted once it has waited (q - p + 1) * age seconds at most, since it then
ranks above every newcomer of priority q (and FIFO decides among equals).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["rank", "waiting", "Queued", "Held", "tally", "Refusal", "refusal"]


def rank(priority: int, created: float, seq: int, now: float, age: float) -> tuple[int, float, int]:
    """Lower ranks go first."""
    lift = int(max(0.0, now - created) // age) if age > 0 else 0
    return (-(priority + lift), created, seq)


def waiting(tickets: int, leases: int, slots: int, loaded: bool) -> int:
    """A model's requests that hold no slot of its engine."""
    return tickets + (max(0, leases - slots) if loaded else 0)


@dataclass(frozen=True)
class Queued:
    """A waiting request: the instance it waits for, and whether it is that instance's own
    load (roster.grow's), which is no request of a client's."""

    instance: str
    loader: bool = False


@dataclass(frozen=True)
class Held:
    """An instance: its name, its model's name, requests in flight, slots, whether loaded."""

    name: str
    model: str
    leases: int
    slots: int
    loaded: bool


def tally(model: str, queued: list[Queued], instances: list[Held]) -> tuple[int, int]:
    """(requests of ``model`` that hold no slot, all models' such requests)."""
    tickets: dict[str, int] = {}
    for q in queued:
        if not q.loader:
            tickets[q.instance] = tickets.get(q.instance, 0) + 1
    mine = total = 0
    for i in instances:
        n = waiting(tickets.get(i.name, 0), i.leases, i.slots, i.loaded)
        total += n
        mine += n if i.model == model else 0
    return mine, total


@dataclass(frozen=True)
class Refusal:
    scope: str  # "model" (its max-queue: 429) or "router" (--max-queue: 503)
    limit: int
    waiting: int  # requests waiting before this one


def refusal(model_waiting: int, model_limit: int | None, total_waiting: int, total_limit: int) -> Refusal | None:
    """Whether one more waiting request crosses a limit (None or 0: no limit)."""
    if model_limit and model_waiting + 1 > model_limit:
        return Refusal("model", model_limit, model_waiting)
    if total_limit and total_waiting + 1 > total_limit:
        return Refusal("router", total_limit, total_waiting)
    return None
