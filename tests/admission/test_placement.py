"""Placement policy (pure): property tests and the incidents in miniature."""

from hypothesis import given
from hypothesis import strategies as st

from pyllmrouter import ModelSpec
from pyllmrouter.router.policy import placement
from pyllmrouter.router.policy.fitbook import Fits, Fitted
from pyllmrouter.router.policy.placement import COUNT, Resident


def test_pinned_second_model_is_never_admitted_beside_the_first():
    # the 2x3090 incident: summing both GPUs says it fits; per device it does not
    avail = {"GPU0": 24 - 13, "GPU1": 24}
    a = Resident("a", {"GPU0": 13}, last_used=1.0, evictable=False)
    plan = placement.choose([(frozenset({"GPU0"}), {"GPU0": 15})], avail, [a])
    assert plan is None  # busy: wait, do not load


def test_pinned_second_model_evicts_the_idle_first():
    avail = {"GPU0": 11, "GPU1": 24}
    a = Resident("a", {"GPU0": 13}, last_used=1.0, evictable=True)
    plan = placement.choose([(frozenset({"GPU0"}), {"GPU0": 15})], avail, [a])
    assert plan.victims == ("a",) and plan.device_set == {"GPU0"}


def test_unpinned_model_goes_to_the_idle_gpu():
    avail = {"GPU0": 11, "GPU1": 24}
    a = Resident("a", {"GPU0": 13}, last_used=1.0, evictable=True)
    cands = [(frozenset({"GPU0"}), {"GPU0": 15}), (frozenset({"GPU1"}), {"GPU1": 15})]
    plan = placement.choose(cands, avail, [a])
    assert plan.device_set == {"GPU1"} and plan.victims == ()


def test_victims_are_least_recently_used_and_only_on_short_devices():
    avail = {"GPU0": 0, "GPU1": 0}
    res = [Resident("old-gpu1", {"GPU1": 10}, 0.0, True),
           Resident("new", {"GPU0": 5}, 3.0, True),
           Resident("old", {"GPU0": 5}, 1.0, True)]
    assert placement.pick_victims({"GPU0": 5}, avail, res) == ("old",)
    assert placement.pick_victims({"GPU0": 8}, avail, res) == ("old", "new")
    assert placement.pick_victims({"GPU0": 11}, avail, res) is None


def test_grant_counts_what_evictable_residents_hold_on_its_devices_only():
    avail = {"GPU0": 5, "GPU1": 24, "CPU": 100}
    keep = Resident("keep", {"GPU0": 7, "CPU": 1}, last_used=1.0, evictable=False)
    idle = Resident("idle", {"GPU0": 4, "GPU1": 3, "CPU": 2}, last_used=2.0, evictable=True)
    assert placement.grant(["GPU0", "CPU"], avail, [keep, idle]) == {"GPU0": 9, "CPU": 102}


def test_a_fit_serves_smaller_grants_it_fits_and_a_failure_rules_out_smaller_ones():
    ds = frozenset({"GPU0"})
    fits = Fits()
    big = Fitted({"GPU0": 10, "CPU": 50}, ModelSpec("m.gguf"), {"GPU0": 8, "CPU": 30})
    fits.add(ds, big)
    assert fits.lookup(ds, {"GPU0": 10, "CPU": 50}) is big
    assert fits.lookup(ds, {"GPU0": 9, "CPU": 40}) is big  # takes no more than the smaller grant
    assert fits.lookup(ds, {"GPU0": 7, "CPU": 50}) is None  # would not fit: fit again
    assert fits.lookup(ds, {"GPU0": 12, "CPU": 50}) is None  # more room: could place more
    assert fits.lookup(frozenset({"GPU1"}), {"GPU0": 10, "CPU": 50}) is None
    none = Fitted({"GPU0": 4, "CPU": 5}, error="needs host memory")
    fits.add(ds, none)
    assert fits.lookup(ds, {"GPU0": 3, "CPU": 5}) is none
    assert fits.lookup(ds, {"GPU0": 3, "CPU": 6}) is None


def test_never_fits_names_the_device():
    worst = placement.never_fits({"GPU0": 30, "CPU": 1}, {"GPU0": 24, "CPU": 64})
    assert worst.device == "GPU0" and worst.need == 30 and worst.capacity == 24
    assert "GPU0" in str(worst)


def test_model_count_is_a_device():
    avail = {"GPU0": 100, COUNT: 0}
    res = [Resident("a", {"GPU0": 1, COUNT: 1}, 0.0, True)]
    plan = placement.choose([(frozenset({"GPU0"}), {"GPU0": 1, COUNT: 1})], avail, res)
    assert plan.victims == ("a",)


DEVICES = ["GPU0", "GPU1", "CPU"]
ops = st.lists(
    st.tuples(
        st.sampled_from(["load", "unload", "busy", "idle"]),
        st.integers(0, 7),  # model
        st.dictionaries(st.sampled_from(DEVICES), st.integers(0, 60), min_size=1, max_size=3),
        st.booleans(),  # pinned
    ),
    max_size=60,
)


@given(capacity=st.fixed_dictionaries({d: st.integers(10, 100) for d in DEVICES}), ops=ops)
def test_admitted_requirements_never_exceed_any_budget(capacity, ops):
    resident: dict[int, dict] = {}
    busy: set[int] = set()
    clock = 0.0
    for op, model, need, pinned in ops:
        clock += 1
        if op == "unload":
            resident.pop(model, None)
            busy.discard(model)
        elif op == "busy" and model in resident:
            busy.add(model)
        elif op == "idle":
            busy.discard(model)
        elif op == "load" and model not in resident:
            held = {d: sum(r["need"].get(d, 0) for r in resident.values()) for d in DEVICES}
            avail = {d: capacity[d] - held[d] for d in DEVICES}
            res = [Resident(str(m), r["need"], r["t"], m not in busy) for m, r in resident.items()]
            if pinned:
                cands = [(frozenset(need), need)]
            else:  # the same bytes on any single device
                total = sum(need.values())
                cands = [(frozenset({d}), {d: total}) for d in DEVICES]
            if all(placement.never_fits(n, capacity) for _, n in cands):
                continue
            plan = placement.choose(cands, avail, res)
            if plan is None:
                continue
            for v in plan.victims:
                assert int(v) not in busy, "a busy model was chosen as a victim"
                del resident[int(v)]
            resident[model] = {"need": dict(plan.need), "t": clock}
        for d in DEVICES:
            assert sum(r["need"].get(d, 0) for r in resident.values()) <= capacity[d]
