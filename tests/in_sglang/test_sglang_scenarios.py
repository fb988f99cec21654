"""The hazards of SGLang 0.5.23's PD disaggregation, each run with SGLang alone and guarded, on
SGLang's own classes in two processes over Mooncake TCP (``sglang_rig``). Bytes are counted in
the pages: the prefill writes ``MARK`` into its source pages; after a hazard a later owner of
the freed pages writes its own pattern; every element equal to ``MARK`` found afterwards in the
later owner's pages is a byte of the old request that landed in someone else's KV.

The deferred-release timeout (``SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE_TIMEOUT``, 30 s
by default) is set to 0.5 s so a scenario takes seconds; the rule it drives is the same
(``ready = drained or now >= deadline``). Transfers are split into batches of 64 page indices
(``SGLANG_MOONCAKE_MAX_TRANSFER_BATCH_INDICES``, an SGLang setting) so the rig can hold one
mid-flight: 2 of the 4 batches of a 256-token request land, the other 2 wait at the gate.
"""

from __future__ import annotations

import time
from typing import Any

import pytest
from sglang_driver import Rig
from sglang_rig import elements_per_page

MARK = 7.0  # the prefill's bytes for the request under test
OWNER = -3.0  # the decode's later owner of the freed pages
PREFILL_OWNER = 5.0  # the prefill's later owner of its freed source pages
TOKENS = 256
BATCH = 64
TIMEOUT_S = 0.5
ENV = {
    "SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE_TIMEOUT": str(TIMEOUT_S),
    "SGLANG_MOONCAKE_MAX_TRANSFER_BATCH_INDICES": str(BATCH),
}
PER_PAGE = elements_per_page()
MODES = pytest.mark.parametrize("guarded", [False, True], ids=["alone", "guarded"])


def _rig(rigs: list[Rig], guarded: bool, env: dict[str, str] | None = None) -> Rig:
    rig = Rig(guarded=guarded, pool_tokens=1024, env={**ENV, **(env or {})})
    rigs.append(rig)
    return rig


def _published(rig: Rig, rid: str, room: int) -> list[int]:
    """Request ``rid`` admitted on both sides; the decode has published its destination pages
    to the prefill (it sits on the transfer queue); returns those pages."""
    rig.start(rid, room, TOKENS)
    rig.bootstrap_prefill(rid)
    rig.tick_until(rid, {"transfer"})
    pages: list[int] = rig.decode.call("request_pages", rid=rid)
    assert len(pages) == TOKENS
    return pages


def _stalled(rig: Rig, rid: str, room: int, poison: bool = False) -> list[int]:
    """The prefill's forward ran and its transfer is held mid-flight: half the batches landed
    in the decode's pages, the rest wait (and, with ``poison``, the held batch has already
    returned -1 to SGLang's transfer worker)."""
    pages = _published(rig, rid, room)
    rig.prefill.call("hold_transfers", after_batches=2, poison=poison)
    rig.prefill.call("forward", rid=rid, value=MARK)
    assert rig.prefill.call("wait_held")
    landed = rig.decode.call("count", pages=pages, value=MARK)
    assert landed == TOKENS // 2 * PER_PAGE, "half the request's bytes land before the stall"
    return pages


def _tick_for(rig: Rig, rid: str, seconds: float, until: set[str] | None = None) -> str:
    """Tick the decode for ``seconds`` (or until ``rid`` reaches a place in ``until``);
    returns where ``rid`` is."""
    end = time.monotonic() + seconds
    place = ""
    while time.monotonic() < end:
        place = str(rig.tick()["places"][rid])
        if until and place in until:
            return place
        time.sleep(0.01)
    return place


def _drain(rig: Rig, room: int) -> None:
    rig.prefill.call("release_transfers")
    rig.until(lambda: rig.prefill.call("outstanding", room=room) == 0, what="prefill drained")
    rig.prefill.call("wait_late_writes")


def _late(rig: Rig, old_pages: list[int], owner: str) -> dict[str, Any]:
    """How many of ``old_pages`` the later owner got, and the old request's elements in them."""
    owned = set(rig.decode.call("owner_pages", name=owner))
    taken = sorted(owned & set(old_pages))
    return {
        "taken": len(taken),
        "late_elements": rig.decode.call("count", pages=taken, value=MARK) if taken else 0,
    }


# ------------------------------------------------------------------------- happy paths


def _success(rig: Rig) -> dict[str, Any]:
    pages = _published(rig, "ok", 11)
    rig.prefill.call("forward", rid="ok", value=MARK)
    # Tick only once the decode's manager has the prefill's Success, so the tick count does not
    # depend on how long the bytes took.
    rig.until(lambda: rig.decode.call("status", room=11) == "Success", what="Success")
    ticks_before = rig.ticks
    state = rig.tick_until("ok", {"running"})
    done: list[str] = []

    def prefill_done() -> bool:
        done.extend(rig.prefill.call("poll_inflight"))
        return bool(done)

    rig.until(prefill_done, what="the prefill's inflight queue concluding the request")
    return {
        "ticks": rig.ticks - ticks_before,
        "received": rig.decode.call("count", pages=pages, value=MARK),
        "output": rig.decode.call("output", rid="ok"),
        "free_pages": state["free_pages"],
        "prefill_done": done,
        "prefill_free": rig.prefill.call("free_pages"),
    }


@MODES
def test_success(rigs: list[Rig], guarded: bool) -> None:
    """A whole transfer: the decode runs the request with every byte the prefill wrote; guarded,
    the same outputs after as many ticks (a Success poll is the proof that releases nothing
    early and holds nothing late)."""
    seen = _success(_rig(rigs, guarded))
    assert seen["received"] == TOKENS * PER_PAGE
    assert seen["prefill_done"] == ["ok"]
    assert seen["free_pages"] == 1024 - TOKENS
    assert seen["prefill_free"] == 1024  # the prefill freed its source pages after Success
    assert seen["output"]["output_ids"] == [(11 + TOKENS - 1) % 1000]
    assert seen["ticks"] == 1


def _prompt_ack(rig: Rig) -> dict[str, Any]:
    pages = _published(rig, "ab", 12)
    free_before = rig.tick()["free_pages"]
    ticks_before = rig.ticks
    start = time.monotonic()
    rig.decode.call("abort", rid="ab")
    # The prefill ACKs the abort's generation at once; tick once it is recorded, so the tick
    # count does not depend on the loopback's latency.
    rig.until(lambda: bool((rig.decode.call("acks", room=12) or {}).get("ranks")), what="ACK")
    place = _tick_for(rig, "ab", 5.0, until={"gone"})
    return {
        "place": place,
        "ticks": rig.ticks - ticks_before,
        "seconds": time.monotonic() - start,
        "freed": rig.tick()["free_pages"] - free_before,
        "pages": len(pages),
        "output": rig.decode.call("output", rid="ab"),
    }


@MODES
def test_abort_with_prompt_ack(rigs: list[Rig], guarded: bool) -> None:
    """Abort while the prefill has nothing in flight: it ACKs the abort's generation at once and
    the decode frees the pages in a few ticks, well before the timeout; guarded, the same."""
    seen = _prompt_ack(_rig(rigs, guarded))
    assert seen["place"] == "gone"
    assert seen["freed"] == TOKENS
    assert seen["seconds"] < TIMEOUT_S, "released on the ACK, not at the deadline"
    assert seen["ticks"] == 2  # the first holds the request, the second releases it


# ------------------------------------------------------------------------------ hazards


@MODES
def test_stalled_prefill_timeout(rigs: list[Rig], guarded: bool) -> None:
    """The prefill stalls mid-transfer, the decode aborts. Alone, SGLang releases the pages at
    its deadline without a drain ACK; a later owner takes them; the stalled transfer then lands
    in them. Guarded, the pages are quarantined past the deadline (the later owner gets none of
    them); a fence (the decode's transfer engine re-created) and ``revoke`` free them at the
    next tick; the later owner takes them, and the stalled transfer, resumed, lands nowhere."""
    rig = _rig(rigs, guarded)
    pages = _stalled(rig, "st", 21)
    start = time.monotonic()
    rig.decode.call("abort", rid="st")
    place = _tick_for(rig, "st", 4 * TIMEOUT_S, until={"gone"})
    waited = time.monotonic() - start
    if not guarded:
        assert place == "gone"
        assert TIMEOUT_S <= waited < 4 * TIMEOUT_S
    else:
        assert place == "held", "quarantined past the deadline"
        stats = rig.decode.call("guard_stats")
        assert stats["quarantined"] == 1
        assert stats["quarantined_pages"] == TOKENS
        assert rig.decode.call("new_owner", name="early", value=OWNER)["pages"] != []
        assert _late(rig, pages, "early")["taken"] == 0, "nobody gets quarantined pages"
        rig.decode.call("free_owner", name="early")
        fence = rig.decode.call("fence")
        assert fence["revoked"], "the fence released the quarantined request"
        assert _tick_for(rig, "st", 1.0, until={"gone"}) == "gone"
        assert rig.decode.call("guard_stats")["quarantined"] == 0
    rig.decode.call("new_owner", name="later", value=OWNER)
    _drain(rig, 21)
    seen = _late(rig, pages, "later")
    assert seen["taken"] == TOKENS
    if not guarded:
        assert seen["late_elements"] == TOKENS // 2 * PER_PAGE
    else:
        assert seen["late_elements"] == 0


@MODES
def test_prefill_failed_with_chunk_in_flight(rigs: list[Rig], guarded: bool) -> None:
    """The decode aborts while the prefill's transfer worker is inside the request's chunk. The
    prefill's poll reports Failed at once, and SGLang's Failed branch frees the source pages
    the worker is still reading; a later prefill request writes its own KV into them, and the
    worker sends that to the decode. Guarded, the source pages stay held until the worker has
    drained: the later request gets none of them, and the decode receives only the request's
    own bytes."""
    rig = _rig(rigs, guarded)
    decode_pages = _stalled(rig, "pf", 31)
    source = set(rig.prefill.call("forwarded_pages", rid="pf"))
    rig.decode.call("abort", rid="pf")
    rig.until(lambda: rig.prefill.call("poll", rid="pf") == "Failed", what="prefill Failed")
    concluded = rig.prefill.call("poll_inflight")
    assert concluded == ["pf"], "SGLang's inflight queue concludes a Failed request at once"
    assert rig.prefill.call("outstanding", room=31) == 1, "its chunk is still in flight"
    later = set(rig.prefill.call("new_owner", name="later", value=PREFILL_OWNER)["pages"])
    reused = len(later & source)
    _drain(rig, 31)
    _tick_for(rig, "pf", 1.0, until={"gone"})
    foreign = rig.decode.call("count", pages=decode_pages, value=PREFILL_OWNER)
    if not guarded:
        assert reused == TOKENS
        assert foreign == TOKENS // 2 * PER_PAGE
    else:
        assert reused == 0
        assert foreign == 0


def _quarantined_then_reused_after_fence(rig: Rig, rid: str, pages: list[int]) -> None:
    """Guarded: the request stays held past the deadline, quarantined; nobody gets its pages
    until a fence and ``revoke``; then they are freed at the next tick."""
    stats = rig.decode.call("guard_stats")
    assert stats["quarantined"] == 1, stats
    assert stats["quarantined_pages"] == TOKENS
    rig.decode.call("new_owner", name="early", value=OWNER)
    assert _late(rig, pages, "early")["taken"] == 0, "nobody gets quarantined pages"
    rig.decode.call("free_owner", name="early")
    assert rig.decode.call("fence")["revoked"]
    assert _tick_for(rig, rid, 1.0, until={"gone"}) == "gone"
    assert rig.decode.call("guard_stats")["quarantined"] == 0


@MODES
def test_poisoned_room(rigs: list[Rig], guarded: bool) -> None:
    """A batch of the transfer returns -1 while it keeps running (Mooncake's sync call on its
    timeout). SGLang's prefill poisons the room: it reports Failed and never ACKs the decode's
    abort, so the decode only times out. Alone, it releases anyway and the running batch lands
    in the later owner's pages. Guarded, quarantined until a fence; after the fence it lands
    nowhere."""
    rig = _rig(rigs, guarded)
    pages = _stalled(rig, "po", 61, poison=True)
    rig.until(lambda: rig.decode.call("status", room=61) == "Failed", what="decode Failed")
    place = _tick_for(rig, "po", 4 * TIMEOUT_S, until={"gone"})
    assert rig.decode.call("acks", room=61) in (None, {"generation": 1, "ranks": []})
    if not guarded:
        assert place == "gone"
    else:
        assert place == "held"
        _quarantined_then_reused_after_fence(rig, "po", pages)
    rig.decode.call("new_owner", name="later", value=OWNER)
    _drain(rig, 61)
    seen = _late(rig, pages, "later")
    assert seen["taken"] == TOKENS
    # The poisoned batch (64 pages) was the one still running; the worker sent no more.
    assert seen["late_elements"] == (0 if guarded else BATCH * PER_PAGE)


HEARTBEAT = {
    "SGLANG_DISAGGREGATION_HEARTBEAT_INTERVAL": "2",  # SGLang's minimum
    "SGLANG_DISAGGREGATION_HEARTBEAT_MAX_FAILURE": "1",
}


@MODES
def test_lost_prefill_killed(rigs: list[Rig], guarded: bool) -> None:
    """The prefill process dies mid-transfer. The decode's heartbeat marks its rooms Failed; no
    ACK can come; alone, SGLang releases the pages at the deadline on no evidence at all.
    Guarded, the loss of the peer proves nothing about what it left in flight: quarantined
    until a fence."""
    rig = _rig(rigs, guarded, env=HEARTBEAT)
    pages = _stalled(rig, "lk", 71)
    rig.prefill.kill()
    waited = rig.until(
        lambda: rig.decode.call("status", room=71) == "Failed", timeout=10.0, what="lost"
    )
    place = _tick_for(rig, "lk", 4 * TIMEOUT_S, until={"gone"})
    if not guarded:
        assert place == "gone"
    else:
        assert place == "held"
        assert rig.decode.call("guard_stats")["quarantine_reasons"], "a reason is given"
        _quarantined_then_reused_after_fence(rig, "lk", pages)
    assert waited < 6.0


@MODES
def test_lost_prefill_hung(rigs: list[Rig], guarded: bool) -> None:
    """The prefill hangs (SIGSTOP) mid-transfer: the decode's heartbeat loses it and marks the
    room Failed; alone, the pages are released at the deadline and the prefill, resumed, writes
    the rest of its transfer into the later owner's pages. Guarded: quarantined, none."""
    rig = _rig(rigs, guarded, env=HEARTBEAT)
    pages = _stalled(rig, "lh", 72)
    rig.prefill.freeze()
    rig.until(lambda: rig.decode.call("status", room=72) == "Failed", timeout=15.0, what="lost")
    place = _tick_for(rig, "lh", 4 * TIMEOUT_S, until={"gone"})
    if not guarded:
        assert place == "gone"
    else:
        assert place == "held"
    rig.decode.call("new_owner", name="later", value=OWNER)
    rig.prefill.thaw()
    _drain(rig, 72)
    seen = _late(rig, pages, "later")
    if not guarded:
        assert seen == {"taken": TOKENS, "late_elements": TOKENS // 2 * PER_PAGE}
    else:
        assert seen == {"taken": 0, "late_elements": 0}


@MODES
def test_abort_before_the_pages_were_published(rigs: list[Rig], guarded: bool) -> None:
    """Aborted while still on the prealloc queue (no pages allocated, nothing sent to the
    prefill): SGLang drops it at the next tick; guarded, the same (there is no grant to hold)."""
    rig = _rig(rigs, guarded)
    rig.decode.call("admit", rid="ea", room=81, tokens=TOKENS)
    free_before = rig.decode.call("where")["free_pages"]
    rig.decode.call("abort", rid="ea")
    ticks_before = rig.ticks
    place = _tick_for(rig, "ea", 2.0, until={"gone"})
    assert place == "gone"
    assert rig.ticks - ticks_before == 1
    assert rig.decode.call("where")["free_pages"] == free_before == 1024
    if guarded:
        stats = rig.decode.call("guard_stats")
        assert stats["held"] == 0 and stats["quarantined"] == 0


@MODES
def test_abort_ack_of_an_old_generation_after_the_room_is_reused(
    rigs: list[Rig], guarded: bool
) -> None:
    """Request A uses room R, is aborted (generation 1), drains and is released. Request B then
    uses room R, stalls mid-transfer and is aborted (generation 2). An ABORT_ACK of generation 1
    arriving now (sent by the prefill's own ACK path) says nothing about B: SGLang ignores it,
    and so does the guard; B is held until its own ACK, then released."""
    rig = _rig(rigs, guarded)
    room = 91
    _stalled(rig, "g1", room)
    rig.decode.call("abort", rid="g1")
    _drain(rig, room)
    assert _tick_for(rig, "g1", 2.0, until={"gone"}) == "gone"
    assert rig.prefill.call("poll_inflight") == ["g1"]
    assert rig.prefill.call("room_status", room=room) == "none", "the prefill let the room go"
    pages = _stalled(rig, "g2", room)
    rig.decode.call("abort", rid="g2")
    assert _tick_for(rig, "g2", 0.1) == "held"
    armed = rig.decode.call("acks", room=room)
    assert armed is not None and armed["ranks"] == []
    assert rig.prefill.call("send_stale_ack", room=room, generation=armed["generation"] - 1)
    if guarded:
        # The stale ACK, refused (StaleEvidence) and counted: the one refusal expected.
        rig.expected_refusals = {"decode": {"ack_refused": 1}}
    place = _tick_for(rig, "g2", TIMEOUT_S / 2)
    assert place == "held", "an ACK of the old generation released nothing"
    assert rig.decode.call("acks", room=room)["ranks"] == []
    rig.decode.call("new_owner", name="meanwhile", value=OWNER)
    assert _late(rig, pages, "meanwhile")["taken"] == 0
    rig.decode.call("free_owner", name="meanwhile")
    _drain(rig, room)
    assert _tick_for(rig, "g2", 2.0, until={"gone"}) == "gone"


def _two_ranks_rank1_stalled(rig: Rig, rid: str, room: int) -> list[int]:
    """Two prefill TP ranks (two processes; each sends its half of the KV heads): rank 0's
    transfer completes, rank 1's is held before its first batch. Returns the decode's pages."""
    pages = _published(rig, rid, room)
    rig.prefills[1].call("hold_transfers", after_batches=0)
    rig.prefill_all("forward", rid=rid, value=MARK)
    assert rig.prefills[1].call("wait_held")
    # Rank 0's transfer observed complete: its worker concluded the room Success (after every
    # batch of its KV returned, then the metadata slot's write), not merely "nothing
    # outstanding" (also true before its worker took the chunk).
    rig.until(lambda: rig.prefills[0].call("room_status", room=room) == "Success", what="rank 0")
    assert rig.decode.call("count", pages=pages, value=MARK) == TOKENS * PER_PAGE // 2
    return pages


def _rank1_drained(rig: Rig, room: int) -> None:
    """Rank 1's held transfer let go, and observed ended: its chunk, outstanding while held,
    is uncounted only once every batch of it has returned."""
    assert rig.prefills[1].call("outstanding", room=room) == 1, "rank 1's chunk is in flight"
    rig.prefills[1].call("release_transfers")
    rig.until(lambda: rig.prefills[1].call("outstanding", room=room) == 0, what="rank 1 sent")


@MODES
def test_two_prefill_ranks_where_one_acks(rigs: list[Rig], guarded: bool) -> None:
    """A prefill of two TP ranks (two processes, one gloo group; each sends its half of the KV
    heads). Rank 0 finishes its half; rank 1 stalls before sending anything. The decode aborts:
    rank 0 ACKs, rank 1 cannot. One ACK of two proves nothing about rank 1: alone, SGLang waits
    for both until the deadline, then releases anyway and rank 1's half lands in the later
    owner's pages. Guarded, quarantined: none."""
    rig = Rig(guarded=guarded, pool_tokens=1024, env=ENV, prefill_ranks=2)
    rigs.append(rig)
    room = 101
    pages = _two_ranks_rank1_stalled(rig, "tr", room)
    rig.decode.call("abort", rid="tr")
    rig.until(lambda: (rig.decode.call("acks", room=room) or {}).get("ranks") == [0], what="rank 0")
    place = _tick_for(rig, "tr", 4 * TIMEOUT_S, until={"gone"})
    assert rig.decode.call("acks", room=room) in (None, {"generation": 1, "ranks": [0]})
    rig.decode.call("new_owner", name="later", value=OWNER)
    _rank1_drained(rig, room)
    seen = _late(rig, pages, "later")
    half = TOKENS * PER_PAGE // 2
    if not guarded:
        assert place == "gone"
        assert seen == {"taken": TOKENS, "late_elements": half}
    else:
        assert place == "held"
        assert seen == {"taken": 0, "late_elements": 0}


@MODES
def test_a_prefill_rank_acks_in_another_ranks_name(rigs: list[Rig], guarded: bool) -> None:
    """Two prefill TP ranks; rank 1 stalls mid-transfer, the decode aborts, rank 0 ACKs its own
    part, then ACKs again in rank 1's name with the current generation (SGLang's ACK names its
    rank as a number in the message; the decode reads every ACK from one socket). Alone, SGLang
    counts both ranks and frees the pages; a new owner takes them and rank 1's late half lands
    in them. Guarded on both sides (``prefill_guarded``), each rank's ABORT carried a token of
    its own: the lie echoes rank 0's, and is refused (unauthorized, counted); the hold stays
    until rank 1's own ACK, and no byte of rank 1's transfer lands in a new owner's pages."""
    rig = Rig(
        guarded=guarded,
        pool_tokens=1024,
        env=ENV,
        prefill_ranks=2,
        guard_options={"decode": {"prefill_guarded": True}},
    )
    rigs.append(rig)
    room = 111
    pages = _two_ranks_rank1_stalled(rig, "ly", room)
    rig.decode.call("abort", rid="ly")
    rig.until(lambda: (rig.decode.call("acks", room=room) or {}).get("ranks") == [0], what="rank 0")
    generation = rig.decode.call("acks", room=room)["generation"]
    endpoint = rig.decode.call("ack_endpoint")
    echoed = rig.prefills[0].call(
        "send_ack_as", room=room, rank=1, generation=generation, **endpoint
    )
    assert echoed is guarded
    if not guarded:
        rig.until(
            lambda: rig.decode.call("acks", room=room)["ranks"] == [0, 1], what="the lie counted"
        )
        assert _tick_for(rig, "ly", 2.0, until={"gone"}) == "gone", "freed on the lie"
    else:
        rig.expected_refusals = {"decode": {"ack_unauthorized": 1}}
        rig.until(
            lambda: rig.decode.call("guard_stats")["refused"] == {"ack_unauthorized": 1},
            what="the lie refused",
        )
        assert rig.decode.call("acks", room=room)["ranks"] == [0], "SGLang's count never saw it"
        assert _tick_for(rig, "ly", 4 * TIMEOUT_S, until={"gone"}) == "held"
    rig.decode.call("new_owner", name="meanwhile", value=OWNER)
    _rank1_drained(rig, room)
    meanwhile = _late(rig, pages, "meanwhile")
    half = TOKENS * PER_PAGE // 2
    if not guarded:
        assert meanwhile == {"taken": TOKENS, "late_elements": half}
        return
    assert meanwhile == {"taken": 0, "late_elements": 0}
    rig.decode.call("free_owner", name="meanwhile")
    # Rank 1's own ACK (its token) is the proof: released at the next ticks, not by a fence.
    assert _tick_for(rig, "ly", 5.0, until={"gone"}) == "gone"
    assert rig.decode.call("guard_stats")["quarantined"] == 0
    rig.decode.call("new_owner", name="later", value=OWNER)
    assert _late(rig, pages, "later") == {"taken": TOKENS, "late_elements": 0}
