"""What each of vLLM's KV-connector signals proves, as data (``PROFILE``).

vLLM's connector API reports transfers as *sets of request ids* (``finished_sending``,
``finished_recving``, ``failed_recving``) and a set of block ids (``invalid_block_ids``), once
per engine step, with no sequence numbers: a membership says one thing about one request, at
the step it arrives in. The guard (``guard.py``) turns each into exactly the evidence below and
nothing more. ``kvlifetime evidence --engine vllm`` prints the table; docs/engine-vllm.md is
generated from it; each row names the test that pins it. Where vLLM decides a block may be
reused, and how its tests run here: docs/engine-facts.md#vllm-033-on-a-cpu-only-machine.

No vLLM import: the table loads where vLLM is not installed.
"""

from __future__ import annotations

from kvlifetime.evidence import Claim
from kvlifetime.profiles import NOTHING, EngineProfile, StatusRow

_GUARD = "tests/test_vllm_guard.py"

PROFILE = EngineProfile(
    name="vllm",
    package="vllm (its v1 KV-connector API; the inner connector's own profile still applies)",
    version="0.33.0 and 0.34.0",
    transport="whatever the inner connector uses (NIXL, Mooncake, LMCache, ...)",
    source="read in vLLM 0.33.0 and 0.34.0: vllm/v1/core/sched/scheduler.py "
    "(_update_from_kv_xfer_finished, _free_request, _handle_failed_recving, "
    "_handle_invalid_blocks, _update_waiting_for_remote_kv, _preempt_request), "
    "distributed/kv_transfer/kv_connector/v1/base.py, nixl/base_worker.py "
    "(_reap_expired_send_leases), 0.34's offloading/worker.py (get_finished); driven through "
    "vLLM's real scheduler in tests/in_vllm/test_vllm_scenarios.py and "
    "test_vllm_inner_connectors.py",
    rows=(
        StatusRow(
            "request id in `finished_sending` (not reaped)",
            "TransferCompleted",
            {Claim.TRANSFERS_ENDED},
            "that a lease was honoured: NIXL's lease reaper reports expired leases in this same "
            "set, which only the worker side can tell apart (next row)",
            "code and measured",
            f"{_GUARD}::test_completed_read_is_handed_back_once",
            proves="the remote readers of the request's blocks said they are done (NIXL: every "
            "expected consumer notification arrived at the worker); the guard then hands the "
            "id to vLLM, which frees the blocks by its own counts",
        ),
        StatusRow(
            "request id the worker's lease reaper added to `finished_sending` "
            "(`GuardWorkerMeta.lease_reaped`)",
            "LeaseExpired",
            {Claim.DEADLINE_PASSED},
            "that the remote reader stopped: its READ may still be in flight. The id is "
            "withheld from vLLM, which keeps the blocks (quarantined) until a fence "
            "(`guard.revoke`) proves the access over",
            "code and measured",
            f"{_GUARD}::test_reaped_lease_is_quarantined_not_handed_back",
            proves="only that the send lease's time ran out",
        ),
        StatusRow(
            "request id in `finished_recving` (no failure reported for it)",
            "TransferCompleted",
            {Claim.TRANSFERS_ENDED},
            "anything when the same request's load also failed (next row)",
            "code and measured",
            f"{_GUARD}::test_load_landed_then_request_finishes_normally",
            proves="the request's asynchronous KV load into its blocks has landed (NIXL: its "
            "READs of the remote blocks ended DONE)",
        ),
        StatusRow(
            "request id in `failed_recving`, or block ids in `invalid_block_ids` covered by "
            "the request's WRITE grant",
            "LeaseExpired",
            {Claim.DEADLINE_PASSED},
            "that nothing lands any more: a failed or timed-out transfer proves nothing about "
            "what was already handed to the transport. A request that ended (aborted, or failed "
            'by kv_load_failure_policy="fail"): the guard delays the free and the blocks are '
            'quarantined. A request that lives on ("recompute"): its `finished_recving`, on '
            "which vLLM would free the blocks or recompute into them, is withheld (counted as "
            "failed_loads_held); the request keeps its blocks, waiting for remote KVs, until a "
            "fence, then vLLM gets the receive and recovers; its later blocks were never exposed. "
            "(Not for an inner connector whose failure is reported once its own job is over: "
            "next row)",
            "code and measured",
            f"{_GUARD}::test_a_live_failed_load_is_held_until_a_fence_then_received_once",
            proves="only that the load will not complete normally (the local side stopped "
            "waiting); counted as load_failed",
        ),
        StatusRow(
            "request id in `failed_recving` and `finished_recving` of an inner connector whose "
            "failed load is reported only once its own in-process job is over "
            "(`inner_connectors.PROFILES`: vLLM 0.34's OffloadingConnector with its built-in "
            "CPU backend; no other class or backend, nothing on 0.33, "
            "and never one whose kv_cache_access flags say a peer reaches the KV cache)",
            "TransferCompleted",
            {Claim.TRANSFERS_ENDED},
            "that the KV loaded is valid (it is not: vLLM recomputes it or fails the request, "
            "as its kv_load_failure_policy says); a failure with no receive yet proves nothing "
            "until the receive comes",
            "code and measured",
            f"{_GUARD}::test_an_in_process_failed_load_ends_with_its_receive",
            proves="the local job that wrote into the request's blocks has ended (0.34's "
            "offloading worker reports a failed job's request in both sets once the job's "
            "result came back): the receive goes to vLLM at once, nothing is held",
        ),
        StatusRow(
            "a request id already handed back, again in `finished_sending` / `finished_recving`",
            NOTHING,
            frozenset(),
            "anything about the request, which vLLM has already freed: dropped (vLLM's "
            "scheduler asserts on it), DoubleRelease logged and counted",
            "code and measured",
            f"{_GUARD}::test_duplicate_and_unknown_ids_are_dropped_and_logged",
            proves="nothing (a repeated or re-delivered report)",
        ),
        StatusRow(
            "a request id the guard holds an exposure of the other kind for: `finished_recving` "
            "for a READ exposure (or a withheld request), `finished_sending` for a WRITE one",
            NOTHING,
            frozenset(),
            "anything about the other exposure (NIXL reports any request it tracks; "
            "MultiConnector one id on both channels): dropped, counted as wrong_channel; the id "
            "reaches vLLM once, when the ledger releases the request",
            "code and measured",
            f"{_GUARD}::test_a_receive_never_frees_a_quarantined_read_exposure",
            proves="nothing",
        ),
        StatusRow(
            "a request id vLLM holds but has not finished, in `finished_sending`, or in "
            "`finished_recving` while not waiting for remote KVs",
            NOTHING,
            frozenset(),
            "anything: an early notification or a stale one for a reused request id; vLLM would "
            "assert is_finished() in `_free_blocks`: dropped, counted as not_finished",
            "code and measured",
            f"{_GUARD}::test_ids_of_requests_vllm_has_not_finished_never_reach_its_free_path",
            proves="nothing",
        ),
        StatusRow(
            "a request id the guard never saw exposed, in any `finished_*` set",
            NOTHING,
            frozenset(),
            "anything: dropped (vLLM's scheduler asserts on it), UnknownRequest logged and counted",
            "code and measured",
            f"{_GUARD}::test_duplicate_and_unknown_ids_are_dropped_and_logged",
            proves="nothing",
        ),
    ),
    fence=None,
    fence_note="vLLM has no fence of its own: the deployment fences its transfer engine (NIXL: "
    "the agent recreated, see docs/engine-nixl-ucx.md) and then calls "
    "`connector.guard.revoke(fence)`, which applies AccessRevoked from the local side; what "
    "it released reaches vLLM's free path at the next scheduler step, whatever the model runner "
    "returns (`build_connector_meta`)",
    peer_word="transfers_ended from `finished_sending` rests on the remote reader's "
    "notification (the peer's word about its own reads); from `finished_recving` on the local "
    "worker's own transfer status (NIXL: DONE of its READs)",
    notes=(
        "vLLM's signals are sets of request ids with no sequence numbers: a membership "
        "proves one thing about one request, and a repeat proves nothing.",
        "The scheduler handles `failed_recving` and `invalid_block_ids` before it calls the "
        "connector's `update_connector_output`: the guard cannot change vLLM's reaction to a "
        "failure (recompute or fail), only when it acts on it: vLLM frees or recomputes a "
        "failed load's blocks only once the request id comes in `finished_recving` "
        "(`_update_waiting_for_remote_kv`), which the guard withholds until a fence.",
        "A preemption frees a running request's blocks without asking the connector (no "
        "`request_finished`, no delay to grant; the connector learns of it from "
        "`preempted_req_ids` after the step's blocks were handed out): an asynchronous save "
        "still reading them is the worker connector's to fence (`handle_preemptions`), not the "
        "guard's (tests/in_vllm/test_vllm_preempted_save.py).",
    ),
)
