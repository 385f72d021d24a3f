"""Plain-text tables and byte formatting for the CLI and the benchmarks."""

from __future__ import annotations

from typing import Any, Sequence

__all__ = ["mib", "render"]

MiB = 1024 * 1024


def mib(n: int | float | None) -> str:
    return "-" if n is None else f"{n / MiB:.2f}"


def render(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """Columns padded to width; numbers right-aligned, text left-aligned."""
    cells = [[str(h) for h in headers]] + [["" if c is None else str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    numeric = [all(_is_number(r[i]) for r in cells[1:]) and len(cells) > 1 for i in range(len(headers))]

    def line(r: Sequence[str]) -> str:
        return "  ".join(c.rjust(w) if num else c.ljust(w) for c, w, num in zip(r, widths, numeric)).rstrip()

    out = [line(cells[0]), "  ".join("-" * w for w in widths)]
    out += [line(r) for r in cells[1:]]
    return "\n".join(out)


def _is_number(s: str) -> bool:
    try:
        float(s)
    except ValueError:
        return s == "-"
    return True
