"""bench/trace_bench.py's own arithmetic: the workload it derives from the trace (the same
for every system, each service's traffic to its own models, token counts within the
machine's bounds) and the goodput it reports (the highest rate still meeting the SLO)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
trace_bench = pytest.importorskip("trace_bench")


def _args(**kw) -> argparse.Namespace:
    base = {"offset": 600.0, "window": 30.0, "zipf": 1.1, "prompt_div": 64, "gen_div": 16}
    return argparse.Namespace(**{**base, **kw})


def test_the_workload_is_the_traces_arrivals_mapped_per_service_the_same_for_a_seed():
    args = _args()
    models = trace_bench.MODELS
    one, again, other = (trace_bench.workload(args, 1, models), trace_bench.workload(args, 1, models),
                         trace_bench.workload(args, 2, models))
    code = sum(1 for _ in trace_bench.read_trace("code", args.offset, args.window))
    conv = sum(1 for _ in trace_bench.read_trace("conv", args.offset, args.window))
    assert len(one) == code + conv > 0
    assert one == again and [r.model for r in one] != [r.model for r in other]
    assert [r.t for r in one] == sorted(r.t for r in one) and 0 <= one[0].t and one[-1].t < args.window
    services = {name: svc for name, svc, _ in trace_bench.MODELS}
    assert sum(services[r.model] == "code" for r in one) == code  # code traffic to code models only
    assert all(1 <= r.tokens <= 48 for r in one)
    # a conversation's later turn starts with an earlier turn of the same model's conversation
    chat = [r for r in one if services[r.model] == "conv"]
    assert any(b.prompt.startswith(a.prompt) and b.prompt != a.prompt and a.model == b.model
               for i, a in enumerate(chat) for b in chat[i + 1:])


def test_goodput_is_the_highest_rate_meeting_the_slo_interpolated_where_it_is_lost():
    assert trace_bench.goodput([(0.25, 1.0), (0.5, 0.95), (0.75, 0.7), (1.0, 0.95)]) == pytest.approx(0.55)
    assert trace_bench.goodput([(0.25, 1.0), (0.5, 0.9)]) == 0.5  # met at every rate tried: the highest
    assert trace_bench.goodput([(0.25, 0.5)]) == pytest.approx(0.25 * 0.1 / 0.5)  # from (0, 100 %)
