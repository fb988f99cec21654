"""What each of SGLang 0.5.23's disaggregation signals proves, as data (``PROFILE``).

SGLang reports per room (``bootstrap_room``) and, on the decode, per prefill rank, with an
ABORT generation that SGLang's decode manager counts up each time it arms a held room; no
sequence numbers reach the scheduler. The guard (``guard.py``) turns each signal into exactly
the evidence below and nothing more. ``kvlifetime evidence --engine sglang`` prints the table;
docs/engine-sglang.md is generated from it; each row names the test that pins it. How to turn the
guard on, and what it cannot see: docs/sglang.md.

No SGLang import: the table loads where SGLang is not installed.
"""

from __future__ import annotations

from kvlifetime.evidence import Claim
from kvlifetime.integrations.sglang.facts_v0_5_23 import VERSION
from kvlifetime.profiles import NOTHING, EngineProfile, StatusRow

SUPPORTED_VERSION = VERSION
"""The SGLang version the hooks were built and tested for; ``install`` refuses any other."""

_GUARD = "tests/test_sglang_guard.py"
_FENCE = "tests/in_sglang/test_sglang_fence.py"
FENCE = "mooncake_decode_engine_recreated"
"""The fence established for SGLang's decode on Mooncake TCP (``revoke(FENCE)`` after it)."""

PROFILE = EngineProfile(
    name="sglang",
    package="sglang (its PD disaggregation: decode/prefill queues, the Mooncake backend)",
    version=SUPPORTED_VERSION,
    transport="SGLang's Mooncake backend (mooncake-transfer-engine, TCP protocol v2 here); the "
    "control messages over ZeroMQ",
    source="read in SGLang 0.5.23: srt/disaggregation/decode.py (pop_transferred, "
    "_defer_release, resolve_deferred_releases, _do_release, _release_request), prefill.py "
    "(process_disagg_prefill_inflight_queue, handle_inflight_transfer_failure), common/conn.py "
    "(register_deferred_abort_room, note_abort_ack, is_abort_release_safe, "
    "_handle_node_failure, _send_abort_notification, CommonKVSender._poll_with_status), "
    "mooncake/conn.py (transfer_worker, _handle_deferred_abort_notification, "
    "_poison_unsettled_send); measured with SGLang's own queue, pool and Mooncake classes in two "
    "processes over Mooncake TCP on loopback (tests/in_sglang/)",
    rows=(
        StatusRow(
            "decode `KVPoll.Success` for the room (`pop_transferred` -> `_commit_transfer_to_req`)",
            "TransferCompleted",
            {Claim.SCHEDULING_STOPPED, Claim.TRANSFERS_ENDED},
            "anything about a later use of the same room (a new lifecycle, new grants)",
            "code and measured",
            f"{_GUARD}::test_success_closes_every_rank_and_ends_the_lifecycle",
            proves="every prefill rank the pages were published to reported Success for the "
            "room (decode counts one per rank); a rank reports it after its last chunk and the "
            "metadata slot's aux write returned 0 (Mooncake TCP v2: landed). Every WRITE grant "
            "of the lifecycle closes; the pages are the running request's",
        ),
        StatusRow(
            "ABORT_ACK `(room, rank, generation)` of the lifecycle's current generation, from "
            "one of the ranks it was published to (`note_abort_ack`), echoing the token that "
            "rank's ABORT carried (both sides guarded: the decode's guard sends each rank an "
            "unguessable token of its own with the ABORT, the prefill's guard echoes it)",
            "TransferCompleted",
            {Claim.SCHEDULING_STOPPED, Claim.TRANSFERS_ENDED},
            "anything about the other ranks (each needs its own ACK). The token proves the ACK "
            "came from a process that received that rank's ABORT, not that the rank tells the "
            "truth about its own transfers. Not sent for a poisoned room or a dead transfer "
            "worker, and only best effort: then no ACK comes (next rows)",
            "code and measured",
            f"{_GUARD}::test_an_ack_of_the_current_generation_closes_that_rank_only",
            proves="on that prefill rank, no chunk of the room is inside `send_kvcache` and "
            "none will start: the prefill marked the room Failed (its worker drops the chunks "
            "of a Failed room at dequeue), and sends the ACK only when the room's outstanding "
            "count, taken at dequeue, is 0 and no send of it failed",
        ),
        StatusRow(
            "ABORT_ACK of the current generation with no token (only the decode runs the guard: "
            "SGLang's prefill echoes none)",
            "TransferCompleted",
            {Claim.SCHEDULING_STOPPED, Claim.TRANSFERS_ENDED},
            "WHICH RANK SENT IT: the rank is a number written in the message, and SGLang's decode "
            "reads every ACK from one ZeroMQ PULL socket with no sender identity, so any prefill "
            "rank (or anyone who can reach the socket) can end another rank's hold with an ACK "
            "in its name, and that rank's late transfer then lands in the next owner's pages "
            "(measured: tests/in_sglang, two ranks, one lying). Taken on the word of whoever "
            "sent it; refused (UnauthorizedEvidence) when the decode is installed with "
            "`prefill_guarded=True`",
            "code and measured",
            f"{_GUARD}::test_an_ack_without_a_token_rests_on_the_word_of_whoever_sent_it",
            proves="only what the ACK row above proves, if the rank it names sent it",
        ),
        StatusRow(
            "ABORT_ACK in a rank's name whose token is not the one that rank's ABORT carried "
            "(another rank's, a guessed or malformed one), or with none while "
            "`prefill_guarded`",
            NOTHING,
            frozenset(),
            "anything: another rank (or anyone) speaking in that rank's name. Refused "
            "(UnauthorizedEvidence, counted `ack_unauthorized`), logged without the token; "
            "SGLang's own ACK count never sees it; nothing changes",
            "code and measured",
            f"{_GUARD}::test_an_ack_in_another_ranks_name_is_unauthorized_and_changes_nothing",
            proves="nothing",
        ),
        StatusRow(
            "ABORT_ACK of an earlier generation of the room (the room reused by a new request, "
            "or re-armed)",
            NOTHING,
            frozenset(),
            "anything about the room's current use: refused (StaleEvidence), logged, counted; "
            "it never counts for the new owner (ABA)",
            "code",
            f"{_GUARD}::test_a_late_ack_of_an_old_generation_never_counts_for_the_new_owner",
            proves="nothing about the current lifecycle",
        ),
        StatusRow(
            "ABORT_ACK of a generation never armed, of another room, or from a rank the pages "
            "were not published to",
            NOTHING,
            frozenset(),
            "anything: refused (MismatchedEvidence), logged, counted; nothing changes",
            "code",
            f"{_GUARD}::test_acks_of_unknown_generations_rooms_and_ranks_are_refused",
            proves="nothing",
        ),
        StatusRow(
            "ABORT_ACK of the current generation while another use of the same room is not "
            "released (the room reused while its earlier use is held); on the prefill, the "
            "room's outstanding count in that case",
            NOTHING,
            frozenset(),
            "anything: SGLang's prefill counts a room's chunks in one counter that a new use of "
            "the room resets; the earlier use's chunk finishing takes it to -1 and the new one's "
            "in flight back to 0, so the ACK goes out while a chunk still writes (measured). "
            "Refused (MismatchedEvidence), logged, counted; both uses wait for a fence",
            "code and measured",
            f"{_GUARD}::test_a_room_reused_while_its_old_use_is_held_counts_no_ack_of_either",
            proves="nothing",
        ),
        StatusRow(
            "ABORT_ACK without a generation (an older prefill, or deferred release off there)",
            NOTHING,
            frozenset(),
            "anything: SGLang's decode drops it with a warning before `note_abort_ack`; the "
            "guard refuses a generation that is not an int (InvalidField)",
            "code",
            f"{_GUARD}::test_an_ack_without_a_generation_is_refused",
            proves="nothing",
        ),
        StatusRow(
            "a request's `bootstrap_room` that is not an int in [0, 2**64) (None, a str, a "
            "float, a bool, a negative or too large int), read by a hook (admission on either "
            "side, a publish, a send)",
            NOTHING,
            frozenset(),
            "anything: no lifecycle can be keyed by it and SGLang's prefill cannot parse it off "
            "the wire. Refused (MalformedEngineValue, counted `malformed_room`, logged); the "
            "request is failed as SGLang fails a bad request at intake (`prepare_abort`, 400, "
            "streamed) before anything is allocated; a room that turns bad after admission is "
            "never published (the transfer fails)",
            "code",
            f"{_GUARD}::test_a_malformed_room_read_from_sglang_is_refused_typed_counted_and_logged",
            proves="nothing",
        ),
        StatusRow(
            "decode `KVPoll.Failed` (user abort, prefill failure, waiting timeout) -> "
            "`_defer_release`",
            NOTHING,
            frozenset(),
            "that any rank stopped writing: the abort is only sent; the lifecycle is held "
            "(rejected in the ledger) until every rank's ACK or a fence",
            "code and measured",
            f"{_GUARD}::test_failed_holds_the_pages_and_proves_nothing",
            proves="only that the decode gave up on the transfer",
        ),
        StatusRow(
            "deferred release deadline passed "
            "(`SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE_TIMEOUT`, 30 s)",
            "LeaseExpired",
            {Claim.DEADLINE_PASSED},
            "that the prefill stopped: SGLang alone frees here (`ready = drained or now >= "
            "deadline`) and a stalled prefill's late transfer lands in the new owner's pages; "
            "guarded the lifecycle is quarantined, never released, until a late ACK or a fence",
            "code and measured",
            f"{_GUARD}::test_the_deadline_quarantines_and_never_releases",
            proves="only that the time SGLang allows passed",
        ),
        StatusRow(
            "heartbeat to the prefill failed (`_handle_node_failure`: its rooms marked Failed)",
            "PeerLost",
            {Claim.HEARTBEAT_FAILED},
            "that its transfers stopped: a stalled prefill that resumes writes again; no ACK "
            "will come; every lifecycle published to it is quarantined when SGLang ends it",
            "code and measured",
            f"{_GUARD}::test_a_lost_prefill_is_quarantined_until_a_fence",
            proves="only that heartbeats to the prefill's bootstrap address failed",
        ),
        StatusRow(
            "decode `_release_request` of a lifecycle the ledger has not released, outside the "
            "deferred path",
            NOTHING,
            frozenset(),
            "anything: SGLang frees without a hold (no ACK was armed); the hooks keep the pages "
            "(withheld, quarantined) and free them once a proof or a fence releases them",
            "code",
            f"{_GUARD}::test_a_free_outside_the_deferred_path_is_withheld",
            proves="nothing",
        ),
        StatusRow(
            "prefill `sender.poll()` -> `KVPoll.Failed` (inflight queue -> "
            "`handle_inflight_transfer_failure` -> `release_kv_cache`)",
            NOTHING,
            frozenset(),
            "that the transfer worker stopped reading the source pages: `_poll_with_status` "
            "reports Failed at once while a chunk may be in flight (measured: Failed 14-24 ms "
            "after the send, drained 0.43-0.71 s later); the free is held until drained",
            "code and measured",
            f"{_GUARD}::test_prefill_failed_proves_nothing_the_free_waits_for_the_drain",
            proves="only that the transfer will not complete",
        ),
        StatusRow(
            "prefill `_staging_outstanding[room]` 0, the room Failed, Success or cleared, not "
            "poisoned",
            "TransferCompleted",
            {Claim.SCHEDULING_STOPPED, Claim.TRANSFERS_ENDED},
            "anything about a later use of the same room on this prefill",
            "code",
            f"{_GUARD}::test_prefill_drained_releases_the_source_pages",
            proves="no chunk of the room is inside `send_kvcache` (the worker counts a chunk at "
            "dequeue and uncounts it when its sends returned) and none will start (queued "
            "chunks of a Failed or cleared room are dropped at dequeue): observed locally",
        ),
        StatusRow(
            "prefill room poisoned (`_poison_unsettled_send`: a send returned non-zero, its "
            "batch possibly still running; or the transfer worker died)",
            "LeaseExpired",
            {Claim.DEADLINE_PASSED},
            "that the batch stopped reading: Mooncake's sync transfer returns -1 at its own "
            "timeout with the batch still running; the source pages are quarantined until a "
            "fence",
            "code",
            f"{_GUARD}::test_a_poisoned_prefill_room_is_quarantined",
            proves="only that the send's own deadline passed",
        ),
        StatusRow(
            "decode: SGLang's `deregister_buffer_to_engine()` and the buffers registered again",
            NOTHING,
            frozenset(),
            "that any prefill's access ended: the decode must keep its buffers registered to "
            "serve later requests, Mooncake checks a request's addresses and not its sender, and "
            "a stalled transfer then lands whole (measured). Not AccessRevoked",
            "code and measured",
            f"{_FENCE}::test_unregistering_the_buffers_is_not_a_fence",
            proves="nothing",
        ),
        StatusRow(
            "decode: the process's Mooncake transfer engine re-created (a new engine serving "
            "the same buffers under a new session, the prefill connections dropped, the old "
            f'engine destroyed and its ports observed closed) -> `"{FENCE}"`',
            "AccessRevoked",
            {Claim.ACCESS_REVOKED},
            "anything about transfers to the new engine, which are new grants; it costs every "
            "transfer in flight to this decode (from every prefill, every room: they fail and "
            "are retried) and about 0.7 s on this 2-core machine",
            "code and measured",
            f"{_FENCE}::test_recreating_the_decode_engine_ends_a_stalled_transfer",
            proves="no prefill can write into the decode's pages through the old session any "
            "more: the old engine's sessions are closed and its copy thread joined (Mooncake's "
            "destructor, docs/fencing.md); a stalled transfer resumed after it lands nothing",
        ),
    ),
    fence=FENCE,
    fence_note="The guard performs no fence itself: the deployment re-creates the decode's "
    "Mooncake transfer engine (SGLang's decode has one per process, serving every room), then "
    f'calls `guard.revoke("{FENCE}")` (AccessRevoked from the local side, for every prefill '
    "rank, or those of one `prefill=`); what it releases SGLang frees at its next "
    "`resolve_deferred_releases`. Killing and reaping the prefill process also ends its "
    "writes. On the prefill side there is no fence for the source pages short of stopping the "
    "transfer worker: the drained evidence is the way out there. `unregister_memory` is not a "
    "fence",
    peer_word="On the decode, transfers_ended and scheduling_stopped (an ABORT_ACK, a Success) "
    "rest on each prefill rank's word. Who sent an ACK: SGLang's decode reads every ACK from "
    "one ZeroMQ PULL socket, which carries no connection identity, and the rank is a number "
    "written in the message. Where both sides run the guard (`prefill_guarded=True`), each "
    "rank's ACK must echo the token only its ABORT carried, so no rank can ACK in another's "
    "name. Where only the decode runs the guard, an ABORT_ACK does NOT prove which rank sent "
    "it: one rank can end another rank's hold. A Success is SGLang's own per-rank count and "
    "carries no token either. cancel_received is never claimed. On the prefill, the drained "
    "evidence is a local observation of its own transfer worker's counters",
    notes=(
        "Rooms are reused: the guard keys each use of a room by a lifecycle of its own "
        "(`sglang:<room>#<n>`) and each ABORT generation by the lifecycle it was armed for, so "
        "a message about an earlier use of a room never acts on a later one.",
        "Not guarded: host destinations (decode host receive; SGLang tracks their drain itself "
        "and never times them out), staging buffers, and the metadata slot's reuse, which the "
        "guard detects and counts (`exposed_slot_reused`) but does not prevent.",
    ),
)
