"""BlockLedger(counts="engine"): the engine's own reference counts decide when a block is free;
the ledger guards exposure only (docs/ledger-api.md, "Whose counts"). Also ``open_access`` in
both modes.

Each refusal is checked to change nothing (``fingerprint()`` before and after).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from ledger_helpers import QQ, D, F, O, Q, X, assert_whole_state

from kvlifetime import errors
from kvlifetime.evidence import AccessRevoked, SchedulingStopped, TransferCompleted
from kvlifetime.grant import Access
from kvlifetime.ledger import BlockLedger, Counts
from kvlifetime.spec.vocabulary import RequestState

R = RequestState
W, RD = Access.WRITE, Access.READ


@pytest.fixture(params=[False, True], ids=["fast", "checked"])
def checked(request: pytest.FixtureRequest) -> bool:
    return bool(request.param)


def engine(n: int = 8, *, checked: bool = False) -> BlockLedger:
    return BlockLedger(n, checked=checked, incarnation="inc", counts="engine")


def refused(L: BlockLedger, exc: type[Exception], call: Callable[[], object]) -> str:
    before = L.fingerprint(), L.stats(), L.open_access(np.arange(L.num_blocks))
    with pytest.raises(exc) as info:
        call()
    after = L.fingerprint(), L.stats(), L.open_access(np.arange(L.num_blocks))
    assert before[:2] == after[:2] and before[2].tolist() == after[2].tolist()
    return str(info.value)


# =========================================================================== the mode


def test_counts_is_stored_and_defaults_to_the_ledger() -> None:
    assert BlockLedger(4).counts == "ledger"
    assert BlockLedger(4, counts="ledger").counts == "ledger"
    assert engine().counts == "engine"
    # Two ledgers in different modes never have the same fingerprint.
    assert BlockLedger(4, incarnation="i").fingerprint() != (
        BlockLedger(4, incarnation="i", counts="engine").fingerprint()
    )


@pytest.mark.parametrize("bad", ["owner", "ENGINE", "", None, 1, True, ["engine"], b"engine"])
def test_counts_refuses_anything_else(bad: Any) -> None:
    with pytest.raises(errors.InvalidField):
        BlockLedger(4, counts=bad)
    with pytest.raises(errors.InvalidField):
        BlockLedger.after_restart(4, peers=["p"], counts=bad)


def test_copy_and_after_restart_carry_the_mode() -> None:
    L = engine()
    L.acquire("a", [0])
    c = L.copy()
    assert c.counts == "engine" and c.fingerprint() == L.fingerprint()
    c.acquire("b", [0])  # independent
    assert L.holders([0]).tolist() == [1] and c.holders([0]).tolist() == [2]
    r = BlockLedger.after_restart(4, peers=["p", "q"], exposed=[1, 2], counts="engine")
    assert r.counts == "engine" and r.copy().counts == "engine"
    assert BlockLedger.after_restart(4, peers=["p"]).counts == "ledger"


def test_engine_mode_memory_per_block() -> None:
    """No exclusive owner and no free list: holders (2), generation (4), the open write and
    read grant counters (1 + 1)."""
    L = engine(1000)
    inside = L.inspect()
    assert inside.owner is None and inside.free_stack is None
    per_block = inside.nbytes / 1000
    assert per_block == 8
    owner = BlockLedger(1000)
    owner.allocate("x", 1)
    assert owner.inspect().free_stack is not None
    per_block_owner = owner.inspect().nbytes / 1000
    assert per_block_owner == 16


# =========================================================================== acquire


@pytest.mark.parametrize("shared", [False, True])
def test_any_number_of_requests_may_hold_a_block(shared: bool, checked: bool) -> None:
    L = engine(4, checked=checked)
    L.acquire("a", [0, 1], shared=shared)
    L.acquire("b", [1, 2], shared=not shared)  # the flag makes no difference
    L.acquire("c", [1])
    assert L.blocks_of("b").tolist() == [1, 2]
    assert_whole_state(
        L,
        requests={"a": R.ADMITTED, "b": R.ADMITTED, "c": R.ADMITTED},
        blocks=[O, O, O, F],
        holders=[1, 3, 1, 0],
        generations=[0, 0, 0, 0],
    )


def test_acquire_refusals_change_nothing() -> None:
    L = engine(8)
    L.acquire("w", [0, 1])
    L.grant("w", "p", [0], W)  # open write grant on 0, holder running
    L.acquire("d", [2])
    L.grant("d", "p", [2], W)
    L.finish("d")  # draining under a write grant
    L.acquire("a", [3])
    assert_whole_state(
        L,
        requests={"w": R.ADMITTED, "d": R.FINISHED, "a": R.ADMITTED},
        blocks=[X, O, D, O] + [F] * 4,
    )
    for req, ids in [("s", [0]), ("s", [2]), ("s", [4, 0]), ("a", [2])]:
        msg = refused(L, errors.BlockUnavailable, functools.partial(L.acquire, req, ids))
        assert "open write grant" in msg
        share = functools.partial(L.acquire, req, ids, shared=True)
        refused(L, errors.BlockUnavailable, share)
    msg = refused(L, errors.BlockUnavailable, lambda: L.acquire("a", [4, 3]))  # holds 3
    assert "already holds" in msg
    refused(L, errors.BlockUnavailable, lambda: L.acquire("w", [1], shared=True))
    refused(L, errors.IllegalTransition, lambda: L.acquire("d", [5]))  # ended
    refused(L, errors.DuplicateBlockIds, lambda: L.acquire("s", [5, 5]))
    refused(L, errors.BlockOutOfRange, lambda: L.acquire("s", [8]))
    assert "s" not in L.live_requests()


def test_blocks_of_an_ended_holder_under_read_grants_may_be_held(checked: bool) -> None:
    L = engine(4, checked=checked)
    L.acquire("d", [0])
    gd = L.grant("d", "p", [0], RD)
    L.finish("d")  # draining under a read grant
    L.acquire("q", [1])
    L.grant("q", "p", [1], RD, deadline=1.0)
    L.reject("q")
    assert L.expire(2.0) == ["q"]  # quarantined under a read grant
    assert_whole_state(L, requests={"d": R.FINISHED, "q": R.QUARANTINED}, blocks=[D, QQ, F, F])
    L.acquire("s", [0, 1])
    assert_whole_state(
        L,
        requests={"d": R.FINISHED, "q": R.QUARANTINED, "s": R.ADMITTED},
        blocks=[X, X, F, F],
        holders=[2, 2, 0, 0],
    )
    L.apply(TransferCompleted.of(gd, 1))
    assert {k: v.tolist() for k, v in L.collect_releasable().items()} == {"d": [0]}
    assert L.holders([0]).tolist() == [1]
    assert L.generation([0]).tolist() == [0]  # s still holds it: still guarded


def test_holder_limit() -> None:
    L = engine(4)
    L.MAX_SHARERS = 3  # the real limit is the uint16 counter's, 65,535
    for k in ("a", "b", "c"):
        L.acquire(k, [0])
    L.acquire("d", [1])
    msg = refused(L, errors.HolderLimit, lambda: L.acquire("d", [0]))
    assert "3 holders" in msg
    L.finish("a")
    assert L.release("a").tolist() == [0]
    L.acquire("d", [0])
    assert L.holders([0, 1]).tolist() == [3, 1]


def test_holder_limit_is_the_counters() -> None:
    L = engine(2)
    for i in range(BlockLedger.MAX_SHARERS):
        L.acquire(i, [0])
    refused(L, errors.HolderLimit, lambda: L.acquire("one-too-many", [1, 0]))
    assert L.holders([0, 1]).tolist() == [BlockLedger.MAX_SHARERS, 0]


def test_allocate_is_refused() -> None:
    L = engine(4)
    L.acquire("a", [0])
    for call in (lambda: L.allocate("a", 1), lambda: L.allocate("new", 0)):
        msg = refused(L, errors.WrongCountsMode, call)  # a set-up mistake, not a busy block
        assert "engine's allocator hands out blocks" in msg
        assert not isinstance(errors.WrongCountsMode(msg), errors.BlockError)
    # Its arguments are still checked first.
    refused(L, errors.InvalidField, lambda: L.allocate("new", -1))
    assert L.inspect().free_stack is None and "new" not in L.live_requests()


# =========================================================================== grant


def test_write_grant_refusals_change_nothing() -> None:
    L = engine(8)
    L.acquire("a", [0, 1, 2, 3])
    L.acquire("b", [1])  # another holder of 1
    L.grant("a", "p", [2], RD)  # an open read grant on 2, its own
    L.acquire("c", [4])
    L.grant("c", "q", [4], RD)
    L.acquire("a", [4])  # a holds 4 too, c's read grant covers it
    L.finish("c")
    L.acquire("w", [5])
    L.grant("w", "p", [5], W)  # an open write grant on 5, its own
    cases = [
        ("a", [0, 1], "another request holds"),
        ("a", [4], "another request holds"),  # c ended, still holds it (its grant is open)
        ("a", [2], "an open grant covers"),  # its own open read grant
        ("w", [5], "an open grant covers"),  # its own open write grant
    ]
    for req, ids, why in cases:
        msg = refused(L, errors.BlockUnavailable, functools.partial(L.grant, req, "p2", ids, W))
        assert why in msg, (req, ids)
    refused(L, errors.BlockUnavailable, lambda: L.grant("a", "p", [7], W))  # not held
    refused(L, errors.IllegalTransition, lambda: L.grant("c", "p", [4], RD))  # ended
    g = L.grant("a", "p", [0, 3], W)  # a alone holds them, nothing open
    assert g.id.serial == 4  # refusals consumed no serial


def test_read_grants() -> None:
    L = engine(4)
    L.acquire("a", [0, 1])
    L.acquire("b", [1])
    ga = L.grant("a", "p", [0, 1], RD)
    gb = L.grant("b", "q", [1], RD)  # any number of read grants, of any holder
    L.grant("a", "q", [0], RD)
    L.acquire("w", [2])
    L.grant("w", "p", [2], W)
    L.grant("w", "q", [2], RD)  # beside its own open write grant: allowed
    # Another request's open write grant cannot cover a block this one holds: no one may hold
    # a block under an open write grant, and a write grant needs a single holder.
    refused(L, errors.BlockUnavailable, lambda: L.acquire("x", [2]))
    assert L.open_access([0, 1, 2, 3]).tolist() == [1, 1, 2, 0]
    assert [g.access for g in L.open_grants("a")] == [RD, RD]
    assert ga.blocks.tolist() == [0, 1] and gb.blocks.tolist() == [1]


# =========================================================================== release


@pytest.mark.parametrize("how", ["release", "collect", "force"])
def test_release_returns_every_block_held(how: str, checked: bool) -> None:
    L = engine(6, checked=checked)
    L.acquire("a", [0, 1])
    L.acquire("a", [2])
    L.acquire("b", [1, 3])
    g = L.grant("a", "p", [0, 2], W)
    L.reject("a")
    L.apply(SchedulingStopped.of(g, 0))
    assert L.state("a") is R.TRANSFER_QUIESCED
    if how == "release":
        got = L.release("a")
    elif how == "collect":
        freed = L.collect_releasable()
        assert list(freed) == ["a"]
        got = freed["a"]
    else:
        got = L.force_release("a", "clean")
    assert sorted(got.tolist()) == [0, 1, 2]  # what the engine may drop its references to
    assert_whole_state(
        L,
        requests={"b": R.ADMITTED},
        blocks=[F, O, F, O, F, F],
        holders=[0, 1, 0, 1, 0, 0],
        generations=[1, 0, 1, 0, 0, 0],  # bumped where no request holds it any more
    )
    assert L.stats().unsafe_releases == 0
    L.finish("b")
    assert sorted(L.release("b").tolist()) == [1, 3]
    assert L.generation([0, 1, 2, 3]).tolist() == [1, 1, 1, 1]
    refused(L, errors.DoubleRelease, lambda: L.release("b"))


def test_collect_releasable_bumps_a_block_two_requests_held_once() -> None:
    L = engine(4)
    L.acquire("a", [0, 1])
    L.acquire("b", [1, 2])
    L.finish("a")
    L.finish("b")
    got = {k: sorted(v.tolist()) for k, v in L.collect_releasable().items()}
    assert got == {"a": [0, 1], "b": [1, 2]}
    assert_whole_state(L, requests={}, blocks=[F] * 4, generations=[1, 1, 1, 0])


def test_release_needs_proof_and_force_release_is_unsafe() -> None:
    L = engine(4)
    L.acquire("a", [0, 1])
    L.acquire("s", [1])
    g = L.grant("a", "p", [0], W)
    L.reject("a")
    assert_whole_state(
        L, requests={"a": R.REJECTED, "s": R.ADMITTED}, blocks=[D, O, F, F], holders=[1, 2, 0, 0]
    )
    refused(L, errors.InsufficientEvidence, lambda: L.release("a"))
    refused(L, errors.IllegalTransition, lambda: L.release("s"))  # still running
    assert sorted(L.force_release("a", "operator").tolist()) == [0, 1]
    assert L.stats().unsafe_releases == 1
    assert_whole_state(L, requests={"s": R.ADMITTED}, blocks=[F, O, F, F], generations=[1, 0, 0, 0])
    assert L.open_access([0, 1]).tolist() == [0, 0]  # its grant is forgotten with it
    assert g.blocks.tolist() == [0]


def test_fence_and_reclaimed_blocks_in_engine_mode() -> None:
    L = engine(4)
    L.acquire("a", [0, 1])
    L.acquire("s", [1])
    L.grant("a", "p", [0, 1], RD, deadline=1.0)
    L.reject("a")
    assert L.expire(2.0) == ["a"]
    assert_whole_state(L, requests={"a": R.QUARANTINED, "s": R.ADMITTED}, blocks=[QQ, X, F, F])
    L.apply(AccessRevoked("p", fence="test_fence"))
    assert {k: sorted(v.tolist()) for k, v in L.collect_releasable().items()} == {"a": [0, 1]}
    # Only block 0 is no longer guarded (s still holds 1).
    assert L.stats().reclaimed_blocks == {"test_fence": 1}


def test_after_restart_in_engine_mode() -> None:
    L = BlockLedger.after_restart(4, peers=["p", "q"], exposed=[1, 2], counts="engine")
    req = "previous-incarnation"
    assert_whole_state(L, requests={req: R.QUARANTINED}, blocks=[F, QQ, QQ, F])
    assert [g.access for g in L.open_grants(req)] == [W, W]
    assert L.open_access([0, 1, 2, 3]).tolist() == [0, 2, 2, 0]
    refused(L, errors.BlockUnavailable, lambda: L.acquire("new", [1]))
    L.acquire("new", [0, 3])  # what was not exposed is the engine's to use
    L.apply(AccessRevoked("p", fence="f"))
    assert L.collect_releasable() == {}
    L.apply(AccessRevoked("q", fence="f"))
    assert {k: v.tolist() for k, v in L.collect_releasable().items()} == {req: [1, 2]}
    assert L.generation([0, 1, 2, 3]).tolist() == [0, 1, 1, 0]


# =========================================================================== block states


def test_every_block_state_in_engine_mode(checked: bool) -> None:
    L = engine(6, checked=checked)
    L.acquire("own", [0])
    L.acquire("exp", [1])
    L.grant("exp", "p", [1], W)
    L.acquire("dr", [2])
    L.grant("dr", "p", [2], RD)
    L.finish("dr")
    L.acquire("qs", [3])
    L.finish("qs")
    L.acquire("qq", [4])
    L.grant("qq", "p", [4], W, deadline=1.0)
    L.reject("qq")
    L.expire(5.0)
    assert_whole_state(
        L,
        requests={
            "own": R.ADMITTED,
            "exp": R.ADMITTED,
            "dr": R.FINISHED,
            "qs": R.TRANSFER_QUIESCED,
            "qq": R.QUARANTINED,
        },
        blocks=[O, X, D, Q, QQ, F],
    )
    assert L.open_access(np.arange(6)).tolist() == [0, 2, 1, 0, 2, 0]


# =========================================================================== open_access


@pytest.mark.parametrize("counts", ["ledger", "engine"])
def test_open_access_follows_open_grants(counts: Counts) -> None:
    L = BlockLedger(6, incarnation="inc", counts=counts)
    L.acquire("a", [0, 1, 2])
    assert L.open_access([0, 1, 2, 5]).tolist() == [0, 0, 0, 0]
    gw = L.grant("a", "p", [0], W)
    gr = L.grant("a", "q", [1, 2], RD)
    gr2 = L.grant("a", "q", [2], RD)
    got = L.open_access([2, 1, 0, 5])
    assert got.dtype == np.uint8 and got.tolist() == [1, 1, 2, 0]
    assert (BlockLedger.OPEN_NONE, BlockLedger.OPEN_READ, BlockLedger.OPEN_WRITE) == (0, 1, 2)
    L.reject("a")  # ended: its grants are still open
    assert L.open_access([0, 1, 2]).tolist() == [2, 1, 1]
    L.apply(TransferCompleted.of(gr, 0))
    assert L.open_access([0, 1, 2]).tolist() == [2, 0, 1]
    L.apply(TransferCompleted.of(gw, 0))
    L.apply(TransferCompleted.of(gr2, 0))
    assert L.open_access([0, 1, 2]).tolist() == [0, 0, 0]
    assert L.open_access([]).tolist() == []


def test_open_access_builds_the_counters_once_in_owner_mode() -> None:
    """A ledger that never shared keeps no counters; the first open_access builds them from the
    open grants (and changes nothing observable), then they are kept up to date."""
    L = BlockLedger(4, incarnation="inc")
    L.acquire("a", [0, 1])
    L.grant("a", "p", [0], W)
    L.grant("a", "p", [0, 1], RD)
    assert not L.inspect().tracking
    before = L.fingerprint(), L.stats()
    assert L.open_access([0, 1, 2]).tolist() == [2, 1, 0]
    assert L.inspect().tracking and (L.fingerprint(), L.stats()) == before
    g = L.grant("a", "q", [1], W)
    assert L.open_access([1]).tolist() == [2]
    L.apply(TransferCompleted.of(g, 0))
    assert L.open_access([1]).tolist() == [1]


def test_open_access_refuses_bad_ids_and_changes_nothing() -> None:
    for counts in ("ledger", "engine"):
        L = BlockLedger(4, incarnation="inc", counts=counts)
        L.acquire("a", [0])
        L.grant("a", "p", [0], RD)
        for bad, exc in [
            ([0, 0], errors.DuplicateBlockIds),
            ([4], errors.BlockOutOfRange),
            ([0.0], errors.InvalidBlockIds),
            (None, errors.InvalidBlockIds),
            (np.array([[0]]), errors.InvalidBlockIds),
        ]:
            before = L.fingerprint(), L.inspect().tracking
            with pytest.raises(exc):
                L.open_access(bad)  # type: ignore[arg-type]
            assert (L.fingerprint(), L.inspect().tracking) == before


def test_grant_counters_widen_before_they_could_wrap() -> None:
    """uint8 counters: 300 open read grants on one block widen ``_readers`` to uint16 first;
    the write counter stays narrow."""
    for counts in ("ledger", "engine"):
        L = BlockLedger(2, counts=counts)
        L.acquire("a", [0, 1])
        L.open_access([0])  # keeps the counters from here on
        held = L.blocks_of("a")
        for _ in range(300):
            L.grant("a", "p", held[:1], RD)
        inside = L.inspect()
        assert inside.readers.dtype == np.uint16 and int(inside.readers[0]) == 300
        assert inside.unsettled.dtype == np.uint8
        assert L.open_access([0, 1]).tolist() == [1, 0]
        L.apply(AccessRevoked("p"))
        assert int(L.inspect().readers[0]) == 0 and L.open_access([0]).tolist() == [0]
