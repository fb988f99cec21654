"""The contract, pinned: every (state, event) pair of both lifecycles, allowed and forbidden.

``EXPECTED_*`` below is written by hand from the contract (README, docs/request.md) and is
the reference; the compiled tables and the python-statemachine machines must both agree with
it, pair by pair, under facts that make each guard hold and fail.
"""

from __future__ import annotations

import csv
import io
import itertools
import json
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import attrs
import pytest
from statemachine import StateMachine
from statemachine.exceptions import TransitionNotAllowed

from kvlifetime.errors import IllegalTransition
from kvlifetime.spec.lifecycles import BlockLifecycle, RequestLifecycle
from kvlifetime.spec.proof import GrantProof
from kvlifetime.spec.table import TransitionTable, block_table, request_table
from kvlifetime.spec.vocabulary import (
    BlockEvent,
    BlockState,
    RequestEvent,
    RequestState,
)

Pair = tuple[str, str]
Rule = tuple[str, str | None]  # (target, guard); None: unconditional

# --------------------------------------------------------------------------- the contract

REQUEST_STATES = [s.value for s in RequestState]
REQUEST_EVENTS = [e.value for e in RequestEvent]
_ENDED_WITH_FORCE = ["rejected", "finished", "cancel_received", "scheduling_stopped", "quarantined"]

EXPECTED_REQUEST: dict[Pair, list[Rule]] = {
    ("admitted", "rejected"): [("rejected", None)],
    ("admitted", "finished"): [("finished", None)],
    ("rejected", "cancel_received"): [("cancel_received", "all_cancel_received")],
    ("cancel_received", "scheduling_stopped"): [("scheduling_stopped", "all_scheduling_stopped")],
    ("scheduling_stopped", "transfer_quiesced"): [("transfer_quiesced", "all_grants_closed")],
    ("finished", "transfer_quiesced"): [("transfer_quiesced", "all_grants_closed")],
    ("quarantined", "transfer_quiesced"): [("transfer_quiesced", "all_grants_closed")],
    ("rejected", "quarantined"): [("quarantined", "quarantine_due")],
    ("finished", "quarantined"): [("quarantined", "quarantine_due")],
    ("cancel_received", "quarantined"): [("quarantined", "quarantine_due")],
    ("scheduling_stopped", "quarantined"): [("quarantined", "quarantine_due")],
    ("transfer_quiesced", "released"): [("released", "all_grants_closed")],
    **{(s, "force_released"): [("released", "has_open_grant")] for s in _ENDED_WITH_FORCE},
}
EXPECTED_REQUEST_UNSAFE = {"force_released"}

BLOCK_STATES = [s.label for s in BlockState]
BLOCK_EVENTS = [e.value for e in BlockEvent]

EXPECTED_BLOCK: dict[Pair, list[Rule]] = {
    ("free", "acquired"): [("owned", None)],
    ("owned", "shared"): [("owned", "no_open_write_grant")],
    ("exposed", "shared"): [("exposed", "no_open_write_grant")],
    ("quiesced", "shared"): [("owned", "no_open_write_grant")],
    # Read grants only: a reader does not change the content, so the block may be shared.
    ("draining", "shared"): [("exposed", "no_open_write_grant")],
    ("quarantined", "shared"): [("exposed", "no_open_write_grant")],
    ("owned", "exposed"): [("exposed", "write_needs_single_holder")],
    ("exposed", "exposed"): [("exposed", "write_needs_single_holder")],
    ("exposed", "grant_closed"): [("owned", "no_open_grant"), ("exposed", "has_open_grant")],
    ("draining", "grant_closed"): [("quiesced", "no_open_grant"), ("draining", "has_open_grant")],
    ("quarantined", "grant_closed"): [
        ("quiesced", "no_open_grant"),
        ("quarantined", "has_open_grant"),
    ],
    ("owned", "holder_ended"): [("quiesced", "no_live_holder"), ("owned", "has_live_holder")],
    ("exposed", "holder_ended"): [("draining", "no_live_holder"), ("exposed", "has_live_holder")],
    ("owned", "holder_released"): [("owned", "has_live_holder")],
    ("exposed", "holder_released"): [("exposed", "has_live_holder")],
    ("quiesced", "holder_released"): [("free", "no_holder"), ("quiesced", "has_holder")],
    ("draining", "quarantined"): [("quarantined", None)],
    ("draining", "force_released"): [("free", "no_holder"), ("draining", "has_holder")],
    ("quarantined", "force_released"): [("free", "no_holder"), ("quarantined", "has_holder")],
}
EXPECTED_BLOCK_UNSAFE = {"force_released"}

# What each guard means, restated independently of spec/vocabulary.py (a guard bug must show here).
REQUEST_GUARD_MEANING: Mapping[str, Any] = {
    "all_cancel_received": lambda ps: all(p.cancel_received or p.last_seq is not None for p in ps),
    "all_scheduling_stopped": lambda ps: all(p.last_seq is not None or p.revoked for p in ps),
    "all_grants_closed": lambda ps: not ps,
    "has_open_grant": lambda ps: bool(ps),
    "quarantine_due": lambda ps: any(p.suspect is not None for p in ps),
}
BLOCK_GUARD_MEANING: Mapping[str, Any] = {
    "no_open_grant": lambda f: f.open_grants == 0,
    "has_open_grant": lambda f: f.open_grants > 0,
    "no_live_holder": lambda f: f.live_holders == 0,
    "has_live_holder": lambda f: f.live_holders > 0,
    "no_holder": lambda f: f.holders == 0,
    "has_holder": lambda f: f.holders > 0,
    "no_open_write_grant": lambda f: f.open_write_grants == 0,
    "write_needs_single_holder": lambda f: f.open_write_grants == 0 or f.holders == 1,
}

# --------------------------------------------------------------------------- facts


class ReqFacts:
    """Mutable request facts: the proofs of every grant; the guards see the open ones."""

    def __init__(self, proofs: Iterable[GrantProof] = ()) -> None:
        self.proofs = list(proofs)

    def open_proofs(self) -> list[GrantProof]:
        return [p for p in self.proofs if not p.closed]


def proof(
    *,
    cancel: bool = False,
    last_seq: int | None = None,
    through: int = 0,
    revoked: bool = False,
    suspect: str | None = None,
) -> GrantProof:
    p = GrantProof()
    p.cancel_received = cancel
    p.last_seq = last_seq
    p.through_seq = through
    p.revoked = revoked
    p.suspect = suspect
    return p


def request_fact_sets() -> list[tuple[str, list[GrantProof]]]:
    return [
        ("no grant", []),
        ("closed grant", [proof(cancel=True, last_seq=2, through=2)]),
        ("fresh grant", [proof()]),
        ("cancel received", [proof(cancel=True)]),
        ("cancel received + fresh", [proof(cancel=True), proof()]),
        ("scheduling stopped, in flight", [proof(cancel=True, last_seq=3, through=1)]),
        ("stopped + cancel only", [proof(cancel=True, last_seq=3), proof(cancel=True)]),
        ("suspect", [proof(suspect="lease_expired")]),
        ("suspect, stopped", [proof(cancel=True, last_seq=1, suspect="peer_lost")]),
    ]


@attrs.define
class BlkFacts:
    holders: int = 0
    live_holders: int = 0
    open_grants: int = 0
    open_write_grants: int = 0


def block_fact_sets() -> list[BlkFacts]:
    out = []
    for holders, grants in itertools.product(range(3), range(3)):
        for live, writes in itertools.product(range(holders + 1), range(grants + 1)):
            out.append(BlkFacts(holders, live, grants, writes))
    return out


# How to reach each state through the machine itself: (event, facts while sending it).
REQUEST_PATHS: dict[str, list[str]] = {
    "admitted": [],
    "rejected": ["rejected"],
    "finished": ["finished"],
    "cancel_received": ["rejected", "cancel_received"],
    "scheduling_stopped": ["rejected", "cancel_received", "scheduling_stopped"],
    "transfer_quiesced": ["finished", "transfer_quiesced"],
    "quarantined": ["rejected", "quarantined"],
    "released": ["finished", "transfer_quiesced", "released"],
}

BLOCK_PATHS: dict[str, list[tuple[str, BlkFacts]]] = {
    "free": [],
    "owned": [("acquired", BlkFacts(1, 1))],
    "exposed": [("acquired", BlkFacts(1, 1)), ("exposed", BlkFacts(1, 1, 1, 1))],
    "draining": [
        ("acquired", BlkFacts(1, 1)),
        ("exposed", BlkFacts(1, 1, 1, 1)),
        ("holder_ended", BlkFacts(1, 0, 1, 1)),
    ],
    "quiesced": [("acquired", BlkFacts(1, 1)), ("holder_ended", BlkFacts(1, 0))],
    "quarantined": [
        ("acquired", BlkFacts(1, 1)),
        ("exposed", BlkFacts(1, 1, 1, 1)),
        ("holder_ended", BlkFacts(1, 0, 1, 1)),
        ("quarantined", BlkFacts(1, 0, 1, 1)),
    ],
}


def request_machine_at(state: str) -> tuple[RequestLifecycle, ReqFacts]:
    facts = ReqFacts()
    m = RequestLifecycle(facts)
    if state == "quarantined":
        facts.proofs = [proof(suspect="lease_expired")]
    for ev in REQUEST_PATHS[state]:
        m.send(ev)
    assert m.current_state_value == state
    return m, facts


def block_machine_at(state: str) -> tuple[BlockLifecycle, BlkFacts]:
    facts = BlkFacts()
    m = BlockLifecycle(facts)
    for ev, f in BLOCK_PATHS[state]:
        facts.holders, facts.live_holders = f.holders, f.live_holders
        facts.open_grants, facts.open_write_grants = f.open_grants, f.open_write_grants
        m.send(ev)
    assert m.current_state_value == state
    return m, facts


def expected_outcome(rules: Sequence[Rule], holds: Mapping[str, bool]) -> str | None:
    """The target of the first rule whose guard holds; None: the guard refuses."""
    for target, guard in rules:
        if guard is None or holds[guard]:
            return target
    return None


def machine_outcome(m: StateMachine, event: str) -> tuple[str, str]:
    """("moved", target) or ("refused", "no_row" | "guard") for the spec machine."""
    before = m.current_state_value
    has_row = event in {e.id for e in m.allowed_events}
    try:
        m.send(event)
    except TransitionNotAllowed:
        assert m.current_state_value == before, "a refused event changed the state"
        return ("refused", "guard" if has_row else "no_row")
    return ("moved", str(m.current_state_value))


# --------------------------------------------------------------------------- the tables


def _pairs(states: list[str], events: list[str]) -> list[Pair]:
    return list(itertools.product(states, events))


def test_request_states_and_events() -> None:
    t = request_table()
    assert list(t.states) == REQUEST_STATES
    assert set(t.events) == set(REQUEST_EVENTS)
    assert t.initial == "admitted"
    assert t.finals == ("released",)


def test_block_states_and_events() -> None:
    t = block_table()
    assert list(t.states) == BLOCK_STATES
    assert set(t.events) == set(BLOCK_EVENTS)
    assert t.initial == "free"
    assert t.finals == ()


def _rules(t: TransitionTable, state: str, event: str) -> list[Rule]:
    return [(r.target, r.guard) for r in t.rows_for(state, event)]


@pytest.mark.parametrize(("state", "event"), _pairs(REQUEST_STATES, REQUEST_EVENTS))
def test_request_pair_in_table(state: str, event: str) -> None:
    t = request_table()
    expected = EXPECTED_REQUEST.get((state, event), [])
    assert _rules(t, state, event) == expected
    assert t.allows(state, event) == bool(expected)
    for r in t.rows_for(state, event):
        assert r.unsafe == (event in EXPECTED_REQUEST_UNSAFE)
    if not expected:
        with pytest.raises(IllegalTransition) as exc:
            t.step(state, event, ReqFacts(), subject="r1")
        assert (exc.value.state, exc.value.event, exc.value.subject) == (state, event, "r1")


@pytest.mark.parametrize(("state", "event"), _pairs(BLOCK_STATES, BLOCK_EVENTS))
def test_block_pair_in_table(state: str, event: str) -> None:
    t = block_table()
    expected = EXPECTED_BLOCK.get((state, event), [])
    assert _rules(t, state, event) == expected
    assert t.allows(state, event) == bool(expected)
    for r in t.rows_for(state, event):
        assert r.unsafe == (event in EXPECTED_BLOCK_UNSAFE)
    if not expected:
        with pytest.raises(IllegalTransition):
            t.step(state, event, BlkFacts())


def test_no_row_outside_the_contract() -> None:
    assert {(r.source, r.event) for r in request_table().rows} == set(EXPECTED_REQUEST)
    assert {(r.source, r.event) for r in block_table().rows} == set(EXPECTED_BLOCK)


# --------------------------------------------------------------------------- spec machine agrees


@pytest.mark.parametrize(("state", "event"), _pairs(REQUEST_STATES, REQUEST_EVENTS))
def test_request_pair_spec_machine_agrees(state: str, event: str) -> None:
    rules = EXPECTED_REQUEST.get((state, event), [])
    seen: set[str | None] = set()
    for label, proofs in request_fact_sets():
        m, facts = request_machine_at(state)
        facts.proofs = proofs
        open_ps = facts.open_proofs()
        holds = {g: mean(open_ps) for g, mean in REQUEST_GUARD_MEANING.items()}
        target = expected_outcome(rules, holds)
        seen.add(target)
        got = machine_outcome(m, event)
        if not rules:
            assert got == ("refused", "no_row"), label
        elif target is None:
            assert got == ("refused", "guard"), label
        else:
            assert got == ("moved", target), label
        # and the compiled table, on the very same facts
        if rules:
            assert request_table().step(state, event, facts) == target, label
    if rules:
        # the fact sets exercise both outcomes of every guarded pair
        guarded = any(g is not None for _, g in rules)
        assert len(seen) == (2 if guarded else 1)


@pytest.mark.parametrize(("state", "event"), _pairs(BLOCK_STATES, BLOCK_EVENTS))
def test_block_pair_spec_machine_agrees(state: str, event: str) -> None:
    rules = EXPECTED_BLOCK.get((state, event), [])
    targets: set[str | None] = set()
    for f in block_fact_sets():
        m, facts = block_machine_at(state)
        facts.holders, facts.live_holders = f.holders, f.live_holders
        facts.open_grants, facts.open_write_grants = f.open_grants, f.open_write_grants
        holds = {g: mean(f) for g, mean in BLOCK_GUARD_MEANING.items()}
        target = expected_outcome(rules, holds)
        targets.add(target)
        got = machine_outcome(m, event)
        if not rules:
            assert got == ("refused", "no_row"), f
        elif target is None:
            assert got == ("refused", "guard"), f
        else:
            assert got == ("moved", target), f
        if rules:
            assert block_table().step(state, event, facts) == target, f
    if rules:
        # the fact sets reach every row, and the refusal of a lone guarded row
        can_refuse = len(rules) == 1 and rules[0][1] is not None
        assert targets == {t for t, _ in rules} | ({None} if can_refuse else set())


# --------------------------------------------------------------------------- exports


@pytest.mark.parametrize("table", [request_table(), block_table()], ids=["request", "block"])
def test_json_export_round_trips(table: TransitionTable) -> None:
    doc = json.loads(table.to_json())
    assert doc["machine"] == table.machine
    assert doc["states"] == list(table.states)
    assert doc["initial"] == table.initial
    assert doc["finals"] == list(table.finals)
    assert doc["events"] == list(table.events)
    assert [
        (d["source"], d["event"], d["target"], d["guard"], d["unsafe"]) for d in doc["transitions"]
    ] == [(r.source, r.event, r.target, r.guard, r.unsafe) for r in table.rows]


@pytest.mark.parametrize("table", [request_table(), block_table()], ids=["request", "block"])
def test_csv_export_parses(table: TransitionTable) -> None:
    rows = list(csv.DictReader(io.StringIO(table.to_csv())))
    assert [
        (d["source"], d["event"], d["target"], d["guard"] or None, d["unsafe"] == "yes")
        for d in rows
    ] == [(r.source, r.event, r.target, r.guard, r.unsafe) for r in table.rows]


def _md_table(md: str, header: str) -> list[list[str]]:
    lines = md.split("\n")
    start = lines.index(header)
    body = []
    for ln in lines[start + 2 :]:
        if not ln.startswith("|"):
            break
        body.append([c.strip() for c in ln.strip("|").split(" | ")])
    return body


@pytest.mark.parametrize("table", [request_table(), block_table()], ids=["request", "block"])
def test_markdown_export_parses(table: TransitionTable) -> None:
    md = table.to_markdown()
    rows = _md_table(md, "| from | event | to | guard | |")
    assert [(c[0], c[1], c[2], c[3] or None, c[4] == "**unsafe**") for c in rows] == [
        (r.source, r.event, r.target, r.guard, r.unsafe) for r in table.rows
    ]
    matrix = _md_table(md, "| state \\ event | " + " | ".join(table.events) + " |")
    assert [c[0] for c in matrix] == [f"**{s}**" for s in table.states]
    for cells in matrix:
        state = cells[0].strip("*")
        for event, cell in zip(table.events, cells[1:], strict=True):
            assert bool(cell) == table.allows(state, event)


def test_render_unknown_format() -> None:
    with pytest.raises(ValueError, match="unknown table format"):
        request_table().render("xml")
