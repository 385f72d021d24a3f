"""The event bus: a listener that raises is dropped, never silently."""

from __future__ import annotations

import logging

from pyllmrouter.router.services import events
from pyllmrouter.router.services.events import EventBus


def test_a_listener_that_raises_is_dropped_with_its_traceback_logged(caplog, _no_listener_fails):
    """A check made in a listener that raises (an attribute renamed under it) is dropped, and
    says so with its traceback; the listeners beside it go on."""
    bus = EventBus()
    seen = []

    def check(ev) -> bool:
        raise AttributeError("'WorkerSet' object has no attribute 'expected_overhead'")

    bus.listen(check)
    bus.listen(lambda ev: seen.append(ev.event) is None)
    with caplog.at_level(logging.ERROR, logger=events.LOG.name):
        bus.publish("load-start", "m")
        bus.publish("load", "m")
    assert seen == ["load-start", "load"] and bus.listeners() == 1
    [record] = [r for r in caplog.records if r.name == events.LOG.name]
    assert "event 'load-start' of 'm'" in record.getMessage() and record.exc_info is not None
    assert "expected_overhead" in caplog.text  # the traceback, not just a word
    assert len(_no_listener_fails.records) == 1  # what fails any other test that meets it
    _no_listener_fails.records.clear()
