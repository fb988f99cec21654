"""The ledger's few-calls API against the one-call-per-fact API it stands for.

``acquire_many`` is many ``acquire`` calls in one (all or nothing) and ``acquire_and_grant`` is
``acquire`` then ``grant`` in one (all or nothing). Neither may be a second copy of the rules
that drifts: each is checked here against the calls it replaces, on random histories in both
counts modes, by comparing the ledger's whole observable state (``fingerprint``) afterwards,
and that a refused call changed nothing.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvlifetime import errors
from kvlifetime.errors import KVLifetimeError
from kvlifetime.evidence import TransferCompleted
from kvlifetime.grant import Access, Grant, RequestKey
from kvlifetime.ledger import COUNTS, BlockLedger, Counts

N = 6
KEYS: list[RequestKey] = ["a", "b", "c", 1, 2]

ids_st = st.lists(st.integers(0, N - 1), max_size=4)


def _as_given(draw: Any, ids: list[int]) -> Any:
    """The same ids as a list, a tuple or an int64 array (each takes its own check path)."""
    kind = draw(st.sampled_from(["list", "tuple", "array"]))
    if kind == "array":
        return np.array(ids, dtype=np.int64)
    return tuple(ids) if kind == "tuple" else ids


def _state(led: BlockLedger) -> tuple[Any, ...]:
    """``fingerprint()`` with each request's holds flattened: how they are split into batches
    is not part of the state (acquire_many merges a long-lived request's batches)."""
    fp = list(led.fingerprint())
    fp[4] = tuple(
        (key, state, sum(excl, ()), sum(shared, ()), *rest)
        for key, state, excl, shared, *rest in fp[4]
    )
    return tuple(fp)


def _outcome(fn: Any, *args: Any, **kwargs: Any) -> Any:
    """What ``fn`` returned (``()`` for ``None``), or ``None`` if it refused (a typed error)."""
    try:
        out = fn(*args, **kwargs)
    except KVLifetimeError:
        return None
    return () if out is None else out


def _other_step(led: BlockLedger, draw: Any) -> None:
    """Something else a history does between batch calls: a grant, an end, a release."""
    live = led.live_requests()
    key = draw(st.sampled_from(sorted(live, key=repr) if live else KEYS))
    op = draw(st.sampled_from(["acquire", "grant_w", "grant_r", "finish", "complete", "release"]))
    try:
        if op == "acquire" or not live:
            led.acquire(draw(st.sampled_from(KEYS)), draw(ids_st), shared=draw(st.booleans()))
        elif op in ("grant_w", "grant_r"):
            held = led.blocks_of(key).tolist()
            if held:
                part = draw(st.lists(st.sampled_from(held), min_size=1, unique=True))
                access = Access.WRITE if op == "grant_w" else Access.READ
                led.grant(key, "p", part, access)
        elif op == "finish":
            led.finish(key)
        elif op == "complete":
            for g in led.open_grants(key):
                led.apply(TransferCompleted.of(g, 0))
        else:
            led.release(key)
    except KVLifetimeError:
        pass


def _one_by_one(led: BlockLedger, holds: dict[Any, Any], shared: bool) -> None:
    for k, v in holds.items():
        led.acquire(k, v, shared=shared)


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(counts=st.sampled_from(COUNTS), data=st.data())
def test_acquire_many_is_acquire_in_order_all_or_nothing(counts: Counts, data: Any) -> None:
    led = BlockLedger(N, counts=counts)
    for _ in range(data.draw(st.integers(1, 7))):
        if data.draw(st.booleans()):
            _other_step(led, data.draw)
            continue
        drawn = data.draw(st.dictionaries(st.sampled_from(KEYS), ids_st, max_size=3))
        holds = {k: _as_given(data.draw, v) for k, v in drawn.items()}
        shared = data.draw(st.booleans())
        ref = led.copy()
        ok = _outcome(_one_by_one, ref, holds, shared) is not None
        expected = _state(ref) if ok else None
        before = _state(led)
        if _outcome(led.acquire_many, holds, shared=shared) is None:
            assert _state(led) == before  # refused: nothing changed, for anyone
            assert expected is None, f"acquire_many refused what acquire allows: {holds}"
        else:
            assert _state(led) == expected


def _two_calls(led: BlockLedger, key: RequestKey, ids: Any, access: Access, shared: bool) -> Grant:
    led.acquire(key, ids, shared=shared)
    return led.grant(key, "p", ids, access)


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(counts=st.sampled_from(COUNTS), data=st.data())
def test_acquire_and_grant_is_acquire_then_grant_all_or_nothing(counts: Counts, data: Any) -> None:
    led = BlockLedger(N, counts=counts)
    for _ in range(data.draw(st.integers(1, 7))):
        if data.draw(st.booleans()):
            _other_step(led, data.draw)
            continue
        key = data.draw(st.sampled_from(KEYS))
        ids = _as_given(data.draw, data.draw(ids_st))
        access = data.draw(st.sampled_from(list(Access)))
        shared = data.draw(st.booleans())
        ref = led.copy()
        e = _outcome(_two_calls, ref, key, ids, access, shared)
        expected = None if e is None else ref.fingerprint()
        before = led.fingerprint()
        g = _outcome(led.acquire_and_grant, key, ids, "p", access, shared=shared)
        if g is None:
            assert led.fingerprint() == before
            assert expected is None, f"acquire_and_grant refused what two calls allow: {key}"
        else:
            assert led.fingerprint() == expected
            assert e is not None
            assert (g.id, g.request, g.peer, g.access) == (e.id, e.request, e.peer, e.access)
            assert g.blocks.tolist() == e.blocks.tolist()
            assert g.generations.tolist() == e.generations.tolist()


@pytest.mark.parametrize("counts", COUNTS)
def test_acquire_many_refuses_bad_input_with_typed_errors(counts: Counts) -> None:
    led = BlockLedger(8, counts=counts)
    led.acquire("held", [0])
    before = led.fingerprint()
    bad: list[Any] = [
        [("a", [1])],  # not a mapping
        {"a": [1.0]},
        {"a": [True]},
        {"a": ["1"]},
        {"a": np.array([[1]])},
        {"a": np.array([1.5])},
        {"a": [8]},
        {"a": [-1]},
        {"a": [1 << 70]},
        {"a": [1], "": [2]},
        {"a": [1], None: [2]},
        {"a": [3, 3]},
    ]
    for holds in bad:
        with pytest.raises(errors.KVLifetimeError):
            led.acquire_many(holds)
        assert led.fingerprint() == before, holds
    with pytest.raises(errors.InvalidField):
        led.acquire_many({"a": [1]}, shared="yes")  # type: ignore[arg-type]


def test_acquire_many_takes_each_request_as_acquire_does() -> None:
    led = BlockLedger(16, counts="engine")
    led.acquire_many({"a": [1, 2], "b": np.array([3], dtype=np.int64), "c": ()})
    led.acquire_many({"a": (4,), "b": [1]})  # engine counts: b may hold a's block 1 too
    assert led.blocks_of("a").tolist() == [1, 2, 4]
    assert led.blocks_of("b").tolist() == [3, 1]
    assert led.blocks_of("c").tolist() == []
    assert led.holders(np.arange(5)).tolist() == [0, 2, 1, 1, 1]
    with pytest.raises(errors.BlockUnavailable):  # a already holds 4: nothing changes
        led.acquire_many({"b": [5], "a": [4]})
    assert led.holders([5]).tolist() == [0]


class _TwoHolders(BlockLedger):
    MAX_SHARERS = 2  # the holder limit, small enough to reach


@pytest.mark.parametrize("counts", COUNTS)
def test_acquire_many_counts_a_block_taken_by_several_requests_against_the_limit(
    counts: Counts,
) -> None:
    led = _TwoHolders(4, counts=counts)
    led.acquire("owner", [1])
    before = led.fingerprint()
    # Shared: 'owner' + two sharers would be fine for a ledger's exclusive owner (it is not
    # counted among sharers); engine counts: every hold counts.
    many = {"a": [1], "b": [1], "c": [1]}
    with pytest.raises(errors.HolderLimit):
        led.acquire_many(many, shared=True)
    assert led.fingerprint() == before
    led.acquire_many({"a": [1], "b": [1]} if counts == "ledger" else {"a": [1]}, shared=True)
    assert led.holders([1]).tolist() == [3 if counts == "ledger" else 2]


def test_engine_collect_of_many_requests_counts_every_holder() -> None:
    """collect_releasable lets many requests go at once: blocks only they held, blocks two of
    them held, and blocks a live request still holds all end where one release each would."""
    led = BlockLedger(8, counts="engine")
    led.acquire_many({"a": [0, 1], "b": [1, 2], "c": [3], "live": [2]})
    one_by_one = led.copy()
    for k in ("a", "b", "c"):
        led.finish(k)
        one_by_one.finish(k)
    freed = led.collect_releasable()
    for k in ("a", "b", "c"):
        one_by_one.release(k)
    assert {k: v.tolist() for k, v in freed.items()} == {"a": [0, 1], "b": [1, 2], "c": [3]}
    assert led.fingerprint() == one_by_one.fingerprint()
    assert led.holders(np.arange(4)).tolist() == [0, 0, 1, 0]
    assert led.generation(np.arange(4)).tolist() == [1, 1, 0, 1]  # 2 is still held by live
    # Only blocks no one else holds: the one-write path.
    led.acquire_many({"d": [4], "e": [5, 6]})
    for k in ("d", "e"):
        led.finish(k)
    assert sorted(led.collect_releasable()) == ["d", "e"]
    assert led.holders([4, 5, 6]).tolist() == [0, 0, 0]
    assert led.generation([4, 5, 6]).tolist() == [1, 1, 1]


def test_a_long_lived_request_keeps_few_step_arrays_alive() -> None:
    """acquire_many hands out views into one array per step; a request that outlives its
    step-mates has its views merged, so it never pins more than a few steps' arrays."""
    led = BlockLedger(4096, counts="engine")
    led.acquire("long", [0])
    nxt = 1
    for step in range(40):
        holds = {"long": [nxt]} | {f"s{step}-{i}": [nxt + 1 + i] for i in range(50)}
        nxt += 51
        led.acquire_many(holds)
        for key in holds:
            if key != "long":
                led.finish(key)
        led.collect_releasable()
    rec = led.inspect().requests["long"]
    assert len(rec.shared) <= 17  # 41 batches without the merge

    def root(a: np.ndarray) -> int:
        while a.base is not None:
            a = a.base
        return id(a)

    assert len({root(a) for a in rec.shared}) <= 17  # arrays kept alive, whatever the steps
    assert led.blocks_of("long").tolist() == [0] + [1 + 51 * k for k in range(40)]
    assert led.holders(led.blocks_of("long")).tolist() == [1] * 41
    led.finish("long")
    assert led.release("long").tolist() == [0] + [1 + 51 * k for k in range(40)]
    assert led.free_count() == 4096
