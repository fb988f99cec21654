"""The sharing rules of the block lifecycle (docs/contract.md), each pinned by several fixed tests.

Found by mutating the ledger (issue 20, item 12): with the refusal of a write grant on blocks
``acquire_and_grant(..., shared=True)`` would share removed, only a random test failed (about one
run in four); a write grant beside one sharer and the holder limit on a block taken by several
requests of one ``acquire_many`` were each pinned by one test. Here every rule has fixed tests in
both counts modes, through the single calls and the batch calls, and each refusal is checked
against the whole observable state: it changes nothing, for anyone.

- A write grant on a block with more than one holder is refused; so is one on a block the
  request holds shared (with the ledger's counts), also when it shares it with one other holder.
- ``acquire_and_grant(..., access=WRITE)`` refuses what ``acquire`` then ``grant`` would: a write
  grant on blocks it would share.
- ``acquire_many`` counts a block taken by several of its requests once per request against the
  holder limit, and refuses at the limit (the uint16 counter would wrap otherwise).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import numpy as np
import pytest
from ledger_helpers import F, O, X, assert_whole_state

from kvlifetime import errors
from kvlifetime.evidence import TransferCompleted
from kvlifetime.grant import Access, RequestKey
from kvlifetime.ledger import COUNTS, BlockLedger, Counts
from kvlifetime.spec.vocabulary import RequestState as R

Hold = Callable[[BlockLedger, RequestKey, list[int]], None]


# --------------------------------------------------------------------------- helpers


def snapshot(L: BlockLedger) -> tuple[Any, ...]:
    """Everything observable through the public API (grant serials included)."""
    ids = np.arange(L.num_blocks, dtype=np.int64)
    live = L.live_requests()
    return (
        L.fingerprint(),
        L.stats(),
        L.block_state(ids).tolist(),
        L.holders(ids).tolist(),
        L.generation(ids).tolist(),
        L.open_access(ids).tolist(),
        L.free_count(),
        sorted(map(repr, live)),
        sorted(
            (
                repr(k),
                L.state(k).value,
                sorted(L.blocks_of(k).tolist()),
                [g.describe() for g in L.open_grants(k)],
            )
            for k in live
        ),
    )


def refused(
    L: BlockLedger, exc: type[errors.KVLifetimeError], call: Callable[[], object], match: str
) -> errors.KVLifetimeError:
    """``call`` raises ``exc`` (its message names the rule: ``match``) and changes nothing."""
    before = snapshot(L)
    with pytest.raises(exc, match=match) as info:
        call()
    assert snapshot(L) == before
    return info.value


def let_go(L: BlockLedger, key: RequestKey) -> None:
    """The request ends normally: finished, its open grants proven over, released."""
    L.finish(key)
    for g in L.open_grants(key):
        L.apply(TransferCompleted.of(g, 1))
    L.release(key)


def ledger(counts: Counts, n: int = 4) -> BlockLedger:
    return BlockLedger(n, incarnation="rules", counts=counts)


# How the first holder takes its blocks (exclusively, with the ledger's counts).
def _first_by_allocate(L: BlockLedger, key: RequestKey, ids: list[int]) -> None:
    got = L.allocate(key, len(ids))  # the lowest free ids, in order
    assert got.tolist() == ids


def _first_by_acquire(L: BlockLedger, key: RequestKey, ids: list[int]) -> None:
    L.acquire(key, ids)


def _first_by_acquire_many(L: BlockLedger, key: RequestKey, ids: list[int]) -> None:
    L.acquire_many({key: ids, "bystander": []})


FIRST: dict[Counts, dict[str, Hold]] = {
    "ledger": {
        "allocate": _first_by_allocate,
        "acquire": _first_by_acquire,
        "acquire_many": _first_by_acquire_many,
    },
    "engine": {"acquire": _first_by_acquire, "acquire_many": _first_by_acquire_many},
}


# How a second holder joins (shared; in engine mode every hold is counted alike).
def _share_by_acquire(L: BlockLedger, key: RequestKey, ids: list[int]) -> None:
    L.acquire(key, ids, shared=True)


def _share_by_acquire_many(L: BlockLedger, key: RequestKey, ids: list[int]) -> None:
    L.acquire_many({key: np.array(ids, dtype=np.int64)}, shared=True)


def _share_by_read_grant(L: BlockLedger, key: RequestKey, ids: list[int]) -> None:
    L.acquire_and_grant(key, ids, "reader", Access.READ, shared=True)


SHARE: dict[str, Hold] = {
    "acquire": _share_by_acquire,
    "acquire_many": _share_by_acquire_many,
    "acquire_and_grant_read": _share_by_read_grant,
}

FIRST_CASES = [(c, f) for c in COUNTS for f in FIRST[c]]


def _live(L: BlockLedger) -> list[RequestKey]:
    return [k for k in L.live_requests() if k != "bystander"]


# =========================================================================== acquire_and_grant


@pytest.mark.parametrize(
    ("counts", "first", "shared"),
    [(c, f, s) for c, f in FIRST_CASES for s in ((True,) if c == "ledger" else (True, False))],
)
def test_acquire_and_grant_refuses_a_write_grant_on_blocks_it_would_share(
    counts: Counts, first: str, shared: bool
) -> None:
    L = ledger(counts)
    FIRST[counts][first](L, "a", [0, 1])
    for ids in ([1], [0, 1], np.array([1, 0], dtype=np.int64)):
        refused(
            L,
            errors.BlockUnavailable,
            partial(L.acquire_and_grant, "s", ids, "p", Access.WRITE, shared=shared),
            "write grant",
        )
    assert _live(L) == ["a"]
    # The same blocks read: allowed (a peer copying the cached prefix out).
    g = L.acquire_and_grant("s", [1], "p", Access.READ, shared=shared)
    assert (g.request, g.access, g.blocks.tolist()) == ("s", Access.READ, [1])
    assert_whole_state(
        L,
        requests={
            "a": R.ADMITTED,
            "s": R.ADMITTED,
            **({"bystander": R.ADMITTED} if first == "acquire_many" else {}),
        },
        blocks=[O, X, F, F],
        holders=[1, 2, 0, 0],
    )


@pytest.mark.parametrize("counts", COUNTS)
def test_acquire_and_grant_refuses_a_shared_write_for_a_request_already_running(
    counts: Counts,
) -> None:
    """The request already holds a block of its own: the refusal leaves it holding just that."""
    L = ledger(counts)
    L.acquire("a", [0, 1])
    L.acquire("s", [2])
    refused(
        L,
        errors.BlockUnavailable,
        lambda: L.acquire_and_grant("s", [1], "p", Access.WRITE, shared=True),
        "write grant",
    )
    assert_whole_state(
        L, requests={"a": R.ADMITTED, "s": R.ADMITTED}, blocks=[O, O, O, F], holders=[1, 1, 1, 0]
    )
    assert L.blocks_of("s").tolist() == [2] and L.open_grants("s") == []
    # Its own block, exclusively held, may be written.
    L.grant("s", "p", [2], Access.WRITE)


@pytest.mark.parametrize("counts", COUNTS)
def test_acquire_and_grant_refuses_a_shared_write_where_only_a_sharer_is_left(
    counts: Counts,
) -> None:
    """The first holder let go; one sharer still holds the block: it is still shared."""
    L = ledger(counts)
    L.acquire("a", [0, 1])
    L.acquire("t", [1], shared=True)
    let_go(L, "a")
    assert_whole_state(L, requests={"t": R.ADMITTED}, blocks=[F, O, F, F], holders=[0, 1, 0, 0])
    refused(
        L,
        errors.BlockUnavailable,
        lambda: L.acquire_and_grant("s", [1], "p", Access.WRITE, shared=True),
        "write grant",
    )
    assert_whole_state(L, requests={"t": R.ADMITTED}, blocks=[F, O, F, F], holders=[0, 1, 0, 0])


@pytest.mark.parametrize("counts", COUNTS)
def test_acquire_and_grant_refuses_a_shared_write_on_holders_of_one_batch(counts: Counts) -> None:
    """The holders came in batches (two sharers of one block in one ``acquire_many``)."""
    L = ledger(counts)
    L.acquire_many({"a": [0, 1], "b": [2]})
    L.acquire_many({"t": [1], "u": [1, 2]}, shared=True)
    assert L.holders([0, 1, 2, 3]).tolist() == [1, 3, 2, 0]
    for ids in ([1], [2], [1, 2]):
        refused(
            L,
            errors.BlockUnavailable,
            partial(L.acquire_and_grant, "s", ids, "p", Access.WRITE, shared=True),
            "write grant",
        )
    # ... and none of the holders may write them either (grant beside sharers).
    for key, ids in (("a", [1]), ("b", [2]), ("t", [1]), ("u", [1]), ("u", [2])):
        refused(
            L,
            errors.BlockUnavailable,
            partial(L.grant, key, "p", ids, Access.WRITE),
            "write grant",
        )
    L.grant("a", "p", [0], Access.WRITE)  # block 0 has one holder
    assert L.holders([0, 1, 2, 3]).tolist() == [1, 3, 2, 0]


# =========================================================================== grant beside a sharer


_HOLDER_MESSAGE = {
    "ledger": "a write grant on a block with more than one holder",
    "engine": "a write grant on blocks another request holds",
}
_SHARER_MESSAGE = {
    "ledger": "a write grant on a block this request shares",
    "engine": "a write grant on blocks another request holds",
}


@pytest.mark.parametrize("share", list(SHARE))
@pytest.mark.parametrize(("counts", "first"), FIRST_CASES)
def test_the_holder_may_not_grant_write_beside_one_sharer(
    counts: Counts, first: str, share: str
) -> None:
    L = ledger(counts)
    FIRST[counts][first](L, "a", [0, 1])
    SHARE[share](L, "s", [1])  # exactly one other holder of block 1
    assert L.holders([0, 1]).tolist() == [1, 2]
    for ids in ([1], [0, 1], [1, 0], np.array([1], dtype=np.int64)):
        refused(
            L,
            errors.BlockUnavailable,
            partial(L.grant, "a", "p", ids, Access.WRITE),
            _HOLDER_MESSAGE[counts],
        )
    assert L.open_grants("a") == []
    # Block 0 has a's hold only: it may be written.
    L.grant("a", "p", [0], Access.WRITE)
    # Once the sharer let go, block 1 has one holder again: it may be written.
    let_go(L, "s")
    assert L.holders([0, 1]).tolist() == [1, 1]
    g = L.grant("a", "p2", [1], Access.WRITE)
    assert g.access is Access.WRITE and g.blocks.tolist() == [1]


@pytest.mark.parametrize("share", list(SHARE))
@pytest.mark.parametrize(("counts", "first"), FIRST_CASES)
def test_a_sharer_may_not_grant_write_beside_the_holder(
    counts: Counts, first: str, share: str
) -> None:
    L = ledger(counts)
    FIRST[counts][first](L, "a", [0, 1])
    SHARE[share](L, "s", [1])
    for ids in ([1], np.array([1], dtype=np.int64)):
        refused(
            L,
            errors.BlockUnavailable,
            partial(L.grant, "s", "p", ids, Access.WRITE),
            _SHARER_MESSAGE[counts],
        )
    g = L.grant("s", "p", [1], Access.READ)
    assert g.access is Access.READ


@pytest.mark.parametrize("counts", COUNTS)
def test_a_sharer_may_not_grant_write_beside_one_other_sharer(counts: Counts) -> None:
    """The first holder is gone; two sharers are left: neither may write. With the ledger's
    counts a shared hold never becomes writable (``grant`` refuses a write grant on a block the
    request holds shared, even alone); with the engine's counts one holder may write."""
    L = ledger(counts)
    L.acquire("a", [0, 1])
    L.acquire_many({"s": [1], "t": [1]}, shared=True)
    let_go(L, "a")
    assert_whole_state(
        L, requests={"s": R.ADMITTED, "t": R.ADMITTED}, blocks=[F, O, F, F], holders=[0, 2, 0, 0]
    )
    for key in ("s", "t"):
        refused(
            L,
            errors.BlockUnavailable,
            partial(L.grant, key, "p", [1], Access.WRITE),
            _SHARER_MESSAGE[counts],
        )
    let_go(L, "t")
    assert L.holders([1]).tolist() == [1]
    if counts == "ledger":
        refused(
            L,
            errors.BlockUnavailable,
            lambda: L.grant("s", "p", [1], Access.WRITE),
            _SHARER_MESSAGE[counts],
        )
    else:
        assert L.grant("s", "p", [1], Access.WRITE).access is Access.WRITE


@pytest.mark.parametrize("counts", COUNTS)
def test_the_write_refusal_sees_a_sharer_whose_batches_were_merged(counts: Counts) -> None:
    """A sharer that grew by one block per ``acquire_many`` step for more steps than the ledger
    keeps views (its holds are merged into one array): every block it shares is still shared."""
    n = 40
    L = ledger(counts, n)
    L.acquire("a", list(range(n)))
    for b in range(n):
        L.acquire_many({"s": [b]}, shared=True)
    assert L.holders(np.arange(n)).tolist() == [2] * n
    for ids in ([0], [17], [n - 1], list(range(n))):
        refused(
            L,
            errors.BlockUnavailable,
            partial(L.grant, "a", "p", ids, Access.WRITE),
            _HOLDER_MESSAGE[counts],
        )
        refused(
            L,
            errors.BlockUnavailable,
            partial(L.grant, "s", "p", ids, Access.WRITE),
            _SHARER_MESSAGE[counts],
        )
    let_go(L, "s")
    L.grant("a", "p", list(range(n)), Access.WRITE)


# =========================================================================== the holder limit


def _limited(counts: Counts, limit: int, n: int = 4) -> BlockLedger:
    L = ledger(counts, n)
    L.MAX_SHARERS = limit  # the real limit is the uint16 counter's (see the last tests)
    return L


def _counted_holders(counts: Counts) -> int:
    """Holders the limit does not count: with the ledger's counts, the exclusive first holder."""
    return 1 if counts == "ledger" else 0


@pytest.mark.parametrize("already", [0, 1, 2])
@pytest.mark.parametrize(
    ("counts", "shared"), [("ledger", True), ("engine", True), ("engine", False)]
)
def test_acquire_many_counts_a_repeated_block_against_the_holder_limit(
    counts: Counts, shared: bool, already: int
) -> None:
    """Block 0 has ``already`` counted holders; one batch names it for more requests than the
    limit has room for: refused, nothing changed. As many as there is room for: accepted."""
    limit = 3
    L = _limited(counts, limit)
    if counts == "ledger":
        L.acquire("owner", [0])  # exclusive: not among the counted holders
    for i in range(already):
        L.acquire(f"e{i}", [0], shared=True)
    room = limit - already
    over = {f"n{i}": [0] for i in range(room + 1)}
    refused(L, errors.HolderLimit, lambda: L.acquire_many(over, shared=shared), "holders")
    assert not any(str(k).startswith("n") for k in L.live_requests())
    assert L.holders([0]).tolist() == [_counted_holders(counts) + already]
    fits = {f"n{i}": [0] for i in range(room)}
    L.acquire_many(fits, shared=shared)
    assert L.holders([0]).tolist() == [_counted_holders(counts) + limit]
    # At the limit: one more, by either call, is refused.
    refused(L, errors.HolderLimit, lambda: L.acquire("late", [0], shared=shared), "holders")
    refused(L, errors.HolderLimit, lambda: L.acquire_many({"late": [0]}, shared=shared), "holders")


@pytest.mark.parametrize("counts", COUNTS)
def test_a_repeat_over_the_limit_refuses_the_whole_batch(counts: Counts) -> None:
    """Block 0 is named by one request too many, block 1 by as many as fit (with the ledger's
    counts); one request of the batch is already running: the refusal leaves every request and
    every block as it was."""
    L = _limited(counts, 3)
    L.acquire("owner", [0, 1])  # counted with the engine's counts only
    L.acquire("a", [2])
    holds = {"a": [1, 0], "b": [0], "c": [1], "d": [0, 1], "e": [0]}  # block 0: 4, block 1: 3
    refused(L, errors.HolderLimit, lambda: L.acquire_many(holds, shared=True), "holders")
    assert_whole_state(
        L,
        requests={"owner": R.ADMITTED, "a": R.ADMITTED},
        blocks=[O, O, O, F],
        holders=[1, 1, 1, 0],
    )
    assert L.blocks_of("a").tolist() == [2]
    # Without "e", each block is named three times: within the limit with the ledger's counts
    # (the owner is not counted), one over it with the engine's (the owner is).
    fewer = {"a": [1, 0], "b": [0], "c": [1], "d": [0, 1]}
    if counts == "ledger":
        L.acquire_many(fewer, shared=True)
        assert L.holders([0, 1, 2]).tolist() == [4, 4, 1]
    else:
        refused(L, errors.HolderLimit, lambda: L.acquire_many(fewer, shared=True), "holders")
        L.acquire_many({"a": [1, 0], "b": [0], "c": [1]}, shared=True)
        assert L.holders([0, 1, 2]).tolist() == [3, 3, 1]


@pytest.mark.parametrize("counts", COUNTS)
def test_the_real_holder_limit_is_never_wrapped_by_a_repeat(counts: Counts) -> None:
    """65,534 counted holders, then one batch names the block twice: 65,536 would wrap the
    uint16 counter to 0 and the block would go back to the pool while 65,534 requests hold it.
    """
    limit = BlockLedger.MAX_SHARERS
    L = ledger(counts, 4)
    if counts == "ledger":
        L.acquire("owner", [0, 1])
    else:
        L.acquire_many({"owner": [0, 1]})  # the engine's counts: the limit counts it
    base = _counted_holders(counts)  # the owner, when the limit does not count it
    sharers = limit - 1 - (1 - base)  # block 0 then has limit - 1 counted holders
    L.acquire_many({i: [0] for i in range(sharers)}, shared=True)  # a repeat within the limit
    assert L.holders([0, 1]).tolist() == [base + limit - 1, 1]
    refused(
        L,
        errors.HolderLimit,
        lambda: L.acquire_many({"x": [0], "y": [0, 1]}, shared=True),
        "holders",
    )
    assert L.holders([0, 1]).tolist() == [base + limit - 1, 1]
    L.acquire_many({"x": [0], "y": [1]}, shared=True)
    assert L.holders([0, 1]).tolist() == [base + limit, 2]
    refused(L, errors.HolderLimit, lambda: L.acquire("z", [0], shared=True), "holders")
    # The owner and every sharer but x let go: block 0 stays held, never handed out.
    let_go(L, "owner")
    L.finish_many(list(range(sharers)))
    assert sorted(L.collect_releasable()) == list(range(sharers))
    assert_whole_state(
        L,
        requests={"x": R.ADMITTED, "y": R.ADMITTED},
        blocks=[O, O, F, F],
        holders=[1, 1, 0, 0],
    )


@pytest.mark.parametrize(
    "holds",
    [
        {"b": [0, 1], "c": [1], "a": [2]},
        {"a": [0], "b": [0]},
        {"b": np.array([1], dtype=np.int64), "c": (2, 1)},
    ],
    ids=["new-requests", "a-running-request", "arrays-and-tuples"],
)
def test_acquire_many_refuses_one_block_taken_exclusively_by_two_requests(
    holds: dict[str, Any],
) -> None:
    """The exclusive counterpart (the ledger's counts): a block named by two requests of one
    batch is refused, not given to the last one; the running request keeps just its own."""
    L = ledger("ledger")
    L.acquire("a", [3])
    refused(L, errors.BlockUnavailable, lambda: L.acquire_many(holds), "two requests")
    assert_whole_state(L, requests={"a": R.ADMITTED}, blocks=[F, F, F, O], holders=[0, 0, 0, 1])
    assert L.blocks_of("a").tolist() == [3]
