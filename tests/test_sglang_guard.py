"""SGLangGuard, the sans-IO core of the SGLang integration, driven without SGLang: every signal
becomes exactly the evidence of ``signals.PROFILE``, at every phase of a lifecycle, from every
rank; a room reused never lets a message of its earlier use act on the new one; every bad input
is refused with a typed error, logged and counted, and changes nothing (the whole state is
compared). (tests/in_sglang/ drives the same guard through SGLang's real classes.)"""

from __future__ import annotations

from collections.abc import Callable, MutableMapping
from functools import partial
from typing import Any, cast

import numpy as np
import pytest
import structlog

from kvlifetime.errors import (
    BlockOutOfRange,
    BlockUnavailable,
    DuplicateBlockIds,
    InvalidBlockIds,
    InvalidField,
    KVLifetimeError,
    MismatchedEvidence,
    StaleEvidence,
    UnknownRequest,
    UsageError,
)
from kvlifetime.guard import Refusal, accepted
from kvlifetime.integrations.sglang import (
    PROFILE,
    DecodeGuard,
    GuardNotBound,
    PrefillGuard,
    SGLangGuard,
)
from kvlifetime.profiles import NOTHING, profile
from kvlifetime.spec.table import engine_table
from kvlifetime.spec.vocabulary import RequestState

P0 = "127.0.0.1:8998"  # a prefill's bootstrap address
P1 = "127.0.0.1:9998"
PAGES = np.arange(10, 18)


def decode(n: int = 64) -> DecodeGuard:
    return SGLangGuard(role="decode", ledger_blocks=n)


def prefill(n: int = 64, **kw: Any) -> PrefillGuard:
    return SGLangGuard(role="prefill", ledger_blocks=n, **kw)


def publish(
    g: DecodeGuard,
    room: int = 7,
    pages: Any = PAGES,
    *,
    slot: int = 3,
    ranks: tuple[int, ...] = (0,),
    addr: str = P0,
) -> str:
    return accepted(g.published(room, pages, slot=slot, ranks=list(ranks), prefill=addr))


def state(g: SGLangGuard) -> tuple[Any, ...]:
    """Everything observable, except the refusal and duplicate counters (which a refusal or a
    repeat is expected to bump)."""
    st = g.stats()
    lives = tuple((k, tuple(sorted(g.lifecycle(k).items()))) for k in g.lifecycles())
    figures = (st.live, st.held, st.quarantined, st.quarantined_pages, st.releasable)
    return (
        lives,
        figures,
        st.completed,
        st.freed,
        dict(st.quarantine_reasons),
        g.ledger.fingerprint(),
        g.ready(),
    )


def refused(
    g: SGLangGuard, call: Callable[[], object], error: type[KVLifetimeError], kind: str
) -> list[MutableMapping[str, Any]]:
    """``call`` is refused: a ``Refusal`` (data) carrying ``error`` comes back, nothing changed,
    counted under ``kind`` once and logged."""
    before = state(g)
    counted = g.stats().refused.get(kind, 0)
    with structlog.testing.capture_logs() as logs:
        out = call()
    assert isinstance(out, Refusal) and type(out.error) is error, out
    assert state(g) == before
    assert g.stats().refused.get(kind, 0) == counted + 1
    hits = [e for e in logs if e["event"] == "guard_refused"]
    assert len(hits) == 1 and hits[0]["kind"] == kind and hits[0]["error_type"] == error.__name__
    assert hits[0]["engine"] == "sglang" and hits[0]["log_level"] == "warning"
    return logs


def raised(
    g: SGLangGuard, call: Callable[[], object], error: type[KVLifetimeError], kind: str
) -> None:
    """A caller's misuse (an operator's fence, the hooks' clock): ``call`` raises ``error``,
    changes nothing, is counted under ``kind`` once and logged."""
    before = state(g)
    counted = g.stats().refused.get(kind, 0)
    with structlog.testing.capture_logs() as logs, pytest.raises(error):
        call()
    assert state(g) == before
    assert g.stats().refused.get(kind, 0) == counted + 1
    hits = [e for e in logs if e["event"] == "guard_refused"]
    assert len(hits) == 1 and hits[0]["kind"] == kind and hits[0]["error_type"] == error.__name__


# =========================================================================== decode: the proofs


def test_success_closes_every_rank_and_ends_the_lifecycle() -> None:
    g = decode()
    key = publish(g, ranks=(0, 1, 2))
    assert key == "sglang:7#1"
    assert g.ledger.open_grants(key) and len(g.ledger.open_grants(key)) == 3
    assert g.ledger.stats().blocks_by_state["exposed"] == len(PAGES)
    g.transferred(key)
    st = g.stats()
    assert (st.live, st.held, st.completed, st.freed) == (0, 0, 1, 0)
    assert g.lifecycles() == [] and g.ledger.stats().blocks_by_state["free"] == 64
    # The pages are the running request's now: a new lifecycle may publish them again.
    assert publish(g, room=8) == "sglang:8#2"
    # A repeat of the Success is a duplicate: no-op, counted.
    before = state(g)
    g.transferred(key)
    assert state(g) == before and g.stats().duplicates == 1


def test_an_ack_of_the_current_generation_closes_that_rank_only() -> None:
    g = decode()
    key = publish(g, ranks=(0, 1))
    g.armed(key, 1)
    assert g.acked(7, 1, 1) is True
    g.held(key, deadline=30.0)
    assert not g.releasable(key)
    assert g.lifecycle(key)["acked"] == [1] and g.lifecycle(key)["phase"] == "held"
    assert g.ledger.state(key) is RequestState.REJECTED
    assert g.acked(7, 1, 1) is False  # a repeat: a no-op
    assert g.stats().duplicates == 1
    assert g.acked(7, 0, 1) is True  # the other rank: every rank proven, released
    assert g.releasable(key) and g.stats().releasable == 1
    g.freed(key)
    assert g.lifecycles() == [] and g.stats().freed == 1


def test_ack_before_the_failure_is_kept_and_releases_at_the_hold() -> None:
    # abort() arms and sends the ABORT from the scheduler; the ACK may land (on the decode
    # thread) before pop_transferred sees Failed and holds.
    g = decode()
    key = publish(g)
    g.armed(key, 5)
    assert g.acked(7, 0, 5) is True
    assert g.lifecycle(key)["phase"] == "live"
    assert g.held(key, deadline=30.0) is True
    assert g.releasable(key)


def test_two_ranks_one_acks_the_other_is_quarantined_at_the_deadline() -> None:
    g = decode()
    key = publish(g, ranks=(0, 1))
    g.armed(key, 1)
    g.acked(7, 0, 1)
    g.held(key, deadline=30.0)
    assert g.tick(29.9) == []
    with structlog.testing.capture_logs() as logs:
        assert g.tick(30.0) == [key]
    q = [e for e in logs if e["event"] == "sglang_quarantined"]
    assert q == [
        {
            "event": "sglang_quarantined",
            "log_level": "warning",
            "key": key,
            "room": 7,
            "reason": "deadline",
            "pages": len(PAGES),
            "acked": [0],
            "ranks": [0, 1],
        }
    ]
    assert not g.releasable(key)
    # Rank 0's grant is closed, rank 1's open: the ledger says what is unproven.
    unproven = g.ledger.unproven(key)
    assert len(unproven) == 1 and "rank1" in next(iter(unproven))


def test_failed_holds_the_pages_and_proves_nothing() -> None:
    g = decode()
    key = publish(g)
    assert g.held(key, deadline=30.0) is False
    st = g.stats()
    assert (st.live, st.held, st.quarantined, st.releasable) == (0, 1, 0, 0)
    assert g.ledger.stats().blocks_by_state["draining"] == len(PAGES)
    assert not g.releasable(key)
    out = g.freed(key)  # SGLang may not free it
    assert isinstance(out, Refusal) and isinstance(out.error, UsageError)
    # A second hold of the same lifecycle is a repeat.
    before = state(g)
    assert g.held(key, deadline=99.0) is False
    assert state(g) == before
    # Success cannot follow a failure SGLang already acted on: refused, nothing changed.
    refused(g, lambda: g.transferred(key), UsageError, "transferred_refused")


def test_the_deadline_quarantines_and_never_releases() -> None:
    g = decode()
    key = publish(g)
    g.armed(key, 1)
    g.held(key, deadline=30.0)
    assert g.tick(30.02) == [key]
    st = g.stats()
    assert (st.quarantined, st.quarantined_pages, st.quarantine_reasons) == (
        1,
        len(PAGES),
        {"deadline": 1},
    )
    assert g.ledger.stats().blocks_by_state["quarantined"] == len(PAGES)
    for now in (31.0, 1e6):
        assert g.tick(now) == [] and not g.releasable(key)
    # The prefill resumed and drained: its ACK (0.71 s after the abort in the measurement)
    # ends the quarantine.
    assert g.acked(7, 0, 1) is True
    assert g.releasable(key)
    g.freed(key)
    assert g.stats().quarantined == 0 and g.ledger.stats().blocks_by_state["free"] == 64


def test_a_lost_prefill_is_quarantined_until_a_fence() -> None:
    g = decode()
    lost = publish(g, room=7, pages=np.arange(0, 4), slot=1, ranks=(0, 1), addr=P0)
    other = publish(g, room=8, pages=np.arange(4, 8), slot=2, addr=P1)
    g.armed(lost, 1)
    g.acked(7, 0, 1)  # rank 0 drained before the loss
    assert g.prefill_lost(P0) == []  # still running: suspect, not yet quarantined
    g.held(lost, deadline=30.0)
    st = g.stats()
    assert st.quarantined == 1 and st.quarantine_reasons == {"peer_lost": 1}
    assert g.ledger.state(lost) is RequestState.QUARANTINED
    assert g.ledger.state(other) is RequestState.ADMITTED  # another prefill: untouched
    # A fence of the lost prefill releases it, and only it.
    assert g.revoke("prefill_reaped", prefill=P0) == [lost]
    assert g.releasable(lost) and not g.releasable(other)
    assert g.ledger.stats().reclaimed_blocks == {"prefill_reaped": 4}
    g.freed(lost)
    g.transferred(other)
    assert g.lifecycles() == []


def test_a_free_outside_the_deferred_path_is_withheld() -> None:
    g = decode()
    key = publish(g)
    with structlog.testing.capture_logs() as logs:
        assert g.withheld(key, now=5.0) is False
    assert [e["reason"] for e in logs if e["event"] == "sglang_quarantined"] == ["freed_unproven"]
    assert g.stats().quarantine_reasons == {"freed_unproven": 1}
    assert g.take_released() == []
    assert g.revoke("decode_engine_recreated") == [key]
    assert g.take_released() == [key] and g.take_released() == []
    g.freed(key)
    # Proven before SGLang frees it: withheld returns True (free now).
    k2 = publish(g, room=9)
    g.armed(k2, 2)
    g.acked(9, 0, 2)
    assert g.withheld(k2, now=6.0) is True
    assert g.take_released() == []


# =========================================================================== decode: rooms reused


def test_a_late_ack_of_an_old_generation_never_counts_for_the_new_owner() -> None:
    g = decode()
    old = publish(g)
    g.armed(old, 1)
    g.held(old, deadline=30.0)
    g.revoke("decode_engine_recreated")
    g.freed(old)
    new = publish(g)  # the same room, the same pages, the same slot: a new owner
    assert new != old
    g.armed(new, 2)
    g.held(new, deadline=60.0)
    logs = refused(g, lambda: g.acked(7, 0, 1), StaleEvidence, "ack_refused")
    assert logs[-1]["room"] == 7 and logs[-1]["generation"] == 1
    assert not g.releasable(new)
    assert g.acked(7, 0, 2) is True and g.releasable(new)


def test_a_room_reused_while_its_old_use_is_held_counts_no_ack_of_either() -> None:
    # SGLang's prefill counts a room's chunks in one counter that a new use of the room resets
    # (measured on the real classes: the old chunk finishing takes it to -1, the new one in
    # flight back to 0, and the new use's ABORT is ACKed while its chunk still writes). While
    # two uses of the room are unreleased, no ACK for the room is evidence for either.
    g = decode()
    old = publish(g, pages=np.arange(0, 4), slot=1)
    g.armed(old, 1)
    g.held(old, deadline=30.0)
    new = publish(g, pages=np.arange(4, 8), slot=2)  # same room, SGLang still holds the old
    g.armed(new, 2)
    g.held(new, deadline=30.0)
    refused(g, lambda: g.acked(7, 0, 2), MismatchedEvidence, "ack_refused")
    refused(g, lambda: g.acked(7, 0, 1), MismatchedEvidence, "ack_refused")
    assert g.tick(30.0) == [old, new]  # both quarantined at their deadline
    assert g.revoke("mooncake_decode_engine_recreated") == [old, new]
    g.freed(old)
    g.freed(new)
    # One use of the room at a time again: its ACK counts.
    k3 = publish(g, pages=np.arange(8, 12), slot=3)
    g.armed(k3, 3)
    assert g.acked(7, 0, 3) is True


def test_a_success_of_a_reused_room_still_counts() -> None:
    # Success is each rank's report about its own sends of this use: not the shared counter.
    g = decode()
    old = publish(g, pages=np.arange(0, 4), slot=1)
    g.held(old, deadline=30.0)
    new = publish(g, pages=np.arange(4, 8), slot=2)
    g.transferred(new)
    assert g.lifecycles() == [old] and g.stats().completed == 1


def test_prefill_drain_of_a_room_with_two_uses_is_refused() -> None:
    g = prefill()
    a = accepted(g.sending(None, 7, np.arange(0, 4)))
    g.ended(a, now=1.0, reason="transfer_failed")  # Failed, its chunk still in flight
    b = accepted(g.sending(None, 7, np.arange(4, 8)))  # the room reused: SGLang resets its count
    assert g.room_shared_with(a) == b and g.room_shared_with(b) == a
    refused(g, lambda: g.drained(a), MismatchedEvidence, "drained_refused")
    refused(g, lambda: g.drained(b), MismatchedEvidence, "drained_refused")
    assert g.tick(31.0) == [a]  # a's drain deadline: quarantined, never released


def test_a_re_armed_lifecycle_counts_only_its_new_generation() -> None:
    g = decode()
    key = publish(g, ranks=(0, 1))
    g.armed(key, 1)
    g.acked(7, 0, 1)
    g.armed(key, 2)  # SGLang resets the room's ACK set under a new generation
    assert g.lifecycle(key)["acked"] == [] and g.lifecycle(key)["generation"] == 2
    refused(g, lambda: g.acked(7, 1, 1), StaleEvidence, "ack_refused")
    before = state(g)
    g.armed(key, 2)  # a repeat
    assert state(g) == before


def test_acks_of_unknown_generations_rooms_and_ranks_are_refused() -> None:
    g = decode()
    a = publish(g, room=7, pages=np.arange(0, 4), slot=1, ranks=(0, 1))
    b = publish(g, room=8, pages=np.arange(4, 8), slot=2)
    g.armed(a, 1)
    g.armed(b, 2)
    g.held(a, deadline=30.0)
    refused(g, lambda: g.acked(7, 0, 99), MismatchedEvidence, "ack_refused")  # never armed
    refused(g, lambda: g.acked(8, 0, 1), MismatchedEvidence, "ack_refused")  # another room's
    refused(g, lambda: g.acked(7, 2, 1), MismatchedEvidence, "ack_refused")  # not a rank of it
    refused(g, lambda: g.acked(12345, 0, 1), MismatchedEvidence, "ack_refused")  # unknown room
    g.held(b, deadline=30.0)
    g.acked(8, 0, 2)
    g.freed(b)
    refused(g, lambda: g.acked(7, 0, 2), MismatchedEvidence, "ack_refused")  # b's, freed


def test_an_ack_without_a_generation_is_refused() -> None:
    g = decode()
    key = publish(g)
    g.armed(key, 1)
    bad: Any
    for bad in (None, "1", 1.0, True, -1, 2**40):
        refused(g, partial(g.acked, 7, 0, bad), InvalidField, "ack_refused")
    for bad in (None, "7", 7.0, False, -7, 2**64):
        refused(g, partial(g.acked, bad, 0, 1), InvalidField, "ack_refused")
    for bad in (None, "0", 0.0, True, -1):
        refused(g, partial(g.acked, 7, bad, 1), InvalidField, "ack_refused")
    zero: Any = np.int64(0)
    assert g.acked(7, zero, zero + 1) is True  # numpy integers are ints


# =========================================================================== decode: bad calls


def test_publishes_of_bad_values_are_refused_and_change_nothing() -> None:
    g = decode(32)
    publish(g, room=1, pages=np.arange(0, 4), slot=0)
    bad: list[tuple[dict[str, Any], type[KVLifetimeError]]] = [
        ({"room": "7"}, InvalidField),
        ({"room": True}, InvalidField),
        ({"room": -1}, InvalidField),
        ({"room": 2**64}, InvalidField),
        ({"slot": None}, InvalidField),
        ({"slot": -1}, InvalidField),
        ({"ranks": ()}, InvalidField),
        ({"ranks": (0, 0)}, InvalidField),
        ({"ranks": (0.0,)}, InvalidField),
        ({"addr": ""}, InvalidField),
        ({"pages": [1.5, 2.0]}, InvalidBlockIds),
        ({"pages": ["4"]}, InvalidBlockIds),
        ({"pages": [31, 32]}, BlockOutOfRange),
        ({"pages": [5, 5]}, DuplicateBlockIds),
    ]
    for kw, error in bad:
        args = {"room": 7, "pages": np.arange(8, 12), "slot": 1, "ranks": (0,), "addr": P0}
        args.update(kw)
        refused(
            g,
            lambda a=args: g.published(  # type: ignore[misc]
                a["room"], a["pages"], slot=a["slot"], ranks=list(a["ranks"]), prefill=a["addr"]
            ),
            error,
            "published_refused",
        )
    refused(
        g,
        partial(g.published, 7, [9], slot=1, ranks=cast(Any, "0"), prefill=P0),
        InvalidField,
        "published_refused",
    )
    # The next lifecycle gets the next number: refusals made none.
    assert publish(g, room=2, pages=[20], slot=5) == "sglang:2#2"


def test_a_publish_over_pages_the_guard_still_holds_is_refused_and_counted() -> None:
    g = decode()
    key = publish(g, pages=np.arange(0, 4))
    g.held(key, deadline=1.0)
    g.tick(2.0)  # quarantined: SGLang keeps these pages
    refused(
        g,
        lambda: g.published(9, [3, 4], slot=3, ranks=[0], prefill=P0),
        BlockUnavailable,
        "exposed_page_reused",
    )


def test_a_publish_of_a_slot_the_guard_still_holds_is_counted_and_logged() -> None:
    g = decode()
    key = publish(g, pages=np.arange(0, 4), slot=3)
    g.held(key, deadline=1.0)
    with structlog.testing.capture_logs() as logs:
        k2 = publish(g, room=9, pages=np.arange(4, 8), slot=3)
    assert [e for e in logs if e["event"] == "sglang_exposed_slot_reused"] == [
        {
            "event": "sglang_exposed_slot_reused",
            "log_level": "warning",
            "slot": 3,
            "key": k2,
            "held_by": key,
        }
    ]
    assert g.stats().refused == {"exposed_slot_reused": 1}


def test_unknown_lifecycles_and_wrong_roles_are_refused() -> None:
    g = decode()
    key = publish(g)
    refused(g, lambda: g.transferred("sglang:7#99"), UnknownRequest, "transferred_refused")
    refused(g, lambda: g.held("nope", deadline=1.0), UnknownRequest, "end_refused")
    refused(g, lambda: g.held(key, deadline=float("nan")), InvalidField, "end_refused")
    refused(g, lambda: g.armed("sglang:1#1", 3), UnknownRequest, "armed_refused")
    refused(g, lambda: g.armed(key, -3), InvalidField, "armed_refused")
    refused(g, lambda: g.freed(key), UsageError, "freed_refused")
    refused(g, lambda: g.withheld(7, now=1.0), InvalidField, "withheld_refused")  # type: ignore[arg-type]
    raised(g, lambda: g.revoke(""), InvalidField, "revoke_refused")
    refused(g, lambda: g.prefill_lost(""), InvalidField, "prefill_lost_refused")
    g.armed(key, 1)
    refused(g, lambda: g.armed(key, 0), MismatchedEvidence, "armed_refused")  # counter only grows
    # Each role is a class of its own: the other role's calls are not there to misuse.
    assert type(g) is DecodeGuard and type(prefill()) is PrefillGuard
    for name in ("sending", "drained", "poisoned", "ended", "abort_received", "echo_token"):
        assert not hasattr(g, name), name
    for name in ("published", "armed", "acked", "transferred", "held", "prefill_lost"):
        assert not hasattr(prefill(), name), name


def test_before_bind_the_ledger_is_refused_and_a_tick_is_a_no_op() -> None:
    g = SGLangGuard(role="decode")
    assert not g.bound and g.stats().ledger is None and g.tick(1.0) == []
    with pytest.raises(GuardNotBound):
        _ = g.ledger
    with pytest.raises(GuardNotBound):
        publish(g)
    g.bind(16)
    g.bind(16)  # the same size: a no-op
    with pytest.raises(InvalidField):
        g.bind(17)
    assert publish(g, pages=[1, 2]) == "sglang:7#1"
    for bad in ({"role": "router"}, {"role": "decode", "ledger_blocks": 0}):
        with pytest.raises(InvalidField):
            SGLangGuard(**bad)


# =========================================================================== prefill


def test_prefill_failed_proves_nothing_the_free_waits_for_the_drain() -> None:
    g = prefill()
    key = accepted(g.sending(None, 7, np.arange(0, 4)))
    assert g.sending(key, 7, np.arange(4, 8)) == key  # a second chunk: another READ grant
    assert len(g.ledger.open_grants(key)) == 2
    # poll() says Failed with a chunk still in flight; SGLang frees: held.
    assert g.ended(key, now=100.0, reason="transfer_failed") is False
    assert g.take_released() == [] and not g.releasable(key)
    assert g.ledger.stats().blocks_by_state["draining"] == 8
    # The worker finished the chunk: outstanding 0 -> drained; the free goes ahead.
    assert g.drained(key) is True
    assert g.take_released() == [key]
    g.freed(key)
    assert g.lifecycles() == [] and g.ledger.stats().blocks_by_state["free"] == 64


def test_prefill_drained_releases_the_source_pages() -> None:
    g = prefill()
    key = accepted(g.sending(None, 7, np.arange(0, 4)))
    assert g.drained(key) is False  # still live: the proof is kept
    assert g.drained(key) is False  # a repeat
    assert g.ended(key, now=1.0) is True  # Success: drained first, freed at once
    assert g.ledger.stats().requests_by_state["transfer_quiesced"] == 0
    g.freed(key)
    assert g.drained(key) is False and g.stats().duplicates >= 2


def test_a_poisoned_prefill_room_is_quarantined() -> None:
    g = prefill()
    key = accepted(g.sending(None, 7, np.arange(0, 4)))
    g.poisoned(key)
    assert g.ended(key, now=1.0, reason="transfer_failed") is False
    st = g.stats()
    assert st.quarantined == 1 and st.quarantine_reasons == {"poisoned": 1}
    assert g.tick(1e9) == [] and g.take_released() == []
    assert g.revoke("prefill_transfer_engine_recreated") == [key]
    assert g.take_released() == [key]


def test_prefill_drain_timeout_quarantines_and_a_late_drain_releases() -> None:
    g = prefill(drain_timeout=5.0)
    key = accepted(g.sending(None, 7, np.arange(0, 4)))
    g.ended(key, now=10.0, reason="transfer_failed")
    assert g.tick(14.9) == []
    assert g.tick(15.0) == [key]
    assert g.stats().quarantine_reasons == {"deadline": 1}
    assert g.drained(key) is True and g.take_released() == [key]


def test_prefill_shares_cached_prefix_pages_between_rooms() -> None:
    g = prefill()
    a = accepted(g.sending(None, 7, np.arange(0, 8)))
    b = accepted(g.sending(None, 8, np.arange(0, 4)))  # a prefix-cache hit: the same source pages
    assert a != b
    g.drained(a)
    assert g.ended(a, now=1.0) is True
    g.freed(a)
    assert g.ledger.holders(np.arange(0, 4)).tolist() == [1, 1, 1, 1]
    refused(g, lambda: g.sending(b, 9, [9]), InvalidField, "sending_refused")  # another room
    refused(g, lambda: g.sending(a, 7, [9]), UnknownRequest, "sending_refused")  # freed


# =========================================================================== the profile


def test_the_profile_is_registered_and_pinned_here() -> None:
    assert profile("sglang") is PROFILE
    # Every row of the guard's own signals is pinned in this file; the fence's rows by the
    # experiment on SGLang's real decode (tests/in_sglang/, SGLang's venv).
    here = [r.test.split("::")[1] for r in PROFILE.rows if r.test.startswith(_THIS)]
    elsewhere = [r.test for r in PROFILE.rows if not r.test.startswith(_THIS)]
    assert [t for t in here if t not in globals()] == []
    assert len(here) == len(PROFILE.rows) - 2
    assert all(t.startswith("tests/in_sglang/test_sglang_fence.py::") for t in elsewhere)
    assert PROFILE.fence == "mooncake_decode_engine_recreated"
    nothing = [r.status for r in PROFILE.rows if r.evidence == NOTHING]
    assert any("KVPoll.Failed" in s for s in nothing)
    assert any("earlier generation" in s for s in nothing)


# =========================================================================== threads


def test_acks_on_another_thread_while_the_scheduler_publishes_and_holds() -> None:
    # SGLang's decode thread calls note_abort_ack while the scheduler thread publishes, holds,
    # ticks and frees: every lifecycle is released exactly once, by its own ACK.
    import threading

    g = decode(4096)
    n = 200
    keys = []
    for i in range(n):
        k = publish(g, room=1000 + i, pages=np.arange(i * 8, i * 8 + 8), slot=i)
        g.armed(k, i + 1)
        keys.append(k)
    start = threading.Barrier(2)

    def acks() -> None:
        start.wait()
        for i in range(n):
            g.acked(1000 + i, 0, i + 1)

    t = threading.Thread(target=acks)
    t.start()
    start.wait()
    freed = 0
    for i, k in enumerate(keys):
        g.held(k, deadline=1e9)
        g.tick(float(i))
    t.join()
    for k in keys:
        assert g.releasable(k)
        g.freed(k)
        freed += 1
    st = g.stats()
    assert (freed, st.freed, st.held, st.live, st.refused, st.duplicates) == (n, n, 0, 0, {}, 0)
    assert g.ledger.stats().blocks_by_state["free"] == 4096


# =========================================================================== every signal, phase

_THIS = "tests/test_sglang_guard.py::"
PHASES = ("live", "armed", "held", "quarantined", "released", "freed")


def _at(phase: str) -> tuple[DecodeGuard, str]:
    """A decode guard with one lifecycle (room 7, ranks 0 and 1, generation 1) in ``phase``."""
    g = decode()
    key = publish(g, ranks=(0, 1))
    steps = PHASES.index(phase)
    if steps >= 1:
        g.armed(key, 1)
    if steps >= 2:
        g.held(key, deadline=10.0)
    if steps >= 3:
        g.tick(10.0)
    if steps >= 4:
        g.acked(7, 0, 1)
        g.acked(7, 1, 1)
    if steps >= 5:
        g.freed(key)
    return g, key


def _where(g: DecodeGuard, key: str) -> tuple[str, str, list[int]] | str:
    if key not in g.lifecycles():
        return "gone"
    life = g.lifecycle(key)
    return life["phase"], life["quarantine"], life["acked"]


# (signal, phase) -> what follows: an error class (refused: nothing changed), "dup" (a
# no-op, counted), or where the lifecycle is afterwards.
_SIGNALS: dict[str, Callable[[DecodeGuard, str], object]] = {
    "ack rank 0": lambda g, k: g.acked(7, 0, 1),
    "ack rank 2": lambda g, k: g.acked(7, 2, 1),
    "ack of a generation never armed": lambda g, k: g.acked(7, 0, 0),
    "success": lambda g, k: g.transferred(k),
    "failed (hold)": lambda g, k: g.held(k, deadline=10.0),
    "freed": lambda g, k: g.freed(k),
    "prefill lost": lambda g, k: g.prefill_lost(P0),
    "tick past the deadline": lambda g, k: g.tick(11.0),
}
Q = "deadline"
_EXPECT: dict[str, tuple[object, ...]] = {
    # live, armed, held, quarantined, released, freed
    "ack rank 0": (
        MismatchedEvidence,
        ("live", "", [0]),
        ("held", "", [0]),
        ("held", Q, [0]),
        "dup",
        StaleEvidence,
    ),
    "ack rank 2": (MismatchedEvidence,) * 5 + (StaleEvidence,),
    "ack of a generation never armed": (MismatchedEvidence,) * 6,
    "success": ("gone", "gone", UsageError, UsageError, UsageError, "dup"),
    "failed (hold)": (("held", "", []), ("held", "", []), "dup", "dup", "dup", "dup"),
    "freed": (UsageError,) * 4 + ("gone", "dup"),
    "prefill lost": (
        ("live", "", []),
        ("live", "", []),
        ("held", "peer_lost", []),
        ("held", Q, []),
        ("released", "", [0, 1]),
        "gone",
    ),
    "tick past the deadline": (
        ("live", "", []),
        ("live", "", []),
        ("held", Q, []),
        ("held", Q, []),
        ("released", "", [0, 1]),
        "gone",
    ),
}


@pytest.mark.parametrize("phase", PHASES)
@pytest.mark.parametrize("signal", list(_SIGNALS))
def test_every_signal_at_every_phase(signal: str, phase: str) -> None:
    g, key = _at(phase)
    expect = _EXPECT[signal][PHASES.index(phase)]
    if isinstance(expect, type):
        before = state(g)
        with structlog.testing.capture_logs() as logs:
            out = _SIGNALS[signal](g, key)
        assert isinstance(out, Refusal) and isinstance(out.error, expect), out
        assert state(g) == before
        assert [e["error_type"] for e in logs if e["event"] == "guard_refused"] == [expect.__name__]
        return
    if expect == "dup":
        before, dups = state(g), g.stats().duplicates
        _SIGNALS[signal](g, key)
        assert state(g) == before and g.stats().duplicates == dups + 1
        return
    _SIGNALS[signal](g, key)
    assert _where(g, key) == expect


# =========================================================================== Prometheus


def test_the_collector_scrapes_before_and_after_the_ledger_is_bound() -> None:
    from prometheus_client import CollectorRegistry, generate_latest

    from kvlifetime.integrations.sglang.metrics import SGLangGuardCollector

    g = SGLangGuard(role="decode")  # as install returns it: not bound yet
    reg = CollectorRegistry()
    reg.register(SGLangGuardCollector(g, name="d0", clock=lambda: 40.0))
    text = generate_latest(reg).decode()
    assert 'kvlifetime_sglang_lifecycles{ledger="d0",phase="held"} 0.0' in text
    assert "kvlifetime_blocks" not in text
    g.bind(64)
    key = publish(g)
    g.held(key, deadline=10.0)
    g.tick(10.0)
    assert isinstance(g.acked(7, 0, 9), Refusal)
    text = generate_latest(reg).decode()
    for line in (
        'kvlifetime_blocks{ledger="d0",state="quarantined"} 8.0',
        'kvlifetime_quarantine_oldest_age_seconds{ledger="d0"} 30.0',
        'kvlifetime_sglang_quarantined_lifecycles{ledger="d0",reason="deadline"} 1.0',
        'kvlifetime_sglang_quarantined_pages{ledger="d0"} 8.0',
        'kvlifetime_sglang_refused_total{kind="ack_refused",ledger="d0"} 1.0',
    ):
        assert line in text, line


def test_silent_until_the_application_configures_structlog(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # A library never configures structlog: unconfigured, its default would print every event
    # of every request to stdout inside SGLang's scheduler (and cost more than the guard).
    was, config = structlog.is_configured(), structlog.get_config()
    structlog.reset_defaults()
    try:
        assert not structlog.is_configured()
        g = decode()
        key = publish(g)
        g.held(key, deadline=1.0)
        g.tick(2.0)
        refusal = g.acked(7, 0, 5)
        assert isinstance(refusal, Refusal) and isinstance(refusal.error, MismatchedEvidence)
    finally:
        if was:
            structlog.configure(**config)
    assert capsys.readouterr().out == ""
    assert g.stats().quarantined == 1 and g.stats().refused == {"ack_refused": 1}


# =========================================================================== review: bad input


class _RaisingInt(int):
    """An int whose own ``__int__`` raises: its checks must read the plain value."""

    def __int__(self) -> int:
        raise ValueError("__int__ called")


class _LyingInt(int):
    """An int whose own ``__int__`` says another number."""

    def __int__(self) -> int:
        return 9


class _RaisingIterable:
    def __iter__(self) -> Any:
        raise RuntimeError("iterating raised")


def test_an_int_subclass_is_read_plain_and_a_raising_iterable_is_refused_typed() -> None:
    # What is stored is the plain value, never what the subclass's own __int__ says or raises
    # (before: the room was read through __int__, and its ValueError escaped untyped).
    g = decode()
    bad_ranks = cast(Any, _RaisingIterable())
    call = partial(g.published, 7, PAGES, slot=3, ranks=bad_ranks, prefill=P0)
    refused(g, call, InvalidField, "published_refused")
    key = publish(g, room=_RaisingInt(7), ranks=(_RaisingInt(0), _LyingInt(1)), slot=_LyingInt(3))
    life = g.lifecycle(key)
    assert key == "sglang:7#1" and (life["room"], life["ranks"], life["slot"]) == (7, [0, 1], 3)
    g.armed(key, _RaisingInt(1))
    assert g.lifecycle(key)["generation"] == 1
    assert g.acked(_LyingInt(7), _RaisingInt(0), _LyingInt(1)) is True
    assert g.lifecycle(key)["acked"] == [0]
    p = prefill()
    assert p.sending(None, _RaisingInt(5), [1]) == "sglang:5#1"
    assert p.sending(None, _LyingInt(6), [2]) == "sglang:6#2"


def test_a_bad_clock_is_counted_and_logged() -> None:
    d, p = decode(), prefill()
    key = publish(d)
    pkey = accepted(p.sending(None, 7, [1, 2]))
    refused(p, lambda: p.ended(pkey, now=float("nan")), InvalidField, "end_refused")
    refused(p, lambda: p.ended(pkey, now=True), InvalidField, "end_refused")
    # The clock is the caller's (the hooks'), not a signal: a bad one raises, counted and logged.
    with structlog.testing.capture_logs() as logs, pytest.raises(InvalidField):
        d.tick(cast(Any, "now"))
    assert d.stats().refused["tick_refused"] == 1
    assert [e["kind"] for e in logs if e["event"] == "guard_refused"] == ["tick_refused"]
    refused(d, lambda: d.withheld(key, now=float("inf")), InvalidField, "withheld_refused")


def test_a_withheld_free_does_not_relabel_other_quarantines() -> None:
    g = decode()
    failed = publish(g, room=1, pages=[0, 1], slot=1)
    freed = publish(g, room=2, pages=[2, 3], slot=2)
    g.held(failed, deadline=5.0)  # SGLang's deferred release, its deadline passes unproven
    assert g.withheld(freed, now=10.0) is False  # a free outside the deferred path
    assert g.lifecycle(failed)["quarantine"] == "deadline"
    assert g.lifecycle(freed)["quarantine"] == "freed_unproven"
    assert g.stats().quarantine_reasons == {"deadline": 1, "freed_unproven": 1}


def test_a_bad_fence_is_refused_even_with_nothing_to_revoke() -> None:
    for g in (decode(), prefill()):
        for fence in ("", "f" * 129, cast(Any, None), cast(Any, 5)):
            raised(g, partial(g.revoke, fence), InvalidField, "revoke_refused")
        assert g.revoke("mooncake_decode_engine_recreated") == []


def test_install_with_an_unknown_option_is_refused_typed_and_installs_nothing() -> None:
    import kvlifetime.integrations.sglang as kv_sglang

    with pytest.raises(InvalidField, match="drain_timout"):
        kv_sglang.install(role="decode", drain_timout=5.0)
    assert kv_sglang.installed() is None
    kv_sglang.uninstall()  # without an install: a no-op
    assert kv_sglang.installed() is None


def test_a_fence_revokes_only_the_lifecycles_it_fenced() -> None:
    # A fence ends the access of what was exposed when it ran; SGLang may publish to the new
    # engine before the deployment calls revoke: those grants stay open.
    g = decode()
    old = publish(g, room=1, pages=[0, 1], slot=1, ranks=(0, 1))
    gone = publish(g, room=3, pages=[6, 7], slot=3)
    g.transferred(gone)  # freed before revoke: skipped
    exposed = [*g.lifecycles(), gone]
    new = publish(g, room=2, pages=[2, 3], slot=2)  # after the fence completed
    g.held(old, deadline=5.0)
    g.held(new, deadline=5.0)
    assert g.revoke("mooncake_decode_engine_recreated", fenced=exposed) == [old]
    assert g.lifecycle(new)["phase"] == "held" and len(g.ledger.open_grants(new)) == 1
    assert g.lifecycle(old)["phase"] == "released"
    bads: list[Any] = ["sglang:1#1", [7], _RaisingIterable()]
    for bad in bads:
        raised(
            g,
            partial(g.revoke, "mooncake_decode_engine_recreated", fenced=bad),
            InvalidField,
            "revoke_refused",
        )


# =========================================================================== a fence of one prefill


def test_a_fence_scoped_to_one_prefill_leaves_the_other_prefills_held() -> None:
    # revoke(fence, prefill=A) ends only A's access: B's lifecycles, held and unproven, stay
    # held (with and without the fenced snapshot).
    for snapshot in (False, True):
        g = decode()
        a = publish(g, room=1, pages=[0, 1], slot=1, ranks=(0, 1), addr=P0)
        b = publish(g, room=2, pages=[2, 3], slot=2, ranks=(0,), addr=P1)
        for key, gen in ((a, 1), (b, 2)):
            g.armed(key, gen)
            g.held(key, deadline=30.0)
        fenced = g.lifecycles() if snapshot else None
        assert g.revoke("prefill_reaped", prefill=P0, fenced=fenced) == [a]
        assert g.releasable(a)
        assert g.lifecycle(b)["phase"] == "held" and not g.releasable(b)
        assert len(g.ledger.open_grants(b)) == 1
        assert g.ledger.state(b) is RequestState.REJECTED
        assert g.stats().refused == {}


# ========================================================================= values read from SGLang

MALFORMED_ROOMS: list[Any] = [
    None,
    "7",
    7.0,
    True,
    False,
    -1,
    2**64,
    np.float64(7.0),
    [7],
]


@pytest.mark.parametrize("bad", MALFORMED_ROOMS, ids=repr)
def test_a_malformed_room_read_from_sglang_is_refused_typed_counted_and_logged(bad: Any) -> None:
    from kvlifetime.integrations.sglang import MalformedEngineValue

    for g in (decode(), prefill()):
        key = publish(g) if isinstance(g, DecodeGuard) else g.sending(None, 7, PAGES)
        logs = refused(
            g, partial(g.engine_room, bad, at="admission"), MalformedEngineValue, "malformed_room"
        )
        assert logs[-1]["at"] == "admission" and "room" in logs[-1]
        assert g.stats().refused == {"malformed_room": 1}
        assert g.lifecycles() == [key]  # nobody else's state changed


def test_a_room_read_from_sglang_is_read_plain() -> None:
    g = decode()
    for good, plain in ((0, 0), (2**64 - 1, 2**64 - 1), (np.int64(9), 9), (np.uint64(5), 5)):
        got = g.engine_room(good, at="admission")
        assert got == plain and type(got) is int
    assert g.stats().refused == {}


# =========================================================================== who sent an ACK


def test_each_rank_is_sent_a_token_of_its_own_renewed_with_each_generation() -> None:
    g = decode()
    key = publish(g, ranks=(0, 1))
    assert g.abort_token(key, 0) is None  # nothing armed: no ABORT carries a token yet
    g.armed(key, 1)
    t0, t1 = g.abort_token(key, 0), g.abort_token(key, 1)
    assert isinstance(t0, str) and isinstance(t1, str) and t0 != t1
    assert len(t0) == 32 and int(t0, 16) >= 0
    g.armed(key, 2)  # re-armed: a new ABORT, new tokens
    assert g.abort_token(key, 0) not in (t0, t1)
    assert g.abort_token(key, 5) is None  # not a rank of it: no token


def test_an_ack_in_another_ranks_name_is_unauthorized_and_changes_nothing() -> None:
    from kvlifetime.errors import UnauthorizedEvidence

    for prefill_guarded in (False, True):
        g = SGLangGuard(role="decode", ledger_blocks=64, prefill_guarded=prefill_guarded)
        key = publish(g, ranks=(0, 1))
        g.armed(key, 1)
        t0, t1 = g.abort_token(key, 0), g.abort_token(key, 1)
        assert t0 is not None and t1 is not None
        assert g.acked(7, 0, 1, token=t0) is True
        g.held(key, deadline=30.0)
        # Rank 0 ACKs in rank 1's name with the token it was sent, or a guessed one.
        for lie in (t0, "0" * 32, "zz"):
            logs = refused(
                g,
                partial(g.acked, 7, 1, 1, token=lie),
                UnauthorizedEvidence,
                "ack_unauthorized",
            )
            assert lie not in str(logs[-1]), "a token never goes into a log"
        assert g.lifecycle(key)["acked"] == [0] and not g.releasable(key)
        assert g.acked(7, 1, 1, token=t1) is True and g.releasable(key)
        assert g.stats().refused == {"ack_unauthorized": 3}


def test_an_ack_without_a_token_rests_on_the_word_of_whoever_sent_it() -> None:
    from kvlifetime.errors import UnauthorizedEvidence

    # Only the decode runs the guard: an ACK carries no token, and is taken on its word.
    g = decode()
    key = publish(g, ranks=(0, 1))
    g.armed(key, 1)
    assert g.acked(7, 1, 1) is True
    # Both sides run the guard (prefill_guarded): an ACK without the token is refused.
    g = SGLangGuard(role="decode", ledger_blocks=64, prefill_guarded=True)
    key = publish(g, ranks=(0, 1))
    g.armed(key, 1)
    refused(g, partial(g.acked, 7, 1, 1), UnauthorizedEvidence, "ack_unauthorized")
    bad: Any
    for bad in (b"\xff", 5, ["a"]):
        refused(g, partial(g.acked, 7, 1, 1, token=bad), UnauthorizedEvidence, "ack_unauthorized")
    assert g.lifecycle(key)["acked"] == []


def test_the_prefill_echoes_the_token_its_abort_carried() -> None:
    g = prefill()
    target = ("127.0.0.1", 9000, 3)  # the decode's ACK endpoint and the ABORT's generation
    assert g.echo_token(7, *target) is None
    tok = "ab" * 16
    assert g.abort_received(7, *target, token=tok) is True
    assert g.echo_token(7, *target) == tok
    assert g.echo_token(7, "127.0.0.1", 9000, 4) is None  # another generation: not this one
    for bad in ("zz", b"\xff", 5, "ab" * 40):
        refused(
            g,
            partial(g.abort_received, 7, *target, token=bad),
            InvalidField,
            "abort_token_refused",
        )
    assert g.echo_token(7, *target) == tok


# --------------------------------------------------------------------------- the engine table


def _watch(g: SGLangGuard) -> list[tuple[str, str, str]]:
    seen: list[tuple[str, str, str]] = []
    g._holds.observers.append(lambda r, a, e, b: seen.append((a, e, b)))
    return seen


def test_decode_lifecycles_step_exactly_the_engine_table() -> None:
    g = SGLangGuard(role="decode", ledger_blocks=64)
    seen = _watch(g)
    done = publish(g, room=5, slot=1)
    g.transferred(done)  # Success: every rank's transfer landed
    key = publish(g, ranks=(0, 1))
    g.armed(key, 1)
    assert g.acked(7, 0, 1, token=g.abort_token(key, 0)) is True  # while live: the ledger's
    assert g.held(key, deadline=30.0) is False
    assert g.acked(7, 1, 1, token=g.abort_token(key, 1)) is True
    assert g.releasable(key)
    g.freed(key)
    assert seen == [
        ("running", "load_granted", "loading"),
        ("loading", "load_landed", "load_received"),
        ("load_received", "finished", "ended"),
        ("ended", "handed_back", "handed_back"),
        ("running", "load_granted", "loading"),
        ("loading", "aborted", "withheld"),
        ("withheld", "load_landed", "withheld"),
        ("withheld", "released", "releasable"),
        ("releasable", "handed_back", "handed_back"),
    ]
    assert g._holds.refusals.counts == {} and "table_refused" not in g.stats().refused


def test_prefill_lifecycles_step_exactly_the_engine_table() -> None:
    g = SGLangGuard(role="prefill", ledger_blocks=64)
    seen = _watch(g)
    key = accepted(g.sending(None, 9, [1, 2]))
    assert g.sending(key, 9, [3]) == key  # a second chunk
    assert g.drained(key) is False  # live: the reads are over, the request runs on
    assert g.ended(key, now=0.0) is True
    g.freed(key)
    rows = {(r.source, r.event, r.target) for r in engine_table().rows}
    assert set(seen) <= rows
    assert seen == [
        ("running", "read_granted", "reading"),
        ("reading", "read_granted", "reading"),
        ("reading", "reads_done", "running"),
        ("running", "finished", "ended"),
        ("ended", "handed_back", "handed_back"),
    ]
    assert g._holds.refusals.counts == {}


def test_a_refused_signal_comes_back_as_data_of_the_core_kind() -> None:
    """One error policy: a signal from SGLang that proves nothing is a ``Refusal`` returned
    (counted, logged), of the kind its typed error stands for; ``accepted`` raises that error
    for a caller that wants it raised."""
    from kvlifetime.guard import RefusalKind

    g = SGLangGuard(role="decode", ledger_blocks=64, prefill_guarded=True)
    key = publish(g, ranks=(0, 1))
    g.armed(key, 1)
    token = g.abort_token(key, 0)
    assert token is not None
    cases: list[tuple[object, RefusalKind]] = [
        (g.acked(7, 0, 1, token="f" * 32), RefusalKind.UNAUTHORIZED),  # not rank 0's token
        (g.acked(7, 0, 5), RefusalKind.MISMATCHED),  # a generation never armed
        (g.acked(7, 5, 1, token=token), RefusalKind.MISMATCHED),  # not one of its ranks
        (g.engine_room("7", at="test"), RefusalKind.MALFORMED_VALUE),
        (g.transferred("sglang:7#99"), RefusalKind.UNKNOWN_ID),
        (g.freed(key), RefusalKind.OUT_OF_ORDER),  # not released: SGLang may not free it
    ]
    for out, kind in cases:
        assert isinstance(out, Refusal) and out.kind is kind, (out, kind)
    assert g.acked(7, 0, 1, token=token) is True
    g.held(key, deadline=5.0)
    assert g.acked(7, 1, 1, token=g.abort_token(key, 1)) is True
    g.freed(key)
    stale = g.acked(7, 1, 1, token="0" * 32)
    assert isinstance(stale, Refusal) and stale.kind is RefusalKind.STALE
    with pytest.raises(StaleEvidence):
        accepted(stale)


def test_a_deadline_of_infinity_is_none_and_the_acks_still_release_it() -> None:
    """SGLang's deferred-release timeout may be set to infinity: the hold has no deadline (it
    was refused once, and the lifecycle stayed live with its pages held for good)."""
    import math

    g = decode()
    key = publish(g, ranks=(0, 1))
    g.armed(key, 1)
    assert g.held(key, deadline=math.inf) is False
    assert g.lifecycle(key)["phase"] == "held" and g.tick(1e12) == []
    assert g.acked(7, 0, 1) is True and not g.releasable(key)
    assert g.acked(7, 1, 1) is True and g.releasable(key)
    assert g.stats().refused == {}
