"""Nothing runs twice on a cluster (ray/ledger.py): a model-based search over a world
where nodes take a request, claim it, run it, die or fall silent at any point, and where
every message between a node and the ingress may be late or never arrive.

The ingress's rule is the real one (failover.after_loss, with "began" as the ingress
computes it: a Started seen, or its ledger's abandon found a claim); a node runs a
request only once its claim came back True.  The invariant: no request runs on two
nodes.  The same search, run with the rule the ledger replaced ("began" is a Started
seen, nothing more), finds a request that runs twice: the test can fail."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from pyllmrouter.ray import failover
from pyllmrouter.ray.ledger import Claims

NODES = ("n0", "n1", "n2")


def test_a_claim_and_an_abandon_decide_once_the_first_wins():
    c = Claims()
    assert c.claim(1) is True and c.abandon(1) is True  # claimed first: it may have run
    assert c.abandon(2) is False and c.claim(2) is False  # given up first: it never runs
    assert c.claim(3) is True and c.claim(3) is False  # claimed once
    c.settle(1)
    c.settle(2)
    assert c.claim(2) is False  # settling keeps a given-up ticket refused
    c.settle(4)  # over before any claim (a claim that comes late): refused
    assert c.claim(4) is False


def test_a_ticket_let_go_and_every_earlier_one_are_refused():
    c = Claims(kept=2)
    for t in (5, 3, 7):
        c.abandon(t)
    assert len(c) == 2
    assert c.claim(5) is False  # let go (the oldest given up): refused all the same
    assert c.claim(4) is False  # never seen, but under the highest let go: refused
    assert c.claim(3) is False and c.claim(7) is False  # still kept
    assert c.claim(8) is True


def test_no_ticket_still_in_flight_is_refused_however_many_are_given_up():
    """Ticket 1 waits (for a slot) while 2..9 end unclaimed: the floor stays under 1, the
    ledger keeps more than its limit meanwhile, and lets them go once 1 is over."""
    c = Claims(kept=2)
    for t in range(2, 10):
        c.settle(t, low=1)
    assert c.claim(1) is True and len(c) == 8 + 1
    c.settle(1, low=10)
    c.abandon(10, low=11)
    assert len(c) == 2 and c.claim(9) is False and c.claim(11) is True


class Cluster(RuleBasedStateMachine):
    """One request at a time, sent by the ingress to a node, each attempt its own ticket
    (a ledger that keeps two given-up tickets: letting them go is searched too)."""

    use_ledger = True

    def __init__(self):
        super().__init__()
        self.claims = Claims(kept=2)
        self.runs: dict[int, set[str]] = {}  # request -> nodes it ran on
        self.request = 0
        self.stale: list = []  # attempts of nodes taken for lost, which may still act
        self._send_new()

    def _send_new(self):
        self.request += 1
        self.runs[self.request] = set()
        self.retried = False
        self._attempt(None)

    def _attempt(self, exclude):
        self.attempts = getattr(self, "attempts", 0) + 1
        self.ticket = self.attempts  # the ingress's count
        self.ticket_request = getattr(self, "ticket_request", {})
        self.ticket_request[self.ticket] = self.request
        self.node = next(n for n in NODES if n != exclude)
        self.claim_sent = False  # the node asked the ledger
        self.pending_claim = False  # its question on its way (an older attempt's: the_lost_node_resumes)
        self.claim_answer: bool | None = None  # what came back to the node (None: not yet, or lost)
        self.started_sent = False  # a Started on its way to the ingress
        self.started_seen = False
        self.decided = False  # the ingress is done with this attempt

    # -- the node --------------------------------------------------------------------------

    @precondition(lambda self: not self.claim_sent)
    @rule()
    def node_claims(self):
        self.claim_sent = True
        self.pending_claim = True

    @precondition(lambda self: self.pending_claim)
    @rule(lost=st.booleans())
    def ledger_answers_the_claim(self, lost):
        self.pending_claim = False
        answer = self.claims.claim(self.ticket) if self.use_ledger else True
        self.claim_answer = None if lost else answer  # an answer lost: the node does not run it

    @precondition(lambda self: self.claim_answer is True and not self.started_sent)
    @rule()
    def node_runs(self):
        self.runs[self.request].add(self.node)  # (stale attempts' nodes run under their request too)
        self.started_sent = True

    @precondition(lambda self: self.started_sent and not self.started_seen and not self.decided)
    @rule()
    def started_arrives(self):
        self.started_seen = True

    # -- the ingress -----------------------------------------------------------------------

    @precondition(lambda self: not self.decided)
    @rule()
    def node_lost_or_silent(self):
        """The call fails (a loss, a silence: whatever the node did so far, and whatever is
        still in transit)."""
        began = self.started_seen
        if self.use_ledger:
            began = began or self.claims.abandon(self.ticket)
        self.claims.settle(self.ticket)
        self.decided = True
        if failover.after_loss(began, self.retried, True, True) == failover.RETRY:
            stale = (self.ticket, self.node, self.claim_answer)
            self.retried = True
            self._attempt(self.node)
            self.stale.append(stale)  # the lost node may still act on its attempt
        else:
            self._send_new()

    @precondition(lambda self: self.stale)
    @rule(data=st.data())
    def the_lost_node_resumes(self, data):
        """A node taken for lost (stopped, not dead) goes on with an old attempt, however
        many tickets were given up since: it claims if it had not, and runs where the
        ledger says yes."""
        ticket, node, answer = self.stale.pop(data.draw(st.integers(0, len(self.stale) - 1)))
        if answer is None:
            answer = self.claims.claim(ticket) if self.use_ledger else True
        if answer:
            self.runs[self.ticket_request[ticket]].add(node)

    @precondition(lambda self: not self.decided and self.started_seen)
    @rule()
    def reply_completes(self):
        self.claims.settle(self.ticket)
        self.decided = True
        self._send_new()

    @invariant()
    def runs_at_most_once(self):
        for request, nodes in self.runs.items():
            assert len(nodes) <= 1, f"request {request} ran on {sorted(nodes)}"


class WithoutLedger(Cluster):
    use_ledger = False


TestNothingRunsTwice = Cluster.TestCase
TestNothingRunsTwice.settings = settings(max_examples=300, stateful_step_count=30, deadline=None,
                                         suppress_health_check=list(HealthCheck))


def test_the_search_finds_a_second_run_without_the_ledger():
    """The rule the ledger replaced ("began" = a Started seen): a Started still in transit
    when the node is taken for lost lets the request run on the next node as well."""
    with pytest.raises(AssertionError, match="ran on"):
        WithoutLedger.TestCase.settings = settings(max_examples=300, stateful_step_count=30, deadline=None,
                                                   suppress_health_check=list(HealthCheck), database=None)
        WithoutLedger.TestCase().runTest()
