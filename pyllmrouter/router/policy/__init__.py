"""The scheduler's rules, pure: no I/O, no clock (time is an argument), no threads.

    admission   fits? where? which victims? (decide: Admit, Evict, Wait, Never)
    placement   a model's bytes on device sets, the residents that may give way
    parts       a model's bytes by component, per device (for the page and status)
    queueing    who waits in what order, and how many may wait
    replicas    which instance serves a request, and when one more loads
    fitbook     fits found for a grant, kept per device set
    state       a model's states and the one checked transition between them

A rule found on a trace lands here as a function and a property test (tests/admission/test_admission.py,
test_placement.py, test_parts.py).
"""
