"""The admission invariant's arithmetic (pure: plain numbers in, plain numbers out).

On every device, at every instant:

    other programs' bytes + our held bytes + margin <= total

where our held bytes are every LOADED model's, the whole reservation of every model still
LOADING (whatever part of it is allocated yet), every UNLOADING model's (until its worker
says it freed them), every worker's own overhead (running or stopping), and the kept
prompt states in RAM with the RAM reserved for those being saved.

The device tells its free bytes, not who uses them.  Our *settled* bytes are the part of
held that the device surely holds already: LOADED models, running workers, states written
in RAM.  The rest may be allocated, or freed, at any moment.  So

    external = total - free - settled      (other programs' use, erring high: a load's
                                            allocations so far count as theirs until it
                                            settles, and what an unload freed too)
    available = min(capacity, total - external - margin) - held

and external is never below the truth, because settled is never above what is allocated.
Two conditions make that so, and the Book keeps both: a byte becomes settled only after it
is allocated (a model is LOADED when its worker says so, a worker's overhead counts once it
has started), and a reading of free memory is used only while no byte has become settled
since it was taken (``Book.mark``, read before the reading: a reading taken while a load
had allocated 1 GiB of 4, used after the load settled, would count the 3 GiB it allocated
since as room).  Then every admission leaves the invariant true for the other programs of
its reading; other programs that grow later are met by a load's allocation error, which
reads free memory again (one retry).  Without a load or unload under way, external is
exact; during one, admission is short of room by what it has allocated or freed so far,
never over.
"""

from __future__ import annotations

from typing import Mapping

__all__ = ["external", "available"]


def external(totals: Mapping[str, int], free: Mapping[str, int], settled: Mapping[str, int]) -> dict[str, int]:
    """Per device: what other programs may be using, erring high."""
    return {d: max(0, total - free.get(d, total) - settled.get(d, 0)) for d, total in totals.items()}


def available(totals: Mapping[str, int], capacity: Mapping[str, int], margin: int, free: Mapping[str, int],
              held: Mapping[str, int], settled: Mapping[str, int]) -> dict[str, int]:
    """Per device: what our models may still take (``capacity``: the most they may ever
    hold there, the budget and the margin taken off)."""
    others = external(totals, free, settled)
    return {d: min(capacity[d], total - others[d] - margin) - held.get(d, 0) for d, total in totals.items()}
