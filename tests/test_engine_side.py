"""The engine-side lifecycle (``EngineSideLifecycle``, machine ``engine``) and the guard core's
``Holds``, which every guard steps: the compiled table agrees with the python-statemachine class
pair by pair, and ``Holds`` fires exactly the table's rows, refusing everything else as data."""

from __future__ import annotations

import itertools

import attrs
import hypothesis.strategies as st
import numpy as np
import pytest
from hypothesis import given, settings
from statemachine.exceptions import TransitionNotAllowed
from structlog.testing import capture_logs

from kvlifetime.errors import DoubleRelease, IllegalTransition, UnknownRequest
from kvlifetime.grant import Access
from kvlifetime.guard import Holds, RefusalKind, Refusals
from kvlifetime.ledger import BlockLedger
from kvlifetime.spec.lifecycles import EngineSideLifecycle
from kvlifetime.spec.table import engine_table
from kvlifetime.spec.vocabulary import EngineEvent, EngineState

STATES = [s.value for s in EngineState]
EVENTS = [e.value for e in EngineEvent]


@attrs.define
class Facts:
    write_open: bool = False
    write_failed: bool = False
    read_open: bool = False
    read_this_step: bool = False
    read_reaped: bool = False


FACTS = [Facts(*bits) for bits in itertools.product((False, True), repeat=5)]


def test_states_and_events_are_the_vocabulary() -> None:
    t = engine_table()
    assert list(t.states) == STATES
    assert set(t.events) == set(EVENTS)
    assert t.initial == "running" and t.finals == ("handed_back",)


@pytest.mark.parametrize(("state", "event"), list(itertools.product(STATES, EVENTS)))
def test_every_pair_the_class_and_the_table_agree(state: str, event: str) -> None:
    """Under every combination of facts: the same target, or both refuse."""
    t = engine_table()
    for facts in FACTS:
        try:
            want: str | None = t.step(state, event, facts)
        except IllegalTransition:
            want = None
        if state == "handed_back":
            assert want is None  # final: nothing leaves it
            continue
        m = EngineSideLifecycle(facts, start_value=state)
        try:
            m.send(event)
            got: str | None = m.current_state_value
        except TransitionNotAllowed:
            got = None
        assert got == want, (state, event, facts)


def test_what_the_engine_is_told_depends_only_on_the_ledger_verdict() -> None:
    """An ended request's id goes back only from ``releasable``, reached only by ``released``
    (the ledger's verdict); no engine signal reaches it directly."""
    t = engine_table()
    into_releasable = {r.event for r in t.rows if r.target == "releasable"}
    assert into_releasable == {"released"}
    back = {(r.source, r.event) for r in t.rows if r.target == "handed_back"}
    # From ended (nothing exposed: the engine's own id frees it) or releasable only.
    assert {s for s, _ in back} == {"ended", "releasable"}
    # No signal ends an exposure of an ended request except through the ledger.
    for r in t.rows:
        if r.source in ("withheld", "quarantined"):
            assert r.target in ("withheld", "quarantined", "releasable")


def test_reads_done_in_the_step_of_the_grant_proves_nothing() -> None:
    t = engine_table()
    assert t.step("withheld", "reads_done", Facts(read_open=True, read_this_step=True)) is None
    assert t.step("withheld", "reads_done", Facts(read_open=True)) == "withheld"
    assert t.step("reading", "reads_done", Facts(read_open=True, read_this_step=True)) is None


# --------------------------------------------------------------------------- Holds


def _grant(ledger: BlockLedger, request: str, ids: list[int], access: Access) -> object:
    outcome = ledger.acquire_and_grant_many([(request, np.array(ids), "peer", access)])
    assert not outcome.refused
    return outcome.grants[0]


def test_holds_fire_rows_and_refuse_the_rest_as_data() -> None:
    refusals = Refusals("fake")
    holds: Holds[object] = Holds(refusals)
    seen: list[tuple[str, str, str, str]] = []
    holds.observers.append(lambda *row: seen.append(row))
    holds.admit("a")
    assert holds.fire("a", "finished") is None
    assert holds.state("a") == "ended"
    r = holds.fire("a", "load_failed")  # no row from ended
    assert r is not None and r.kind is RefusalKind.OUT_OF_ORDER
    assert isinstance(r.error, IllegalTransition)
    assert holds.state("a") == "ended"  # unchanged
    assert holds.fire("a", "handed_back") is None
    # The engine freed it on its own id (nothing was exposed): forgotten, not remembered.
    assert "a" not in holds and not holds.handed_back("a")
    again = holds.fire("a", "load_landed")
    assert again is not None and again.kind is RefusalKind.UNKNOWN_ID
    assert isinstance(again.error, UnknownRequest)
    # One the guard handed back (from releasable) is remembered: a repeat is a duplicate.
    b = holds.admit("b")
    holds.fire("b", "aborted")
    b.read = object()
    holds.fire("b", "read_granted")
    b.read = None
    holds.fire("b", "released")
    assert holds.fire("b", "handed_back") is None and holds.handed_back("b")
    dup = holds.fire("b", "reads_done")
    assert dup is not None and dup.kind is RefusalKind.DUPLICATE_ID
    assert isinstance(dup.error, DoubleRelease)
    assert seen == [
        ("a", "running", "finished", "ended"),
        ("a", "ended", "handed_back", "handed_back"),
        ("b", "running", "aborted", "ended"),
        ("b", "ended", "read_granted", "withheld"),
        ("b", "withheld", "released", "releasable"),
        ("b", "releasable", "handed_back", "handed_back"),
    ]
    assert refusals.counts == {"out_of_order": 1, "unknown_id": 1, "duplicate_id": 1}
    with capture_logs() as logs:
        drained = refusals.drain()
    assert len(drained) == 3 and [e["kind"] for e in logs] == [
        "out_of_order",
        "unknown_id",
        "duplicate_id",
    ]
    assert all(e["event"] == "guard_refused" and e["engine"] == "fake" for e in logs)
    assert refusals.drain() == []  # logged once


def test_a_report_in_the_step_of_the_exposure_is_premature_then_accepted() -> None:
    ledger = BlockLedger(8, counts="engine")
    refusals = Refusals("fake")
    holds: Holds[object] = Holds(refusals)
    hold = holds.admit("r")
    holds.fire("r", "finished")
    hold.read = _grant(ledger, "r", [1, 2], Access.READ)
    hold.read_step = holds.step
    assert holds.fire("r", "read_granted") is None
    early = holds.fire("r", "reads_done")
    assert early is not None and early.kind is RefusalKind.BEFORE_EXPOSURE
    assert holds.state("r") == "withheld"
    holds.next_step()
    assert holds.fire("r", "reads_done") is None  # the ids left with the last step's output
    recv = holds.fire("r", "load_landed")
    assert recv is not None and recv.kind is RefusalKind.WRONG_CHANNEL


def test_a_readmitted_key_is_a_new_use() -> None:
    holds: Holds[object] = Holds(Refusals("fake"))
    k = holds.admit("k")
    holds.fire("k", "aborted")
    k.read = object()
    holds.fire("k", "read_granted")
    k.read = None
    holds.fire("k", "released")
    holds.fire("k", "handed_back")
    assert holds.handed_back("k")
    holds.admit("k")
    assert holds.state("k") == "running" and not holds.handed_back("k")


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["a", "b"]),
            st.sampled_from(
                [*EVENTS, "next_step", "expose_read", "expose_write", "close", "fail", "reap"]
            ),
        ),
        max_size=40,
    )
)
def test_holds_and_the_spec_machines_walk_together(steps: list[tuple[str, str]]) -> None:
    """A fake engine drives ``Holds`` and one ``EngineSideLifecycle`` per request side by side:
    every row ``Holds`` fires the machine fires too, every refusal the machine refuses too."""
    holds: Holds[object] = Holds(Refusals("fake"))
    machines: dict[str, EngineSideLifecycle] = {}
    facts: dict[str, Facts] = {}
    for key, what in steps:
        if key not in holds and not holds.handed_back(key):
            holds.admit(key)
            facts[key] = Facts()
            machines[key] = EngineSideLifecycle(facts[key])
        hold = holds.get(key)
        if what == "next_step":
            holds.next_step()
            for f in facts.values():
                f.read_this_step = False
            continue
        if hold is None:
            r = holds.fire(key, what) if what in EVENTS else None
            assert r is None or r.kind is RefusalKind.DUPLICATE_ID
            continue
        f = facts[key]
        if what == "expose_read":
            hold.read, hold.read_step = object(), holds.step
            f.read_open = f.read_this_step = True
            continue
        if what == "expose_write":
            hold.write = object()
            f.write_open = True
            continue
        if what == "close":
            hold.read = hold.write = None
            hold.write_failed = hold.read_reaped = False
            f.read_open = f.write_open = f.read_this_step = False
            f.write_failed = f.read_reaped = False
            continue
        if what == "fail":
            hold.write_failed = f.write_failed = True
            continue
        if what == "reap":
            hold.read_reaped = f.read_reaped = True
            continue
        m = machines[key]
        before = m.current_state_value
        try:
            m.send(what)
            moved = True
        except TransitionNotAllowed:
            moved = False
        refusal = holds.fire(key, what)
        after = holds.state(key) or "handed_back"
        if refusal is None:
            assert moved and m.current_state_value == after
        else:
            assert holds.state(key) == before  # a refusal changes nothing
            assert not moved or m.current_state_value == before


# --------------------------------------------------------------------------- the owner's view


def test_the_owner_view_is_projected_from_the_engine_table() -> None:
    from kvlifetime.spec.owner import owner_table, project

    assert dict(owner_table()) == {
        ("live", "finished"): "finished",
        ("live", "aborted"): "rejected",
        ("finished", "handed_back"): "released",
        ("rejected", "handed_back"): "released",
    }
    # Computed, not written beside it: a table where one live state cannot be aborted has no
    # projected abort, so a model stepping it can no longer reject.
    t = engine_table()
    rows = [r for r in t.rows if not (r.source == "reading" and r.event == "aborted")]
    broken = attrs.evolve(t, rows=tuple(rows))
    assert ("live", "aborted") not in project(broken)
    assert ("live", "finished") in project(broken)


def test_the_verifier_steps_its_owner_phases_only_through_the_engine_table() -> None:
    """Every owner-phase change the verifier's model makes, in a search over a small
    configuration with every fault and policy, is a row of ``owner_table()``; and every row
    fires. (Pure modules, in a process of its own: a compiled module's calls cannot be
    watched.)"""
    import json
    import os
    import subprocess
    import sys

    code = """
import json
from kvlifetime.spec.owner import owner_step
from kvlifetime.verify import semantics, policies, scratch
from kvlifetime.verify import ALL_FAULTS, Config, Policy, explore
fired = set()
def watched(phase, event):
    target = owner_step(phase, event)
    fired.add((phase, event, target))
    return target
for m in (semantics, policies, scratch):
    m.owner_step = watched
for policy in Policy:
    explore(Config(1, 1, 1, faults=ALL_FAULTS), policy)
print(json.dumps(sorted(fired)))
"""
    env = {**os.environ, "KVLIFETIME_PURE": "1"}
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    from kvlifetime.spec.owner import owner_table

    fired = {tuple(x) for x in json.loads(proc.stdout)}
    assert fired == {(p, e, t) for (p, e), t in owner_table().items()}


def test_no_owner_phase_is_set_in_the_verifier_but_through_owner_step() -> None:
    """Read from the source: every ``phase=`` of the verifier's model is ``owner_step``'s,
    but the restart's (a new process holds nothing of the old one's: no engine-side event)."""
    import pathlib
    import re

    import kvlifetime.verify as verify

    root = pathlib.Path(verify.__file__).parent
    found = []
    for path in sorted(root.glob("*.py")):
        for line in path.read_text(encoding="utf-8").splitlines():
            m = re.search(r"\bphase=([^,)]+)", line)
            if m and not m.group(1).startswith("owner_step("):
                found.append(f"{path.name}: {line.strip()}")
    assert found == ["semantics.py: reqs=tuple(evolve(r, phase=RELEASED) for r in env.reqs),"]
