"""The model-based test's admission check can fail: with the admission rule broken on purpose,
the same state machine (tests/admission/test_scheduler_model.py) finds an admission past a device's total.

Two breaks, each a rule the router once got wrong:
  - other programs' bytes read as ``total - free - held`` (a load's bytes not allocated yet
    taken for room the other programs left);
  - a worker's own bytes unknown until it runs (a new device set's first worker admitted
    with no room for its context and its process).
"""

from __future__ import annotations

import pytest
from hypothesis import Phase, settings
from hypothesis.stateful import run_state_machine_as_test

import test_scheduler_model
from pyllmrouter.router.policy import accounting
from pyllmrouter.router.workers.costs import WorkerCosts

_available = accounting.available


def _held_for_settled(totals, capacity, margin, free, held, settled):
    return _available(totals, capacity, margin, free, held, held)


BREAKS = {
    "external = total - free - held": (accounting, "available", _held_for_settled),
    "a worker costs nothing before it runs": (WorkerCosts, "estimate", lambda self, device_set: {}),
}


@pytest.mark.slow
@pytest.mark.parametrize("rule", sorted(BREAKS))
def test_the_admission_check_finds_a_broken_rule(rule, monkeypatch):
    owner, name, broken = BREAKS[rule]
    monkeypatch.setattr(owner, name, broken)
    with pytest.raises((AssertionError, ExceptionGroup)) as found:
        run_state_machine_as_test(test_scheduler_model.SchedulerMachine, settings=settings(
            max_examples=60, stateful_step_count=50, deadline=None, derandomize=True, database=None,
            phases=[Phase.generate], report_multiple_bugs=False))
    assert any("admitted on" in str(e) for e in _flat(found.value)), found.value


def _flat(e: BaseException) -> list[BaseException]:
    """An error, or each of a group's (hypothesis reports distinct failures together)."""
    return [x for sub in e.exceptions for x in _flat(sub)] if isinstance(e, BaseExceptionGroup) else [e]
