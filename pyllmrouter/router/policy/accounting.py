"""The admission invariant's arithmetic (pure: plain numbers in, plain numbers out).

On every device, at every instant:

    other programs' bytes + our held bytes + margin <= total

where our held bytes are every LOADED model's, the whole reservation of every model still
LOADING (whatever part of it is allocated yet), every UNLOADING model's (until its worker
says it freed them), every worker's own overhead (running, stopping, or reserved for a
worker about to start), and the kept prompt states in RAM with the RAM reserved for those
being saved.

The device tells its free bytes, not who uses them.  Our *settled* bytes are the part of
held that the device surely holds already: LOADED models, running workers, states written
in RAM.  The rest is in flight: a load allocates it as it goes, an unload frees it as it
goes.  So

    external  = total - free - settled     other programs' use, erring high: what a load
                                           has allocated so far, and what an unload has not
                                           freed yet, count as theirs until they settle
    available = min(capacity, total - external - margin) - held

and external is never below the truth, because settled is never above what is allocated.
Two conditions make that so, and the Book keeps both: a byte becomes settled only after it
is allocated (a model is LOADED when its worker says so, a worker's overhead counts once it
has started), and a reading of free memory is used only while no byte has become settled
since it was taken (``Book.mark``, read before the reading: a reading taken while a load
had allocated 1 GiB of 4, used after the load settled, would count the 3 GiB it allocated
since as room).  Then every admission leaves the invariant true for the other programs of
its reading; other programs that grow later are met by a load's allocation error, which
reads free memory again (one retry).

In flight, ``available`` is short of the truth by what loads have allocated and unloads
have not freed yet: counted in held in full and in external again.  That is a reason to
wait, never one to make room: ``hoped`` (``available`` with every held byte taken as
allocated: ``external = total - free - held``, never above the truth) is what the devices
will have once what is in flight settles, and admission weighs evictions, drains and fits
against it (policy/admission.py): a model that fits only once the bytes in flight settle
waits for them, and no resident loses its place for them.  With nothing in flight (no load
or unload under way, no worker starting or stopping, no states being saved) the two are
equal and exact.
"""

from __future__ import annotations

from collections import Counter
from typing import Iterable, Mapping

from pyllmrouter.devices import HOST
from pyllmrouter.router.policy.state import State, holds_memory

__all__ = ["tally", "external", "available"]


def tally(models: Iterable[tuple[State, Mapping[str, int]]], running: Iterable[Mapping[str, int]],
          leaving: Iterable[Mapping[str, int]], kept: tuple[int, int]) -> tuple[dict[str, int], dict[str, int]]:
    """(held, settled) bytes per device, from each model's (state, bytes), the running workers'
    overheads, those of workers stopping or about to start, and the kept states' (RAM held,
    of which written)."""
    held: Counter[str] = Counter()
    settled: Counter[str] = Counter()
    for state, need in models:
        if holds_memory(state):
            held.update(need)
            settled.update(need if state is State.LOADED else {})
    for overhead in running:
        held.update(overhead)
        settled.update(overhead)
    for overhead in leaving:
        held.update(overhead)
    held[HOST] += kept[0]
    settled[HOST] += kept[1]
    return dict(held), dict(settled)


def external(totals: Mapping[str, int], free: Mapping[str, int], settled: Mapping[str, int]) -> dict[str, int]:
    """Per device: what other programs may be using, erring high."""
    return {d: max(0, total - free.get(d, total) - settled.get(d, 0)) for d, total in totals.items()}


def available(totals: Mapping[str, int], capacity: Mapping[str, int], margin: int, free: Mapping[str, int],
              held: Mapping[str, int], settled: Mapping[str, int]) -> dict[str, int]:
    """Per device: what our models may still take (``capacity``: the most they may ever
    hold there, the budget and the margin taken off)."""
    others = external(totals, free, settled)
    return {d: min(capacity[d], total - others[d] - margin) - held.get(d, 0) for d, total in totals.items()}
