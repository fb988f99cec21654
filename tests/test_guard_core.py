"""The guard core's promises, each pinned in seconds against a fake engine (tests/guard_fake.py):
the journal's refused READ and refused WRITE paths, evidence never before its exposure, an id
handed back once, fences recorded from another thread mid-step, refusals as data on one log
path. The engines' own suites (tests/in_vllm, tests/in_sglang) check the same through real
classes."""

from __future__ import annotations

import threading
import time

import pytest
from guard_fake import FakeEngine
from structlog.testing import capture_logs

from kvlifetime.errors import InvalidField
from kvlifetime.guard import GuardCore
from kvlifetime.ledger import StepLedger
from kvlifetime.spec.table import engine_table


def _rows_fired(core: GuardCore) -> list[tuple[str, str, str]]:
    seen: list[tuple[str, str, str]] = []
    core.holds.observers.append(lambda r, a, e, b: seen.append((a, e, b)))
    return seen


def test_a_remote_read_is_released_once_after_its_proof() -> None:
    e = FakeEngine()
    seen = _rows_fired(e.core)
    e.admit("a", 3)
    e.end("a", remote_read=True)
    assert e.step_end() == [] and e.freed == []
    e.step_begin()
    e.sends(["a"])
    assert e.freed == ["a"] and e.core.refusals.counts == {}
    assert e.core.ledger.stats().blocks_by_state["free"] == 16
    rows = {(r.source, r.event, r.target) for r in engine_table().rows}
    assert seen and set(seen) <= rows
    e.sends(["a"])  # a repeat: refused as data, never the engine's assert
    assert e.core.refusals.counts == {"duplicate_id": 1} and e.freed == ["a"]


def test_a_report_in_the_step_of_the_exposure_frees_nothing() -> None:
    e = FakeEngine()
    e.admit("a", 2)
    e.end("a", remote_read=True)
    e.core.flush()  # granted, but the step's output has not left
    e.sends(["a"])  # a stale notice of an earlier request named "a"
    assert e.freed == [] and e.core.refusals.counts == {"before_exposure": 1}
    assert e.core.holds.state("a") == "withheld"
    e.step_end()
    e.sends(["a"])
    assert e.freed == ["a"]


def test_the_journal_refuses_a_read_over_a_block_a_load_may_still_write() -> None:
    core = GuardCore(StepLedger(16), peer="p", engine="fake")
    core.holds.admit("loader")
    assert core.grant_loads([("loader", [1, 2])]) == set()
    core.holds.admit("b")
    assert core.end("b", [2, 3], aborted=False) == "withheld"  # journaled: no ledger work yet
    with capture_logs() as logs:
        core.end_step()
        core.refusals.drain()
    assert core.take_refused_reads() == ["b"]  # its ids must not leave the process
    assert core.take_refused_reads() == []
    assert core.holds.state("b") == "ended" and core.holds.get("b").read is None  # type: ignore[union-attr]
    assert core.refusals.counts == {"exposed_block_reused": 1}
    refused = [x for x in logs if x["event"] == "guard_refused"]
    assert [(x["kind"], x["request"], x["engine"]) for x in refused] == [
        ("exposed_block_reused", "b", "fake")
    ]
    assert core.ledger.stats().open_grants == 1  # the load's only


def test_a_load_into_a_block_still_read_remotely_is_refused() -> None:
    core = GuardCore(StepLedger(16), peer="p", engine="fake")
    core.holds.admit("p1")
    core.end("p1", [1, 2], aborted=False)
    core.end_step()
    core.holds.admit("d1")
    assert core.grant_loads([("d1", [2, 5])]) == {"d1"}
    assert core.holds.state("d1") == "running" and core.holds.get("d1").write is None  # type: ignore[union-attr]
    assert core.loads_tracked == 0
    assert core.refusals.counts == {"exposed_block_reused": 1}


def test_a_fence_from_another_thread_mid_step_spares_the_steps_own_exposure() -> None:
    e = FakeEngine()
    e.admit("old", 2)
    e.end("old", remote_read=True)
    e.step_end()  # old's ids left in step 0
    assert e.core.reports.lease_expired("old") is None  # only a fence frees it now
    assert e.core.holds.state("old") == "quarantined"
    e.step_begin()
    e.admit("new", 2)
    e.end("new", remote_read=True)  # new's ids leave with this step's output
    t = threading.Thread(target=e.core.fence, args=("agent_recreated",))
    t.start()
    t.join()
    e.step_end()
    e.step_begin()  # the fence takes effect: on step 0's grant only
    assert e.freed == ["old"]
    assert e.core.holds.state("new") == "withheld"
    assert e.core.ledger.stats().reclaimed_blocks == {"agent_recreated": 2}
    e.sends(["new"])
    assert e.freed == ["old", "new"]


def test_fences_racing_steps_never_release_an_exposure_of_their_own_step() -> None:
    e = FakeEngine(num_blocks=4096)
    stop = threading.Event()

    def fencer() -> None:
        n = 0
        while not stop.is_set():
            e.core.fence(f"fence-{n % 3}")
            n += 1

    t = threading.Thread(target=fencer)
    t.start()
    exposed_in: dict[str, int] = {}
    try:
        for i in range(300):
            e.step_begin()  # the engine asserts: nothing freed under an open grant
            for r in e.freed:
                assert exposed_in[r] < e.core.step
            name = f"r{i}"
            e.admit(name, 2)
            e.end(name, remote_read=True)
            exposed_in[name] = e.core.step
            e.core.reports.lease_expired(name)  # unproven: only a fence of a later step frees it
            if i % 10 == 5:
                # Mid-step, the fencer's turn: wait until it has recorded a fence in this step
                # (how often it gets in otherwise is up to the scheduler).
                deadline = time.monotonic() + 5
                while not len(e.core.fences) and time.monotonic() < deadline:
                    time.sleep(0.0001)
                assert len(e.core.fences), "the fencer never got in"
            e.step_end()
    finally:
        stop.set()
        t.join()
    assert e.freed, "no fence recorded mid-step freed what earlier steps exposed"
    e.core.fence("last")  # recorded after every step ended: it covers every exposure
    e.step_begin()
    assert sorted(e.freed) == sorted(exposed_in)


def test_a_proof_queued_before_a_fence_never_reaches_the_grant_that_reuses_its_handle() -> None:
    # a's READ grant is proven (queued, not settled) while a fence is pending; the fence
    # releases a; b's grant, made next, reuses a's grant row. The queued proof is settled
    # before the fence's release, so it is about a's grant, never b's.
    core = GuardCore(StepLedger(16), peer="p", engine="fake")
    core.holds.admit("a")
    core.end("a", [1, 2], aborted=False)
    core.end_step()
    core.fence("f")
    assert core.reports.reads_done("a") is None  # queued
    released = core.begin_step()
    assert released == {"a"} and core.take_released() == {"a"}
    core.holds.admit("b")
    core.end("b", [3, 4], aborted=False)
    core.end_step()
    core.settle()
    assert core.take_released() == set()  # b's reads are not proven
    assert core.holds.state("b") == "withheld"
    assert core.ledger.stats().open_grants == 1


def test_a_request_id_that_is_not_a_str_is_refused_before_anything_changes() -> None:
    core = GuardCore(StepLedger(16), peer="p", engine="fake")
    for bad in (7, None, b"r", ("r",)):
        with pytest.raises(InvalidField):
            core.end(bad, [1], aborted=False)  # type: ignore[arg-type]
        with pytest.raises(InvalidField):
            core.grant_loads([("ok", [2]), (bad, [3])])  # type: ignore[list-item]
    assert len(core.holds) == 0 and core.journaled_count == 0
    assert core.ledger.stats().open_grants == 0
    with pytest.raises(InvalidField):
        GuardCore(StepLedger(16), peer=["x"], engine="fake")  # type: ignore[arg-type]


def test_a_fenced_receive_superseded_by_a_read_goes_back_once() -> None:
    core = GuardCore(StepLedger(16), peer="p", engine="fake")
    core.holds.admit("d")
    core.grant_loads([("d", [4, 5])])
    core.end_step()
    assert core.reports.load_failed("d") is None
    assert core.reports.load_landed("d") is None and core.holds.state("d") == "receive_held"
    core.fence("f")
    core.begin_step()
    assert core.holds.state("d") == "fenced" and core.fenced_due("d")
    assert core.end("d", [6], aborted=False) == "withheld"  # a READ exposure supersedes it
    assert core.take_fenced() == set()
    core.end_step()
    assert core.reports.reads_done("d") is None
    core.settle()
    assert core.take_released() == {"d"}
    assert core.holds.state("d") is None and core.refusals.counts == {}
