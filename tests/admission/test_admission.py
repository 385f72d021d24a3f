"""Admission (pure): properties of decide(view, request) over random router states."""

from hypothesis import example, given
from hypothesis import strategies as st

from pyllmrouter import ModelSpec
from pyllmrouter.router.policy import placement
from pyllmrouter.router.policy.admission import SETTLING, Admit, Evict, Never, Option, Request, View, Wait, decide
from pyllmrouter.router.policy.fitbook import Fits, Fitted
from pyllmrouter.router.policy.placement import Resident

DEVICES = ("d0", "d1", "d2")
SPEC = ModelSpec("model.gguf")


@st.composite
def states(draw):
    """A view and a request: residents that are idle, busy or persistent, and the
    model's options (device sets with bytes), without fitting."""
    capacity = {d: draw(st.integers(0, 1000)) for d in DEVICES}
    residents, kinds = [], {}
    for i in range(draw(st.integers(0, 5))):
        on = draw(st.lists(st.sampled_from(DEVICES), min_size=1, max_size=3, unique=True))
        need = {d: draw(st.integers(0, 400)) for d in on}
        kind = draw(st.sampled_from(["idle", "busy", "persistent"]))
        residents.append((f"m{i}", need, draw(st.floats(0, 100)), kind))
        kinds[f"m{i}"] = kind
    for i in range(draw(st.integers(0, 3))):  # workers: each holds its overhead on its devices
        on = draw(st.lists(st.sampled_from(DEVICES), min_size=1, max_size=3, unique=True))
        kind = draw(st.sampled_from(["worker-empty", "worker-busy"]))
        residents.append((f"(worker w{i})", {d: draw(st.integers(1, 150)) for d in on}, float("-inf"), kind))
        kinds[f"(worker w{i})"] = kind
    external = {d: draw(st.integers(0, 200)) for d in DEVICES}
    available = {d: capacity[d] - external[d] - sum(n.get(d, 0) for _, n, _, _ in residents) for d in DEVICES}
    # bytes of loads and unloads under way that free memory may count twice until they settle
    hoped = {d: available[d] + draw(st.sampled_from([0, 0, 50, 300])) for d in DEVICES}
    stoppable = ("idle", "worker-empty")  # an empty worker is evictable, busy or not busy alike
    view = View(available, capacity,
                evictable=tuple(Resident(n, need, t, k in stoppable) for n, need, t, k in residents),
                drainable=tuple(Resident(n, need, t, k in stoppable or k == "busy") for n, need, t, k in residents),
                grantable=tuple(Resident(n, need, t, k in stoppable or k == "busy") for n, need, t, k in residents),
                hoped=hoped)
    options = []
    for ds in draw(st.lists(st.lists(st.sampled_from(DEVICES), min_size=1, max_size=2, unique=True),
                            min_size=1, max_size=3, unique_by=lambda x: frozenset(x))):
        # the set's worker: its bytes before any model, held already or added by this load
        worker = {d: draw(st.integers(0, 150)) for d in ds} if draw(st.booleans()) else {}
        options.append(Option(frozenset(ds), {d: draw(st.integers(0, 1200)) for d in ds}, SPEC, (), worker,
                              draw(st.booleans())))
    return view, Request("new", tuple(options), Fits()), kinds


def _seen_state():
    """The counterexample a fresh run found (the newcomer needs nothing where d0 and d1 are
    already over-committed; an empty worker holds one byte on d1 only, where the workers
    evicted before it made room): the model m3 is evicted and that worker rightly stays."""
    available = {"d0": -360, "d1": -45, "d2": 0}
    capacity = {"d0": 1000, "d1": 1000, "d2": 1000}
    residents = [("m0", {"d2": 1}, 1.0, "idle"), ("m1", {"d2": 1}, 2.0, "idle"), ("m2", {"d2": 1}, 3.0, "idle"),
                 ("m3", {"d0": 284}, 4.0, "idle"), ("m4", {"d0": 10}, 0.0, "persistent"),
                 ("(worker w0)", {"d0": 76, "d1": 1, "d2": 1}, float("-inf"), "worker-empty"),
                 ("(worker w1)", {"d1": 44, "d2": 1}, float("-inf"), "worker-empty"),
                 ("(worker w2)", {"d1": 1}, float("-inf"), "worker-empty")]
    stoppable = ("idle", "worker-empty")
    view = View(available, capacity,
                evictable=tuple(Resident(n, need, t, k in stoppable) for n, need, t, k in residents),
                drainable=tuple(Resident(n, need, t, k in stoppable) for n, need, t, k in residents),
                grantable=tuple(Resident(n, need, t, k in stoppable) for n, need, t, k in residents))
    request = Request("new", (Option(frozenset({"d0", "d1"}), {"d0": 0, "d1": 0}, SPEC),), Fits())
    return view, request, {n: k for n, _, _, k in residents}


def fits(need, available):
    return not placement.shortfall(need, available)


def freed(view, victims, base=None):
    """What is available once ``victims`` are gone (from ``base``: view.available)."""
    out = dict(view.available if base is None else base)
    for r in view.evictable:
        if r.name in victims:
            for d, n in r.need.items():
                out[d] = out.get(d, 0) + n
    return out


@given(states())
@example(_seen_state())
def test_decisions_are_sound(state):
    view, request, kinds = state
    decision = decide(view, request)
    options = {o.device_set: o for o in request.options}
    # the options that can ever fit (beside their worker, on empty devices): the others are out
    possible = [o for o in request.options if placement.never_fits(o.room(o.need, worker=True), view.capacity) is None]
    if isinstance(decision, Admit):
        # on every device it touches, the bytes (and a worker the load starts) fit what is
        # available now; it reserves the model's own
        option = options.get(decision.device_set)
        assert option is not None and dict(decision.need) == dict(option.need)
        assert fits(option.room(decision.need), view.available)
    elif isinstance(decision, Evict):
        # only idle models, each at most once, least recently used first, and then it fits
        assert decision.victims and len(set(decision.victims)) == len(decision.victims)
        assert all(kinds[v] in ("idle", "worker-empty") for v in decision.victims)  # never a busy worker
        # weighed against what the devices have once the bytes in flight settle: never a victim
        # for bytes in flight, and the model fits once they are gone
        settled = view.settled
        assert any(fits(o.room(o.need), freed(view, decision.victims, settled)) for o in possible)
        assert not any(fits(o.room(o.need), settled) for o in possible)  # no eviction if none is needed
        # every victim holds bytes on a device the model is short of
        short = {d for o in possible for d in placement.shortfall(o.room(o.need), settled)}
        held = {r.name: r.need for r in view.evictable}
        assert all(any(held[v].get(d, 0) > 0 for d in short) for v in decision.victims)
        used = [r.last_used for v in decision.victims for r in view.evictable if r.name == v]
        assert used == sorted(used)
        # an empty worker goes before any model: no model is evicted while an empty worker
        # stays that holds bytes where the model is still short once the empty workers
        # chosen are gone (one whose bytes are only where those made room is no help)
        if any(kinds[v] == "idle" for v in decision.victims):
            workers = [v for v in decision.victims if kinds[v] == "worker-empty"]
            assert decision.victims[:len(workers)] == tuple(workers)  # the workers first
            still = placement.shortfall(decision.need, freed(view, workers, settled))
            assert all(n in decision.victims for n, k in kinds.items()
                       if k == "worker-empty" and any(held[n].get(d, 0) > 0 for d in still))
    elif isinstance(decision, Never):
        # no option fits even on empty devices, beside its worker
        for o in request.options:
            assert placement.never_fits(o.room(o.need, worker=True), view.capacity) is not None
        assert decision.need > decision.capacity
    else:
        assert isinstance(decision, Wait)
        # not admitted: it fits nowhere now
        assert not any(fits(o.room(o.need), view.available) for o in possible)
        if decision.why == SETTLING:  # it fits once the bytes in flight settle: nothing is evicted or drained
            assert any(fits(o.room(o.need), view.settled) for o in possible) and not decision.drain
        else:
            everything = [r.name for r in view.evictable if r.evictable]
            assert not any(fits(o.room(o.need), freed(view, everything, view.settled)) for o in possible)
            assert all(kinds[v] != "persistent" and kinds[v] != "worker-busy" for v in decision.drain)


@given(states())
def test_a_model_is_refused_at_once_exactly_when_it_cannot_fit_beside_its_worker_on_empty_devices(state):
    view, request, _ = state
    if any(placement.never_fits(o.room(o.need, worker=True), view.capacity) is None for o in request.options):
        assert not isinstance(decide(view, request), Never)
    else:  # and one that does not is refused at once, whatever is held
        assert isinstance(decide(view, request), Never)


@given(states(), st.integers(0, 2000))
def test_more_free_memory_never_turns_an_admission_away(state, extra):
    view, request, _ = state
    if isinstance(decide(view, request), Admit):
        richer = View({d: n + extra for d, n in view.available.items()}, view.capacity,
                      view.evictable, view.drainable, view.grantable, {d: n + extra for d, n in view.settled.items()})
        assert isinstance(decide(richer, request), Admit)


@given(states())
def test_decide_is_pure(state):
    view, request, _ = state
    before = (dict(view.available), dict(view.capacity), view.evictable)
    assert decide(view, request) == decide(view, request)
    assert (dict(view.available), dict(view.capacity), view.evictable) == before


def test_an_earlier_request_for_the_same_devices_goes_first():
    view = View({"d0": 100}, {"d0": 100}, (), (), ())
    request = Request("new", (Option(frozenset({"d0"}), {"d0": 10}, SPEC),), Fits(), blocked=True)
    assert isinstance(decide(view, request), Wait)


def test_an_unmeasured_model_asks_for_one_probe():
    view = View({"d0": 100}, {"d0": 100}, (), (), ())
    assert decide(view, Request("new", None, Fits())) == Wait("measuring its memory", probe=True)
    assert decide(view, Request("new", None, Fits(), probing=True)).probe is False


def test_busy_models_in_the_way_are_drained_not_evicted():
    busy = Resident("busy", {"d0": 80}, 1.0, False)
    view = View({"d0": 20}, {"d0": 100}, (busy,), (Resident("busy", {"d0": 80}, 1.0, True),), ())
    decision = decide(view, Request("new", (Option(frozenset({"d0"}), {"d0": 50}, SPEC),), Fits()))
    assert decision == Wait("waiting for busy models to finish", drain=("busy",), short={"d0": 30})


def test_a_fit_whose_worker_has_no_room_never_keeps_a_model_from_a_set_where_it_fits_now():
    """One set needs a fit, and the worker the fit would start has no room there; the other
    set's worker runs and the model fits there now: admitted there, nothing evicted or
    waited for (the fit's worker is no reason to make room while another set fits)."""
    g0, g1 = frozenset({"g0"}), frozenset({"g1"})
    fitting = Option(g0, {"g0": 950, "host": 10}, SPEC, ("g0", "host"), {"g0": 60, "host": 40}, True)
    fits_now = Option(g1, {"g1": 950, "host": 10}, SPEC, ("g1", "host"), {"g1": 60, "host": 40}, False)
    available = {"g0": 30, "g1": 970, "host": 800}
    for idle in (True, False):
        held = (Resident("i", {"g0": 950}, 1.0, idle),)
        view = View(available, {"g0": 980, "g1": 980, "host": 1000}, held, held, held)
        decision = decide(view, Request("m", (fitting, fits_now), Fits()))
        assert isinstance(decision, Admit) and decision.device_set == g1, decision


def test_a_worker_a_probe_needs_drains_the_busy_model_in_its_way():
    """A model not measured yet, whose probe starts its only set's worker where a busy model
    leaves no room: the busy model takes new requests for one turn, as for a model's own
    bytes (a worker's room is never waited for without end)."""
    busy = Resident("busy", {"d0": 950}, 1.0, False)
    view = View({"d0": 30}, {"d0": 980}, (busy,), (Resident("busy", {"d0": 950}, 1.0, True),), ())
    decision = decide(view, Request("new", None, Fits(), probe_worker=(frozenset({"d0"}), {"d0": 60})))
    assert isinstance(decision, Wait) and decision.drain == ("busy",) and not decision.probe
    never = decide(View({"d0": 30}, {"d0": 50}, (), (), ()),
                   Request("new", None, Fits(), probe_worker=(frozenset({"d0"}), {"d0": 60})))
    assert isinstance(never, Never) and "worker" in never.why


def test_a_model_too_big_for_its_grant_is_fitted_then_admitted_with_the_fit():
    option = Option(frozenset({"d0"}), {"d0": 150}, SPEC, ("d0", "host"))
    view = View({"d0": 100, "host": 1000}, {"d0": 100, "host": 1000}, (), (), ())
    first = decide(view, Request("new", (option,), Fits()))
    assert isinstance(first, Wait) and first.fit is not None
    assert dict(first.fit.grant) == {"d0": 100, "host": 1000}
    # a fit already running is not started twice
    assert decide(view, Request("new", (option,), Fits(), fitting=True)).fit is None
    book = Fits()
    fitted_spec = SPEC.replace(n_gpu_layers=3)
    book.add(frozenset({"d0"}), Fitted(dict(first.fit.grant), fitted_spec, {"d0": 90, "host": 60}))
    admitted = decide(view, Request("new", (option,), book))
    assert admitted == Admit(frozenset({"d0"}), {"d0": 90, "host": 60}, fitted_spec, book.lookup(
        frozenset({"d0"}), first.fit.grant))


def test_a_model_with_no_fit_even_on_empty_devices_is_refused_with_the_figures():
    option = Option(frozenset({"d0"}), {"d0": 150}, SPEC, ("d0", "host"))
    view = View({"d0": 100, "host": 10}, {"d0": 100, "host": 10}, (), (), ())
    book = Fits()
    book.add(frozenset({"d0"}), Fitted({"d0": 100, "host": 10}, None, error="the output layer alone needs more"))
    never = decide(view, Request("new", (option,), book))
    assert isinstance(never, Never) and never.need == 150 and never.capacity == 110
    assert "the output layer alone needs more" in never.why


# -- who waits first (router/policy/queueing.py) --------------------------------------------------

from pyllmrouter.router.policy import queueing  # noqa: E402

waiters = st.lists(st.tuples(st.integers(-3, 3), st.floats(0, 100)), min_size=1, max_size=12)


@given(waiters, st.floats(0, 200), st.floats(0.5, 30))
def test_the_higher_priority_goes_first_and_equals_keep_their_order(ws, extra, age):
    now = 100.0 + extra
    ranks = [queueing.rank(p, created, seq, now, age) for seq, (p, created) in enumerate(ws)]
    for i, (pi, ci) in enumerate(ws):
        for j, (pj, cj) in enumerate(ws):
            if i < j and pi == pj and ci <= cj:  # equals, the first come first (even with ageing)
                assert ranks[i] < ranks[j]
            if pi > pj and abs(ci - cj) < age:  # a higher priority of about the same age first
                lift_i, lift_j = (now - ci) // age, (now - cj) // age
                if lift_i >= lift_j:
                    assert ranks[i] < ranks[j]


@given(st.integers(-3, 3), st.integers(0, 6), st.floats(0.5, 30), st.floats(0, 1000))
def test_a_low_priority_waits_a_bounded_time_behind_any_stream_of_higher_ones(low, gap, age, start):
    """Waiting (gap + 1) * age seconds lifts a request above every newcomer of a priority up to
    gap levels higher: none waits forever."""
    high = low + gap
    waited = start + (gap + 1) * age
    old = queueing.rank(low, start, 1, waited, age)
    newcomer = queueing.rank(high, waited, 2, waited, age)
    assert old < newcomer


@given(st.integers(0, 50), st.integers(0, 50), st.integers(0, 8), st.booleans(),
       st.one_of(st.none(), st.integers(1, 20)), st.integers(0, 40))
def test_a_queue_limit_refuses_exactly_the_request_that_would_cross_it(tickets, leases, slots, loaded, limit,
                                                                          total_limit):
    mine = queueing.waiting(tickets, leases, max(1, slots), loaded)
    assert mine == tickets + (max(0, leases - max(1, slots)) if loaded else 0)
    refused = queueing.refusal(mine, limit, mine, total_limit)
    crosses_mine = bool(limit) and mine + 1 > limit
    crosses_all = bool(total_limit) and mine + 1 > total_limit
    assert (refused is not None) == (crosses_mine or crosses_all)
    if refused is not None:
        assert refused.scope == ("model" if crosses_mine else "router") and refused.waiting == mine


# -- which instance, and when one more (router/policy/replicas.py) ----------------------------------

from pyllmrouter.router.policy import replicas  # noqa: E402

instances = st.lists(st.tuples(st.integers(0, 10), st.integers(1, 4)), min_size=1, max_size=5).map(
    lambda xs: [replicas.Instance(f"m#{i + 1}" if i else "m", leases, slots, i == 0)
                for i, (leases, slots) in enumerate(xs)])


@given(instances)
def test_a_request_goes_to_an_instance_with_the_fewest_in_flight(xs):
    chosen = next(i for i in xs if i.name == replicas.pick(xs))
    assert chosen.leases == min(i.leases for i in xs)
    if xs[0].leases == chosen.leases:
        assert chosen.primary  # the model's own instance first among equals


@given(st.integers(1, 4), instances, st.integers(0, 2), st.integers(0, 3))
def test_one_more_instance_only_while_requests_wait_below_the_limit(limit, running, loading, free_sets):
    wants = replicas.wants_more(limit, running, loading, free_sets)
    waits = sum(i.leases for i in running) > sum(i.slots for i in running)
    assert wants == (waits and len(running) + loading < limit and loading == 0 and free_sets > 0)
