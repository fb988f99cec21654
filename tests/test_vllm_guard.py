"""ConnectorGuard, the sans-IO core of the vLLM integration, driven without vLLM: each vLLM
signal becomes exactly the evidence of ``signals.PROFILE``, and an id reaches vLLM only once
the ledger has released its request. (tests/in_vllm/ drives the same guard through vLLM's real
scheduler.)"""

from __future__ import annotations

import threading
from collections.abc import Callable

import pytest
import structlog

from kvlifetime.errors import InvalidField
from kvlifetime.grant import Access
from kvlifetime.integrations.vllm import PROFILE, ConnectorGuard
from kvlifetime.profiles import profile
from kvlifetime.spec.vocabulary import RequestState


def _exposed(g: ConnectorGuard, request: str = "p1", ids: tuple[int, ...] = (1, 2, 3)) -> None:
    g.admitted(request)
    # The inner connector delayed the free: decode will read the blocks ...
    assert g.finished(request, ids, delay=True, aborted=False) is True
    g.end_step()  # ... whose ids leave with the step's output


def _loading(g: ConnectorGuard, request: str = "d1", ids: tuple[int, ...] = (4, 5)) -> None:
    g.admitted(request)
    g.allocated(request, ids, num_external_tokens=32, load_async=True)
    g.end_step()


def _fence(g: ConnectorGuard, fence: str = "nixl_agent_recreated") -> set[str]:
    """``revoke`` records the fence; the next step boundary applies it."""
    g.revoke(fence)
    return g.begin_step()


def test_completed_read_is_handed_back_once() -> None:
    g = ConnectorGuard(16)
    _exposed(g)
    back = g.output({"p1"}, None)
    assert back.finished_sending == {"p1"} and back.finished_recving == set()
    assert g.stats().handed_back == 1 and g.stats().exposed == 0
    # vLLM's pool is its own: nothing is held in the ledger any more.
    assert g.ledger.stats().blocks_by_state["free"] == 16


def test_reaped_lease_is_quarantined_not_handed_back() -> None:
    g = ConnectorGuard(16)
    _exposed(g)
    back = g.output({"p1"}, None, lease_reaped=frozenset({"p1"}))
    assert back.finished_sending == set()
    assert g.ledger.state("p1") is RequestState.QUARANTINED
    st = g.stats()
    assert st.withheld == 1 and st.lease_reaped == 1
    assert st.ledger.blocks_by_state["quarantined"] == 3
    assert g.output(None, None).finished_sending == set()
    # A way out: the deployment fenced the peer.
    assert _fence(g) == {"p1"}
    assert g.output(None, None).finished_sending == {"p1"}
    assert g.ledger.stats().reclaimed_blocks == {"nixl_agent_recreated": 3}


def test_a_membership_after_a_reaped_lease_proves_nothing() -> None:
    # Tensor parallel: rank 0 reaped the lease (reported at once in the worker metadata), rank 1
    # reports the id a step later, when vLLM's aggregator emits it in finished_sending. One
    # grant covers every rank's reads: rank 0's are still unproven.
    g = ConnectorGuard(16)
    _exposed(g)
    assert g.output(None, None, lease_reaped=frozenset({"p1"})).finished_sending == set()
    assert g.output({"p1"}, None).finished_sending == set()
    assert g.ledger.state("p1") is RequestState.QUARANTINED
    assert g.stats().lease_reaped == 1


def test_a_request_nothing_was_exposed_for_keeps_the_inner_answer() -> None:
    g = ConnectorGuard(16)
    g.admitted("x")
    assert g.finished("x", (1, 2), delay=False, aborted=True) is False
    assert g.stats().exposed == 0
    # vLLM freed it: a later id for it is one vLLM no longer holds.
    assert g.output({"x"}, None).finished_sending == set()
    assert g.stats().dropped == {"unknown_id": 1}


def test_ids_of_requests_vllm_holds_without_exposure_pass_unchanged() -> None:
    # An inner connector (or a test) delaying a free the guard saw no blocks for, a synchronous
    # load: vLLM's own business, passed on as it came.
    g = ConnectorGuard(16)
    g.admitted("s")
    g.admitted("r")
    assert g.finished("s", (), delay=True, aborted=False) is True
    back = g.output({"s"}, {"r"})
    assert back.finished_sending == {"s"} and back.finished_recving == {"r"}
    assert g.output({"s"}, {"r"}).finished_sending == set()  # vLLM freed s; r already passed
    assert g.stats().dropped == {"unknown_id": 1, "duplicate_id": 1}


def test_load_landed_then_request_finishes_normally() -> None:
    g = ConnectorGuard(16)
    _loading(g)
    assert g.output(None, {"d1"}).finished_recving == {"d1"}
    assert g.finished("d1", (4, 5, 6), delay=False, aborted=False) is False
    assert g.stats().exposed == 0


def test_abort_while_loading_waits_for_the_load() -> None:
    g = ConnectorGuard(16)
    _loading(g)
    assert g.finished("d1", (4, 5), delay=False, aborted=True) is True
    back = g.output(None, {"d1"})
    # Ended: vLLM frees on the id in finished_sending (it frees ended requests on either set).
    assert back.finished_sending == {"d1"} and back.finished_recving == set()


def test_failed_load_of_an_aborted_request_is_withheld() -> None:
    g = ConnectorGuard(16)
    _loading(g)
    assert g.finished("d1", (4, 5), delay=False, aborted=True) is True
    back = g.output(None, {"d1"}, failed_recving={"d1"})
    assert back.finished_sending == set() and back.finished_recving == set()
    assert g.ledger.state("d1") is RequestState.QUARANTINED
    assert g.stats().load_failed == 1


def test_failed_load_by_invalid_blocks_delays_the_end() -> None:
    g = ConnectorGuard(16)
    _loading(g)
    # A live request (kv_load_failure_policy="recompute"): on this receive vLLM would free the
    # blocks or recompute into them. Held: the failed transfer proves nothing about what lands.
    assert g.output(None, {"d1"}, invalid_block_ids={5}).finished_recving == set()
    assert g.stats().failed_loads_held == 1
    # Aborted while held: vLLM itself waits for the receive; the guard delays and quarantines.
    assert g.finished("d1", (4, 5), delay=False, aborted=True) is True
    assert g.ledger.state("d1") is RequestState.QUARANTINED
    assert g.stats().failed_loads_held == 0 and g.stats().withheld == 1
    assert _fence(g) == {"d1"}
    back = g.output(None, None)
    assert back.finished_sending == {"d1"} and back.finished_recving == set()


def test_a_live_failed_load_is_held_until_a_fence_then_received_once() -> None:
    # Issue 20 item 4: kv_load_failure_policy="recompute" freed the failed load's blocks (vLLM
    # frees them in _update_waiting_for_remote_kv once it sees the receive) while the write was
    # unproven, and the guard then delayed the request's new, never-exposed blocks at its end.
    g = ConnectorGuard(16)
    _loading(g, "d1", (4, 5))
    with structlog.testing.capture_logs() as logs:
        back = g.output(None, {"d1"}, failed_recving={"d1"})
    assert back.finished_recving == set() and back.finished_sending == set()
    assert [e["request"] for e in logs if e["event"] == "guard_receive_held"] == ["d1"]
    st = g.stats()
    assert st.load_failed == 1 and st.failed_loads_held == 1 and st.withheld == 0
    assert g.ledger.stats().blocks_by_state["free"] == 14  # blocks 4, 5 still guarded
    # The worker reports the receive again (a sibling handle ending later): a duplicate.
    assert g.output(None, {"d1"}).finished_recving == set()
    assert g.stats().dropped == {"duplicate_id": 1}
    # The fence: the receive goes to vLLM once (at the next scheduler step or output).
    assert _fence(g) == {"d1"}
    assert g.stats().failed_loads_held == 0 and g.stats().exposed == 0
    assert g.output(None, None).finished_recving == {"d1"}
    assert g.take_fenced_loads() == set()
    assert g.ledger.stats().blocks_by_state["free"] == 16
    # vLLM recomputes into new blocks, never exposed: at the end nothing is delayed.
    assert g.finished("d1", (7, 8, 9), delay=False, aborted=False) is False
    assert g.stats().withheld == 0 and g.ledger.stats().blocks_by_state["quarantined"] == 0
    # A late receive for the request is a duplicate, never vLLM's assert.
    assert g.output(None, {"d1"}).finished_recving == set()


def test_an_in_process_failed_load_ends_with_its_receive() -> None:
    # Issue 33: an inner connector whose failed load is reported once its own job is over
    # (inner_connectors: vLLM 0.34's offloading connector) proves the load ended: the receive
    # in the same output goes to vLLM at once, the WRITE grant closed, nothing held.
    g = ConnectorGuard(16, failed_load_is_over=True)
    _loading(g, "d1", (4, 5))
    with structlog.testing.capture_logs() as logs:
        back = g.output(None, {"d1"}, failed_recving={"d1"}, invalid_block_ids={4})
    assert back.finished_recving == {"d1"}
    assert not [e for e in logs if e["event"] == "guard_receive_held"]
    st = g.stats()
    assert st.load_failed == 0 and st.failed_loads_held == 0 and st.exposed == 0
    assert g.ledger.stats().blocks_by_state["free"] == 16
    # A failure with no receive yet proves nothing by itself: the load stays open until it.
    _loading(g, "d2", (6,))
    assert g.output(None, None, failed_recving={"d2"}).finished_recving == set()
    assert g.stats().exposed == 1
    assert g.output(None, {"d2"}).finished_recving == {"d2"}
    # The same reports from a connector whose peers reach the memory: held until a fence.
    h = ConnectorGuard(16)
    _loading(h, "d1", (4, 5))
    assert h.output(None, {"d1"}, failed_recving={"d1"}).finished_recving == set()
    assert h.stats().failed_loads_held == 1


@pytest.mark.parametrize("value", ["false", 1, None, 0.0])
def test_the_failure_profile_flag_must_be_a_bool(value: object) -> None:
    with pytest.raises(InvalidField, match="failed_load_is_over"):
        ConnectorGuard(16, failed_load_is_over=value)  # type: ignore[arg-type]


@pytest.mark.parametrize("over", [False, True])
@pytest.mark.parametrize("failed", [5, "d1", [["d1"]], [b"d1"], [object()]])
def test_a_malformed_failure_report_is_refused_whatever_it_would_prove(
    over: bool, failed: object
) -> None:
    g = ConnectorGuard(16, failed_load_is_over=over)
    _loading(g, "d1", (4, 5))
    with structlog.testing.capture_logs() as logs:
        back = g.output(None, None, failed_recving=failed)  # type: ignore[arg-type]
    assert back.finished_recving == set() and back.finished_sending == set()
    assert g.stats().dropped.get("malformed_value") == 1
    assert [e["kind"] for e in logs if e["event"] == "guard_refused"] == ["malformed_value"]
    st = g.stats()
    assert st.load_failed == 0 and st.exposed == 1  # nothing else changed
    # Bad block ids in invalid_block_ids are refused with the flag on too.
    g.output(None, None, invalid_block_ids=["x"])  # type: ignore[list-item]
    assert g.stats().dropped.get("malformed_value") == 2


def test_duplicate_and_unknown_ids_are_dropped_and_logged() -> None:
    g = ConnectorGuard(16)
    _exposed(g)
    g.output({"p1"}, None)
    with structlog.testing.capture_logs() as logs:
        back = g.output({"p1", "ghost"}, {"ghost2"})
    assert back.finished_sending == set() and back.finished_recving == set()
    assert g.stats().dropped == {"duplicate_id": 1, "unknown_id": 2}
    kinds = sorted(e["kind"] for e in logs if e["event"] == "guard_refused")
    assert kinds == ["duplicate_id", "unknown_id", "unknown_id"]


def test_second_finished_recving_of_a_live_request_is_a_duplicate() -> None:
    g = ConnectorGuard(16)
    _loading(g)
    assert g.output(None, {"d1"}).finished_recving == {"d1"}
    assert g.output(None, {"d1"}).finished_recving == set()
    assert g.stats().dropped == {"duplicate_id": 1}


def test_prefix_shared_blocks_read_by_two_requests() -> None:
    g = ConnectorGuard(16)
    _exposed(g, "p1", (1, 2, 3))
    _exposed(g, "p2", (1, 2, 7))  # a prefix-cache hit on 1, 2: READ grants only, allowed
    assert g.stats().dropped == {}
    assert g.output({"p2"}, None).finished_sending == {"p2"}
    assert g.output({"p1"}, None).finished_sending == {"p1"}


def test_async_load_into_a_block_still_read_remotely_is_refused_and_logged() -> None:
    g = ConnectorGuard(16)
    _exposed(g, "p1", (1, 2, 3))
    with structlog.testing.capture_logs() as logs:
        _loading(g, "d1", (3, 4))  # vLLM handing out block 3 while decode still reads it
    assert g.stats().dropped == {"exposed_block_reused": 1}
    assert [e["kind"] for e in logs if e["event"] == "guard_refused"] == ["exposed_block_reused"]
    assert g.stats().exposed == 1  # nothing recorded for d1


def test_the_profile_is_the_one_the_cli_prints() -> None:
    assert profile("vllm") is PROFILE
    reaped = next(r for r in PROFILE.rows if "lease reaper" in r.status)
    assert reaped.evidence == "LeaseExpired"


def test_a_block_handed_out_under_an_open_write_grant_is_reported() -> None:
    g = ConnectorGuard(16)
    _loading(g, "d1", (4, 5))
    g.handed_out([1, 2, 3])  # fresh blocks: fine
    _exposed(g, "p1", (7, 8))
    g.handed_out([7])  # under a read grant only: a prefix-cache hit may share it
    assert g.stats().dropped == {}
    with structlog.testing.capture_logs() as logs:
        g.handed_out([9, 5])  # block 5: the load into it may still land
    assert g.stats().dropped == {"exposed_block_reused": 1}
    assert [e["error"] for e in logs if e["event"] == "guard_refused"] == [
        "block 5 handed out under an open WRITE grant"
    ]


def test_a_preempted_request_loads_again_and_is_passed_again() -> None:
    g = ConnectorGuard(16)
    _loading(g, "d1", (4, 5))
    assert g.output(None, {"d1"}).finished_recving == {"d1"}
    # The landed load's record ended: vLLM may free and reuse its blocks (a preemption).
    assert g.stats().exposed == 0 and g.ledger.stats().blocks_by_state["free"] == 16
    g.allocated("d1", (4, 9), num_external_tokens=16, load_async=True)  # reloaded
    assert g.output(None, {"d1"}).finished_recving == {"d1"}
    assert g.output(None, {"d1"}).finished_recving == set()  # a repeat: dropped
    assert g.stats().dropped == {"duplicate_id": 1}


def test_a_receive_never_frees_a_quarantined_read_exposure() -> None:
    # Issue 20 item 1: a prefill whose lease was reaped must not be freed by a stray
    # finished_recving (NIXL reports any request it tracks; MultiConnector both channels).
    g = ConnectorGuard(16)
    _exposed(g)
    g.output(None, None, lease_reaped=frozenset({"p1"}))
    back = g.output(None, {"p1"})
    assert back.finished_recving == set() and back.finished_sending == set()
    assert g.ledger.state("p1") is RequestState.QUARANTINED
    assert g.stats().dropped == {"wrong_channel": 1}
    # The fence frees it, once.
    assert _fence(g, "fence") == {"p1"}
    assert g.output(None, None).finished_sending == {"p1"}
    assert g.output(None, {"p1"}).finished_recving == set()


def test_a_send_never_frees_a_load_in_flight_and_the_proof_hands_back_once() -> None:
    g = ConnectorGuard(16)
    _loading(g)
    back = g.output({"d1"}, None)
    assert back.finished_sending == set() and back.finished_recving == set()
    assert g.stats().dropped == {"wrong_channel": 1}
    assert g.stats().exposed == 1
    # The real proof: the load landed; the id comes back once, on its own channel.
    back = g.output(None, {"d1"})
    assert back.finished_recving == {"d1"} and back.finished_sending == set()


def test_a_receive_for_a_read_exposure_proves_nothing_about_the_reads() -> None:
    g = ConnectorGuard(16)
    _exposed(g)
    assert g.output(None, {"p1"}).finished_recving == set()
    assert g.stats().exposed == 1 and g.stats().withheld == 1
    # The reads' own proof hands it back once.
    assert g.output({"p1"}, None).finished_sending == {"p1"}
    assert g.output({"p1"}, {"p1"}) == type(g.output(None, None))(set(), set())
    assert g.stats().handed_back == 1


def test_ids_of_requests_vllm_has_not_finished_never_reach_its_free_path() -> None:
    # Issue 20 item 2: vLLM frees blocks on an id only for a finished request (it asserts
    # is_finished()); a receive for a request waiting for remote KVs is how a load completes.
    where = {"run": "running", "load": "waiting_for_remote_kvs", "done": "finished"}
    g = ConnectorGuard(16, holds=where.__contains__)
    g.phase = where.get  # as the connector binds it from vLLM's request table
    back = g.output({"run", "load", "done"}, {"run", "load"})
    assert back.finished_sending == {"done"}
    assert back.finished_recving == {"load"}
    assert g.stats().dropped == {"not_finished": 3}


def test_a_handed_back_id_repeated_on_either_channel_is_a_duplicate() -> None:
    # Item 12: the duplicate drop pinned more than once. vLLM freed p1 on the first hand-back;
    # a repeat on either channel (MultiConnector, a second rank) must never reach its assert.
    g = ConnectorGuard(16)
    _exposed(g)
    assert g.output({"p1"}, None).finished_sending == {"p1"}
    with structlog.testing.capture_logs() as logs:
        back = g.output({"p1"}, {"p1"})
    assert back.finished_sending == set() and back.finished_recving == set()
    assert g.stats().dropped == {"duplicate_id": 2} and g.stats().handed_back == 1
    assert [e["error"] for e in logs if e["event"] == "guard_refused"] == [
        "request 'p1' was already handed back to the engine"
    ] * 2


def test_a_fenced_id_is_handed_back_once_then_a_duplicate() -> None:
    table = {"p1"}
    g = ConnectorGuard(16, holds=table.__contains__)
    _exposed(g)
    g.output(None, None, lease_reaped=frozenset({"p1"}))
    _fence(g, "fence")
    assert g.output(None, None).finished_sending == {"p1"}
    table.discard("p1")  # vLLM freed it
    assert g.output({"p1"}, None).finished_sending == set()
    assert g.output({"p1"}, None).finished_sending == set()
    assert g.stats().dropped == {"duplicate_id": 2} and g.stats().handed_back == 1


def test_a_landed_load_reported_again_while_vllm_runs_the_request_is_a_duplicate() -> None:
    # vLLM still holds d1 (running after its load): only the guard's record of the passed
    # receive tells the repeat from a new load, and vLLM would assert on it (not finished).
    table = {"d1"}
    g = ConnectorGuard(16, holds=table.__contains__)
    _loading(g)
    assert g.output(None, {"d1"}).finished_recving == {"d1"}
    assert g.output(None, {"d1"}).finished_recving == set()
    assert g.output({"x"}, {"d1"}).finished_recving == set()
    assert g.stats().dropped == {"duplicate_id": 2, "unknown_id": 1}


def test_one_hold_per_request_walks_the_engine_table_then_is_forgotten() -> None:
    g = ConnectorGuard(16)
    seen: list[tuple[str, str, str]] = []
    g.core.holds.observers.append(lambda r, a, e, b: seen.append((a, e, b)))
    g.admitted("p1")
    view = g.request("p1")
    assert view is not None and (view.state, view.read) == ("running", None)
    assert g.finished("p1", (1, 2), delay=True, aborted=False) is True
    view = g.request("p1")  # the READ exposure is in the step's journal
    assert view is not None and view.state == "ended" and view.read is None
    assert g.stats().exposed == 1 and g.ledger.stats().open_grants == 0
    g.end_step()  # the step's end: the journal into the ledger
    view = g.request("p1")
    assert view is not None and view.state == "withheld" and view.read is not None
    assert view.read.access is Access.READ and sorted(view.read.blocks.tolist()) == [1, 2]
    g.output(None, None, lease_reaped=frozenset({"p1"}))
    view = g.request("p1")
    assert view is not None and view.lease_reaped and view.state == "quarantined"
    _fence(g, "fence")
    view = g.request("p1")
    assert view is not None and (view.state, view.read) == ("releasable", None)
    assert g.take_released() == {"p1"}
    assert g.request("p1") is None and list(g.requests()) == []
    # exactly the table's rows, in order (tests/test_engine_side.py pins the table itself)
    assert seen == [
        ("running", "finished", "ended"),
        ("ended", "read_granted", "withheld"),
        ("withheld", "lease_expired", "quarantined"),
        ("quarantined", "released", "releasable"),
        ("releasable", "handed_back", "handed_back"),
    ]


def test_a_load_hold_walks_loading_failed_held_fenced_received() -> None:
    g = ConnectorGuard(16)
    _loading(g, "d1", (4, 5))

    def state() -> str:
        view = g.request("d1")
        assert view is not None
        return view.state

    assert state() == "loading"
    g.output(None, None, failed_recving={"d1"})
    assert state() == "load_failed"
    g.output(None, {"d1"})
    assert state() == "receive_held"
    _fence(g, "fence")
    assert state() == "fenced"
    assert g.take_fenced_loads() == {"d1"}
    assert state() == "load_received"
    assert g.finished("d1", (4, 5), delay=False, aborted=False) is False
    assert g.request("d1") is None  # vLLM frees it now: the hold is gone


def test_a_receive_for_a_released_id_not_yet_handed_back_is_not_passed_twice() -> None:
    # Between a fence and the next step the ended request is READY: a stray receive for it
    # would be a second free of the same id in one output (vLLM asserts the id is held).
    g = ConnectorGuard(16)
    _exposed(g)
    g.output(None, None, lease_reaped=frozenset({"p1"}))
    _fence(g, "fence")
    back = g.output(None, {"p1"})
    assert back.finished_sending == {"p1"} and back.finished_recving == set()
    assert g.stats().dropped == {"wrong_channel": 1}


# ---------------------------------------------------------------- the step: evidence and exposure


def test_a_send_in_the_step_of_its_exposure_proves_nothing() -> None:
    # The READ grant's block ids leave with this step's output: a finished_sending for the id in
    # the same step is a stale notice about an earlier request with the same id (vLLM #49796).
    g = ConnectorGuard(16)
    g.admitted("p1")
    assert g.finished("p1", (1, 2, 3), delay=True, aborted=False) is True
    with structlog.testing.capture_logs() as logs:
        back = g.output({"p1"}, None)
    assert back.finished_sending == set() and back.finished_recving == set()
    st = g.stats()
    assert st.dropped == {"before_exposure": 1} and st.withheld == 1 and st.handed_back == 0
    (event,) = [e for e in logs if e["event"] == "guard_refused"]
    assert event["kind"] == "before_exposure" and "earlier request" in event["error"]
    assert g.ledger.stats().open_grants == 1
    g.end_step()  # the output leaves: a later step's send is the reader's
    assert g.output({"p1"}, None).finished_sending == {"p1"}
    assert g.stats().handed_back == 1


def test_a_loading_request_exposed_at_its_end_is_stamped_with_its_step_too() -> None:
    # A request ending while its load is in flight gets its READ grant at once (not through
    # the journal): the same rule holds for it.
    g = ConnectorGuard(16)
    _loading(g, "d1", (4, 5))
    assert g.finished("d1", (4, 5, 6), delay=True, aborted=False) is True
    back = g.output({"d1"}, {"d1"})  # the load landed; the send is stale
    assert back.finished_sending == set() and back.finished_recving == set()
    assert g.stats().dropped == {"before_exposure": 1}
    g.end_step()
    assert g.output({"d1"}, None).finished_sending == {"d1"}


def test_a_reaped_lease_in_the_step_of_its_exposure_withholds_until_a_fence() -> None:
    # Stale too (an earlier request's), but a reaped lease frees nothing: it is taken, and
    # the request waits for a fence; no later send frees it.
    g = ConnectorGuard(16)
    g.admitted("p1")
    g.finished("p1", (1, 2), delay=True, aborted=False)
    back = g.output({"p1"}, None, lease_reaped=frozenset({"p1"}))
    assert back.finished_sending == set()
    st = g.stats()
    assert st.lease_reaped == 1 and [q.request for q in st.ledger.quarantined] == ["p1"]
    g.end_step()
    assert g.output({"p1"}, None).finished_sending == set()
    assert _fence(g) == {"p1"}


# ---------------------------------------------------------------- one channel per id


def test_an_id_passed_through_on_both_channels_goes_back_once() -> None:
    table = {"s"}  # vLLM's request table, as the connector binds it: s until vLLM frees it
    g = ConnectorGuard(16, holds=table.__contains__)
    g.admitted("s")
    assert g.finished("s", (), delay=True, aborted=False) is True  # nothing the guard saw
    with structlog.testing.capture_logs() as logs:
        back = g.output({"s"}, {"s"})
    assert back.finished_recving == {"s"} and back.finished_sending == set()
    assert g.stats().dropped == {"both_channels": 1}
    assert [e["kind"] for e in logs if e["event"] == "guard_refused"] == ["both_channels"]
    table.discard("s")  # vLLM freed it on the receive
    back = g.output({"s"}, {"s"})  # a later output: an id vLLM no longer holds
    assert back.finished_recving == set() and back.finished_sending == set()


def test_a_refused_read_on_both_channels_goes_back_once() -> None:
    table = {"ghost", "p1"}
    g = ConnectorGuard(16, holds=table.__contains__)
    _loading(g, "ghost", (1, 2, 3))  # a load in flight into the blocks
    g.admitted("p1")
    assert g.finished("p1", (1, 2, 3), delay=True, aborted=False) is True
    g.end_step()  # the journal refuses p1's READ grant: nothing exposed, vLLM keeps the blocks
    assert g.take_refused_reads() == ["p1"]
    back = g.output({"p1"}, {"p1"})
    assert back.finished_recving == {"p1"} and back.finished_sending == set()
    assert g.stats().dropped == {"exposed_block_reused": 1, "both_channels": 1}


def test_a_fenced_receive_superseded_by_a_read_exposure_goes_back_once_on_the_send() -> None:
    # A held failed load is fenced (its receive due to vLLM), then the request ends with a READ
    # exposure before the receive was taken: handing the receive to vLLM would free blocks a
    # reader is about to get, and the READ's proof would hand the id back a second time.
    g = ConnectorGuard(16)
    _loading(g, "d1", (4, 5))
    g.output(None, {"d1"}, failed_recving={"d1"})
    assert _fence(g) == {"d1"}
    assert g.finished("d1", (4, 5, 6), delay=True, aborted=True) is True
    back = g.output(None, None)
    assert back.finished_recving == set() and back.finished_sending == set()
    assert g.take_fenced_loads() == set()
    g.end_step()
    back = g.output({"d1"}, None)
    assert back.finished_sending == {"d1"} and back.finished_recving == set()
    assert g.output(None, {"d1"}).finished_recving == set()  # vLLM freed it


# ---------------------------------------------------------------- fences and threads


def test_revoke_only_records_and_the_next_step_boundary_applies_it() -> None:
    g = ConnectorGuard(16)
    _exposed(g)
    g.output(None, None, lease_reaped=frozenset({"p1"}))
    g.revoke("fence")
    assert g.ledger.state("p1") is RequestState.QUARANTINED  # nothing changed yet
    assert g.output(None, None).finished_sending == set()
    assert g.begin_step() == {"p1"}
    assert g.begin_step() == set()  # applied once
    assert g.output(None, None).finished_sending == {"p1"}


def test_revoke_refuses_a_bad_fence_name() -> None:
    g = ConnectorGuard(16)
    for bad in ("", None, 3, "x" * 129):
        with pytest.raises(InvalidField):
            g.revoke(bad)  # type: ignore[arg-type]
    assert g.begin_step() == set()


def _step_with_a_fence_mid_step(g: ConnectorGuard, revoke: Callable[[], None]) -> None:
    """p0 was exposed in an ended step; in the step in progress p1 ends (its ids leave with
    this step's output) and the fence is recorded before the output leaves."""
    _exposed(g, "p0", (1, 2))
    g.output(None, None, lease_reaped=frozenset({"p0"}))  # only a fence frees p0
    g.end_step()
    assert g.begin_step() == set()
    g.admitted("p1")
    assert g.finished("p1", (3, 4), delay=True, aborted=False) is True
    revoke()
    assert g.output(None, None).finished_sending == set()
    g.end_step()


def _assert_the_fence_spared_p1(g: ConnectorGuard) -> None:
    assert g.begin_step() == {"p0"}
    assert g.output(None, None).finished_sending == {"p0"}
    view = g.request("p1")
    assert view is not None and view.read is not None and view.state == "withheld"
    assert g.output({"p1"}, None).finished_sending == {"p1"}


def test_a_fence_recorded_mid_step_spares_the_steps_own_exposure() -> None:
    g = ConnectorGuard(16)
    _step_with_a_fence_mid_step(g, lambda: g.revoke("fence"))
    _assert_the_fence_spared_p1(g)


def test_a_fence_from_another_thread_mid_step_spares_the_steps_own_exposure() -> None:
    g = ConnectorGuard(16)

    def from_a_thread() -> None:
        t = threading.Thread(target=g.revoke, args=("fence",))
        t.start()
        t.join()

    _step_with_a_fence_mid_step(g, from_a_thread)
    _assert_the_fence_spared_p1(g)


def test_fences_racing_steps_never_release_an_exposure_of_their_own_step() -> None:
    # A thread fences without pause while the scheduler thread runs steps in which one request
    # ends (its ids leave with the step's output) and the previous one's reader reports. The
    # property, whenever a fence lands: nothing a step exposes is handed back in that step,
    # and a boundary releases only requests exposed in a step that had ended.
    g = ConnectorGuard(64)
    stop = threading.Event()
    started = threading.Event()

    def fencing() -> None:
        while not stop.is_set():
            g.revoke("fence")
            started.set()

    t = threading.Thread(target=fencing)
    t.start()
    exposed_in: dict[str, int] = {}
    try:
        started.wait()
        for i in range(300):
            released = g.begin_step()
            assert all(exposed_in[r] < g.step for r in released), released
            request = f"r{i}"
            g.admitted(request)
            g.finished(request, (1 + i % 60,), delay=True, aborted=False)
            exposed_in[request] = g.step
            back = g.output({f"r{i - 1}"} if i else set(), None)
            assert request not in back.finished_sending
            g.end_step()
    finally:
        stop.set()
        t.join()
    g.begin_step()
    g.output({"r299"}, None)
    assert g.stats().exposed == 0 and g.ledger.stats().open_grants == 0


@pytest.mark.parametrize("bad", [[1.5], ["3"], [None], 7, [2**70], [-1]])
def test_a_malformed_report_of_block_ids_is_a_refusal_not_an_exception(bad: object) -> None:
    g = ConnectorGuard(16)
    g.admitted("d1")
    assert g.allocated_many([("d1", [2, 3])]) == set()
    g.handed_out(bad)  # type: ignore[arg-type]
    assert g.stats().dropped == {"handed_out_refused": 1}
    back = g.output(None, None, invalid_block_ids=bad)  # type: ignore[arg-type]
    assert back.finished_recving == set() and back.finished_sending == set()
    assert g.stats().dropped == {"handed_out_refused": 1, "malformed_value": 1}
    assert g.request("d1").state == "loading"  # type: ignore[union-attr]


def test_a_block_handed_to_two_requests_in_one_step_is_checked_once() -> None:
    g = ConnectorGuard(16)
    g.admitted("d1")
    g.allocated_many([("d1", [2, 3])])
    g.handed_out([5, 5, 6])  # a shared prefix block: not a refusal
    g.handed_out([3, 3])  # under d1's open WRITE grant: one reuse counted
    assert g.stats().dropped == {"exposed_block_reused": 1}
