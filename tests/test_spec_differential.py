"""Differential: the python-statemachine specification and the compiled tables agree.

Random runs of events and evidence go through both a ``RequestLifecycle`` / ``BlockLifecycle``
and ``TransitionTable.step`` over the *same* facts. After every step both must be in the same
state and must have refused (or not) in the same way: "no row" (``IllegalTransition`` from the
table, an event the machine has no transition for) is a different refusal from "rows, but no
guard holds".
"""

from __future__ import annotations

from typing import Any

import attrs
from hypothesis import given, settings
from hypothesis import strategies as st
from statemachine import StateMachine
from statemachine.exceptions import TransitionNotAllowed

from kvlifetime.errors import ContradictoryEvidence, IllegalTransition
from kvlifetime.evidence import (
    AccessRevoked,
    CancelReceived,
    Evidence,
    LeaseExpired,
    PeerLost,
    SchedulingStopped,
    TransferCompleted,
    TransferQuiesced,
)
from kvlifetime.grant import GrantId
from kvlifetime.spec.lifecycles import BlockLifecycle, RequestLifecycle
from kvlifetime.spec.proof import GrantProof
from kvlifetime.spec.table import TransitionTable, block_table, request_table
from kvlifetime.spec.vocabulary import (
    PROOF_CHAIN,
    BlockEvent,
    RequestEvent,
)

Outcome = tuple[str, str]  # ("moved", target) | ("refused", "no_row" | "guard")


def machine_step(m: StateMachine, event: str) -> Outcome:
    before = m.current_state_value
    has_row = event in {e.id for e in m.allowed_events}
    try:
        m.send(event)
    except TransitionNotAllowed:
        assert m.current_state_value == before
        return ("refused", "guard" if has_row else "no_row")
    return ("moved", str(m.current_state_value))


def table_step(t: TransitionTable, state: str, event: str, facts: Any) -> Outcome:
    try:
        target = t.step(state, event, facts)
    except IllegalTransition:
        return ("refused", "no_row")
    return ("refused", "guard") if target is None else ("moved", target)


# --------------------------------------------------------------------------- request


class Grants:
    """The request facts: one GrantProof per grant, fed real evidence objects."""

    def __init__(self, n: int) -> None:
        self.ids = [GrantId("inc", i + 1) for i in range(n)]
        self.proofs = [GrantProof() for _ in range(n)]

    def open_proofs(self) -> list[GrantProof]:
        return [p for p in self.proofs if not p.closed]

    def evidence(self, i: int, kind: str, seq: int) -> Evidence:
        gid, peer = self.ids[i], f"peer-{i}"
        if kind == "cancel":
            return CancelReceived(gid, "req", peer)
        if kind == "stopped":
            return SchedulingStopped(gid, "req", peer, seq)
        if kind == "quiesced":
            return TransferQuiesced(gid, "req", peer, seq)
        if kind == "completed":
            return TransferCompleted(gid, "req", peer, seq)
        if kind == "revoked":
            return AccessRevoked(peer, gid, "req")
        if kind == "lease":
            return LeaseExpired(gid, "req", peer)
        return PeerLost(peer)

    def apply(self, i: int, ev: Evidence) -> None:
        p = self.proofs[i]
        try:
            p.check(ev)
        except ContradictoryEvidence:
            return  # refused by the ledger, changes nothing
        p.record(ev)


EVIDENCE_KINDS = ["cancel", "stopped", "quiesced", "completed", "revoked", "lease", "peer_lost"]

REQUEST_EVENTS = [e.value for e in RequestEvent]
evidence_actions = st.tuples(
    st.just("evidence"), st.integers(0, 2), st.sampled_from(EVIDENCE_KINDS), st.integers(0, 4)
)


def event_choice(data: st.DataObject, t: TransitionTable, state: str, events: list[str]) -> str:
    """Mostly an event with a row from ``state`` (so runs go deep), sometimes any event (so
    "no row" refusals are exercised everywhere)."""
    with_row = [e for e in events if t.allows(state, e)]
    if with_row and data.draw(st.integers(0, 3), label="pick_with_row") > 0:
        return data.draw(st.sampled_from(with_row), label="event")
    return data.draw(st.sampled_from(events), label="event")


@settings(max_examples=300, deadline=None)
@given(n_grants=st.integers(1, 3), n_steps=st.integers(0, 40), data=st.data())
def test_request_spec_and_table_agree(n_grants: int, n_steps: int, data: st.DataObject) -> None:
    facts = Grants(n_grants)
    machine = RequestLifecycle(facts)
    table = request_table()
    state = table.initial
    assert machine.current_state_value == state
    for _ in range(n_steps):
        what = data.draw(st.sampled_from(["event", "evidence", "evidence", "settle"]))
        if what == "evidence":
            _, i, kind, seq = data.draw(evidence_actions)
            i %= n_grants
            facts.apply(i, facts.evidence(i, kind, seq))
            continue
        if what == "event":
            events = [event_choice(data, table, state, REQUEST_EVENTS)]
        else:
            # what the ledger does after each change: try every proof stage, in order
            events = [e.value for e in PROOF_CHAIN]
        for event in events:
            want = table_step(table, state, event, facts)
            got = machine_step(machine, event)
            assert got == want, (state, event, [p.key() for p in facts.proofs])
            if want[0] == "moved":
                state = want[1]
            assert machine.current_state_value == state


def test_settle_reaches_transfer_quiesced_with_vacuous_guards() -> None:
    # The property above relies on "settle" driving runs deep; pin that it does.
    facts = Grants(1)
    facts.apply(0, facts.evidence(0, "completed", 2))
    machine = RequestLifecycle(facts)
    machine.send("rejected")
    for e in PROOF_CHAIN:
        if table_step(request_table(), machine.current_state_value, e.value, facts)[0] == "moved":
            machine.send(e.value)
    assert machine.current_state_value == "transfer_quiesced"


# --------------------------------------------------------------------------- block


@attrs.define
class Counts:
    holders: int = 0
    live_holders: int = 0
    open_grants: int = 0
    open_write_grants: int = 0


@st.composite
def counts(draw: st.DrawFn) -> Counts:
    holders = draw(st.integers(0, 3))
    grants = draw(st.integers(0, 3))
    return Counts(
        holders,
        draw(st.integers(0, holders)),
        grants,
        draw(st.integers(0, grants)),
    )


BLOCK_EVENTS = [e.value for e in BlockEvent]


@settings(max_examples=300, deadline=None)
@given(n_steps=st.integers(0, 40), data=st.data())
def test_block_spec_and_table_agree(n_steps: int, data: st.DataObject) -> None:
    facts = Counts()
    machine = BlockLifecycle(facts)
    table = block_table()
    state = table.initial
    for _ in range(n_steps):
        c = data.draw(counts())
        event = event_choice(data, table, state, BLOCK_EVENTS)
        # the caller updates the facts first, then sends the event
        facts.holders, facts.live_holders = c.holders, c.live_holders
        facts.open_grants, facts.open_write_grants = c.open_grants, c.open_write_grants
        want = table_step(table, state, event, facts)
        got = machine_step(machine, event)
        assert got == want, (state, event, c)
        if want[0] == "moved":
            state = want[1]
        assert machine.current_state_value == state
