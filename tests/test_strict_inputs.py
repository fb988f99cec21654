"""Strict inputs (README, "Strict inputs").

Every public entry point of ``BlockLedger``, the evidence classes and ``Grant`` is walked with a
table of bad values. Each refusal must raise the right kvlifetime error class (never a
``TypeError`` / ``ValueError`` / ``AttributeError`` / ``OverflowError`` from deep inside) and
change nothing, for anyone: the ledger's ``fingerprint()``, ``stats()`` and the bookkeeping
behind them (the free list, deadlines, the clock, the per-block counters) are compared before
and after, on a ledger holding requests in every kind of state.

Also here: the holder counter's limit (refused at 65,535 sharers, never wrapped), the
unsettled-grant counter that makes shared acquire O(batch) (widened, never wrapped), and the
issue's reproductions, each of which failed on the code before this module.
"""

from __future__ import annotations

import decimal
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import attrs
import numpy as np
import pytest

from kvlifetime import errors, inputs
from kvlifetime.errors import (
    BlockOutOfRange,
    DoubleRelease,
    DuplicateBlockIds,
    HolderLimit,
    InvalidBlockIds,
    InvalidField,
    KVLifetimeError,
    MalformedEvidence,
    UnknownGrant,
    UnknownRequest,
)
from kvlifetime.evidence import (
    AccessRevoked,
    CancelReceived,
    LeaseExpired,
    PeerLost,
    SchedulingStopped,
    TransferCompleted,
    TransferQuiesced,
    about,
)
from kvlifetime.grant import Access, Grant, GrantId
from kvlifetime.ledger import BlockLedger, Counts
from kvlifetime.spec.vocabulary import RequestState

N = 16
FREE_ID = 8  # a free block of the populated ledger
Call = Callable[[BlockLedger], object]


def populated(*, checked: bool = False, counts: Counts = "ledger") -> BlockLedger:
    """A ledger with a request in every kind of state, so that a refusal that touches anyone
    else shows up in the snapshot."""
    L = BlockLedger(N, checked=checked, incarnation="inc", counts=counts)
    L.acquire("a", [0, 1])
    L.grant("a", "p", [0, 1], Access.WRITE)  # admitted, open write grant
    L.acquire(7, [2, 3], deadline=100.0)
    L.grant(7, "p", [2], Access.READ)  # int key, open read grant, deadline
    L.acquire("b", [4])
    L.grant("b", "q", [4], deadline=50.0)
    L.reject("b")  # rejected, open grant, timed
    L.acquire("c", [5])
    L.finish("c")  # transfer_quiesced, releasable
    L.acquire("o", [6, 7])
    L.acquire("s", [6], shared=True)  # a sharer
    L.acquire("gone", [15])
    L.finish("gone")
    L.release("gone")  # recently released
    L.expire(1.0)  # the clock is set
    return L


def snapshot(L: BlockLedger, *, evidence_counters: bool = True) -> tuple[Any, ...]:
    """Everything a refusal must leave as it was."""
    st = L.stats(now=2.0)
    if not evidence_counters:
        st = attrs.evolve(st, refused_evidence={})
    inside = L.inspect()
    return (
        L.fingerprint(),
        st,
        L.free_count(),
        inside.free_stack is None,
        inside.free_top,
        (inside.unsettled.tobytes(), inside.readers.tobytes()) if inside.tracking else "not kept",
        inside.sharers.tobytes(),
        inside.timed,
        inside.releasable,
        inside.clock,
        inside.recently_released,
        inside.next_slot,
        {repr(k): (r.state, r.deadline) for k, r in inside.requests.items()},
    )


def assert_refused(L: BlockLedger, call: Call, exc: type[Exception], **snap: bool) -> None:
    before = snapshot(L, **snap)
    with pytest.raises(exc) as info:
        call(L)
    # A kvlifetime error of exactly the expected family, never a bare builtin from inside.
    assert isinstance(info.value, KVLifetimeError), repr(info.value)
    assert snapshot(L, **snap) == before, "a refused call changed the ledger"


# --------------------------------------------------------------------------- bad values

BAD_IDS: list[tuple[str, object, type[Exception]]] = [
    ("floats", [0.9, 1.9], InvalidBlockIds),
    ("bool", [True], InvalidBlockIds),
    ("str-item", ["3"], InvalidBlockIds),
    ("float-item", [4.5], InvalidBlockIds),
    ("integral-float", [8.0], InvalidBlockIds),
    ("none", None, InvalidBlockIds),
    ("none-item", [None], InvalidBlockIds),
    ("nan", [float("nan")], InvalidBlockIds),
    ("complex", [1 + 0j], InvalidBlockIds),
    ("str", "89", InvalidBlockIds),
    ("bytes", b"\x08", InvalidBlockIds),
    ("bare-int", 8, InvalidBlockIds),
    ("numpy-scalar", np.int64(8), InvalidBlockIds),
    ("set", {8}, InvalidBlockIds),
    ("dict", {8: 0}, InvalidBlockIds),
    ("generator", (i for i in [8]), InvalidBlockIds),
    ("nested", [[8, 9]], InvalidBlockIds),
    ("numpy-float-item", [np.float64(8.0)], InvalidBlockIds),
    ("numpy-bool-item", [np.bool_(True)], InvalidBlockIds),
    ("2**63", [2**63], BlockOutOfRange),
    ("2**64", [2**64], BlockOutOfRange),
    ("below-int64", [-(2**63) - 1], BlockOutOfRange),
    ("negative", [-1], BlockOutOfRange),
    ("num_blocks", [N], BlockOutOfRange),
    ("one-bad", [8, 1000], BlockOutOfRange),
    ("duplicate", [8, 8], DuplicateBlockIds),
    ("duplicate-late", [8, 9, 10, 9], DuplicateBlockIds),
    # numpy arrays
    ("np-float", np.array([8.0, 9.0]), InvalidBlockIds),
    ("np-bool", np.array([True, False]), InvalidBlockIds),
    ("np-2d", np.array([[8], [9]]), InvalidBlockIds),
    ("np-2d-same-bytes-as-held", np.array([[0], [1]]), InvalidBlockIds),
    ("np-0d", np.array(8), InvalidBlockIds),
    ("np-object", np.array([8, 9], dtype=object), InvalidBlockIds),
    ("np-str", np.array(["8"]), InvalidBlockIds),
    ("np-complex", np.array([8 + 0j]), InvalidBlockIds),
    ("np-int8-negative", np.array([-1], dtype=np.int8), BlockOutOfRange),
    ("np-int8-too-big", np.array([100], dtype=np.int8), BlockOutOfRange),
    ("np-uint64-2**63", np.array([2**63], dtype=np.uint64), BlockOutOfRange),
    ("np-uint64-max", np.array([2**64 - 1], dtype=np.uint64), BlockOutOfRange),
    ("np-uint16-too-big", np.array([N], dtype=np.uint16), BlockOutOfRange),
    ("np-duplicate", np.array([8, 8]), DuplicateBlockIds),
]

BAD_KEYS: list[tuple[str, object]] = [
    ("list", [1]),
    ("dict", {}),
    ("set", {1}),
    ("ndarray", np.array([7])),
    ("none", None),
    ("true", True),  # == 1, an int subclass: never an id
    ("false", False),
    ("float-equal-to-a-key", 7.0),  # == 7, hashes like 7: must not find request 7
    ("nan", float("nan")),
    ("numpy-int", np.int64(7)),
    ("empty", ""),
    ("bytes", b"a"),
    ("tuple", ("a",)),
    ("frozenset", frozenset({"a"})),
    ("object", object()),
]

BAD_TIMES: list[tuple[str, object]] = [
    ("str", "soon"),
    ("nan", float("nan")),
    ("inf", float("inf")),
    ("-inf", -float("inf")),
    ("numpy-nan", np.float64("nan")),
    ("bool", True),
    ("numpy-bool", np.bool_(False)),
    ("complex", 1 + 0j),
    ("decimal", decimal.Decimal("1.5")),
    ("list", [1.0]),
]

BAD_COUNTS: list[tuple[str, object]] = [
    ("negative", -1),
    ("float", 1.5),
    ("integral-float", 2.0),
    ("bool", True),
    ("str", "2"),
    ("none", None),
]

BAD_PEERS: list[tuple[str, object]] = [
    ("empty", ""),
    ("none", None),
    ("int", 7),
    ("bytes", b"p"),
    ("list", ["p"]),
]

BAD_SEQS: list[tuple[str, object]] = [
    ("negative", -1),
    ("float", 1.5),
    ("bool", True),
    ("str", "3"),
    ("none", None),
    ("numpy-int", np.int64(3)),
    ("2**63", 2**63),
]

NOT_A_GRANT: list[tuple[str, object]] = [
    ("none", None),
    ("str", "inc#1"),
    ("grant-id", GrantId("inc", 1)),
    ("dict", {"grant": "inc#1"}),
]


def _ids_calls(ids: object) -> list[tuple[str, Call]]:
    v: Any = ids
    return [
        ("acquire", lambda L: L.acquire("new", v)),
        ("acquire-live", lambda L: L.acquire("a", v)),
        ("acquire-shared", lambda L: L.acquire("new", v, shared=True)),
        ("grant", lambda L: L.grant("a", "p", v)),
        ("generation", lambda L: L.generation(v)),
        ("holders", lambda L: L.holders(v)),
        ("block_state", lambda L: L.block_state(v)),
        ("open_access", lambda L: L.open_access(v)),
    ]


def _key_calls(key: object) -> list[tuple[str, Call]]:
    k: Any = key
    return [
        ("admit", lambda L: L.admit(k)),
        ("allocate", lambda L: L.allocate(k, 1)),
        ("acquire", lambda L: L.acquire(k, [FREE_ID])),
        ("acquire-shared", lambda L: L.acquire(k, [6], shared=True)),
        ("grant", lambda L: L.grant(k, "p", [0])),
        ("reject", lambda L: L.reject(k)),
        ("finish", lambda L: L.finish(k)),
        ("set_deadline", lambda L: L.set_deadline(k, 5.0)),
        ("release", lambda L: L.release(k)),
        ("force_release", lambda L: L.force_release(k, "why")),
        ("state", lambda L: L.state(k)),
        ("blocks_of", lambda L: L.blocks_of(k)),
        ("grants_of", lambda L: L.grants_of(k)),
        ("open_grants", lambda L: L.open_grants(k)),
        ("unproven", lambda L: L.unproven(k)),
    ]


def _time_calls(t: object) -> list[tuple[str, Call]]:
    v: Any = t
    return [
        ("admit", lambda L: L.admit("new", deadline=v)),
        ("allocate", lambda L: L.allocate("new", 1, deadline=v)),
        ("acquire", lambda L: L.acquire("new", [FREE_ID], deadline=v)),
        ("acquire-live", lambda L: L.acquire(7, [FREE_ID], deadline=v)),
        ("acquire-shared", lambda L: L.acquire("new", [6], shared=True, deadline=v)),
        ("grant", lambda L: L.grant("a", "p", [0], deadline=v)),
        ("set_deadline", lambda L: L.set_deadline("b", v)),
        ("expire", lambda L: L.expire(v)),
        ("stats", lambda L: L.stats(now=v)),
    ]


def _table() -> list[Any]:
    rows: list[Any] = []
    for label, ids, exc in BAD_IDS:
        for call_name, call in _ids_calls(ids):
            rows.append(pytest.param(call, exc, id=f"ids-{label}-{call_name}"))
    for label, key in BAD_KEYS:
        for call_name, call in _key_calls(key):
            rows.append(pytest.param(call, InvalidField, id=f"key-{label}-{call_name}"))
    for label, t in BAD_TIMES:
        for call_name, call in _time_calls(t):
            rows.append(pytest.param(call, InvalidField, id=f"time-{label}-{call_name}"))
    rows.append(pytest.param(lambda L: L.expire(None), InvalidField, id="time-none-expire"))
    for label, n in BAD_COUNTS:
        v: Any = n
        rows.append(
            pytest.param(lambda L, v=v: L.allocate("new", v), InvalidField, id=f"n-{label}")
        )
    for label, peer in BAD_PEERS:
        p: Any = peer
        rows.append(
            pytest.param(lambda L, p=p: L.grant("a", p, [0]), InvalidField, id=f"peer-{label}")
        )
    for label, bad in [("str", "write"), ("none", None), ("str-read", "read")]:
        a: Any = bad
        rows.append(
            pytest.param(
                lambda L, a=a: L.grant("a", "p", [0], a), InvalidField, id=f"access-{label}"
            )
        )
    flags: list[tuple[str, Any]] = [("str", "yes"), ("int", 1), ("none", None), ("zero", 0)]
    for label, bad in flags:
        f: Any = bad
        rows.append(
            pytest.param(
                lambda L, f=f: L.acquire("new", [6], shared=f), InvalidField, id=f"shared-{label}"
            )
        )
    reasons: list[tuple[str, Any]] = [("none", None), ("int", 7), ("list", ["x"])]
    for label, bad in reasons:
        r: Any = bad
        rows.append(
            pytest.param(lambda L, r=r: L.reject("a", r), InvalidField, id=f"reason-{label}-reject")
        )
        rows.append(
            pytest.param(
                lambda L, r=r: L.force_release("b", r), InvalidField, id=f"reason-{label}-force"
            )
        )
    for label, g in [*NOT_A_GRANT[:2], ("int", 3), ("list", [1])]:
        gv: Any = g
        rows.append(
            pytest.param(lambda L, gv=gv: L.proof_of(gv), InvalidField, id=f"proof_of-{label}")
        )
    rows += [
        # A released request: querying (or granting, or setting a deadline) is not releasing.
        pytest.param(lambda L: L.state("gone"), UnknownRequest, id="released-state"),
        pytest.param(lambda L: L.blocks_of("gone"), UnknownRequest, id="released-blocks_of"),
        pytest.param(lambda L: L.grants_of("gone"), UnknownRequest, id="released-grants_of"),
        pytest.param(lambda L: L.open_grants("gone"), UnknownRequest, id="released-open_grants"),
        pytest.param(lambda L: L.unproven("gone"), UnknownRequest, id="released-unproven"),
        pytest.param(lambda L: L.grant("gone", "p", [15]), UnknownRequest, id="released-grant"),
        pytest.param(lambda L: L.set_deadline("gone", 1.0), UnknownRequest, id="released-dl"),
        # Letting go (or ending) it again is a double release.
        pytest.param(lambda L: L.release("gone"), DoubleRelease, id="released-release"),
        pytest.param(lambda L: L.force_release("gone", "x"), DoubleRelease, id="released-force"),
        pytest.param(lambda L: L.reject("gone"), DoubleRelease, id="released-reject"),
        pytest.param(lambda L: L.finish("gone"), DoubleRelease, id="released-finish"),
        # Unknown grants and out-of-pool requests.
        pytest.param(lambda L: L.proof_of(GrantId("other", 1)), UnknownGrant, id="proof-other"),
        pytest.param(lambda L: L.allocate("new", N), errors.OutOfBlocks, id="allocate-too-many"),
        pytest.param(lambda L: L.allocate("b", 1), errors.IllegalTransition, id="allocate-ended"),
    ]
    return rows


@pytest.mark.parametrize(("call", "exc"), _table())
def test_every_entry_point_refuses_bad_values_and_changes_nothing(
    call: Call, exc: type[Exception]
) -> None:
    L = populated()
    assert_refused(L, call, exc)
    # The ledger still works for everyone after the refusal.
    L.acquire("after", [FREE_ID])
    assert L.state("b") is RequestState.REJECTED
    assert L.expire(60.0) == ["b"]


@pytest.mark.parametrize(
    "bad",
    [None, "not evidence", 7, object(), {"type": "CancelReceived"}],
    ids=["none", "str", "int", "object", "dict"],
)
def test_apply_refuses_what_is_not_evidence(bad: object) -> None:
    L = populated()
    # Refused evidence is counted (README: logged and counted); nothing else changes.
    assert_refused(L, lambda L: L.apply(bad), MalformedEvidence, evidence_counters=False)  # type: ignore[arg-type]


# In engine mode allocate is refused (after its arguments are checked): the engine's allocator
# hands out blocks.
_ENGINE_EXC = {
    "allocate-too-many": errors.WrongCountsMode,
    "allocate-ended": errors.WrongCountsMode,
}


@pytest.mark.parametrize(
    ("call", "exc"),
    [
        pytest.param(*row.values, id=row.id)
        if row.id not in _ENGINE_EXC
        else pytest.param(row.values[0], _ENGINE_EXC[row.id], id=row.id)
        for row in _table()
    ],
)
def test_every_entry_point_refuses_bad_values_in_engine_mode(
    call: Call, exc: type[Exception]
) -> None:
    L = populated(counts="engine")
    assert_refused(L, call, exc)
    L.acquire("after", [FREE_ID, 6])  # any number of requests may hold a block
    assert L.state("b") is RequestState.REJECTED
    assert L.expire(60.0) == ["b"]


def test_refusals_change_nothing_in_checked_mode() -> None:
    L = populated(checked=True)
    for row in _table()[::7]:
        call, exc = row.values
        assert_refused(L, call, exc)


# --------------------------------------------------------------------------- accepted values


@pytest.mark.parametrize(
    "ids",
    [
        [8, 9],
        (8, 9),
        range(8, 10),
        [np.int32(8), np.uint8(9)],
        np.array([8, 9], dtype=np.int8),
        np.array([8, 9], dtype=np.uint64),
        np.array([8, 9], dtype=np.int32),
        np.array([9, 8, 10])[:2][::-1],  # a non-contiguous view
    ],
    ids=["list", "tuple", "range", "numpy-scalars", "int8", "uint64", "int32", "view"],
)
def test_integer_batches_of_every_kind_are_accepted(ids: object) -> None:
    L = populated()
    L.acquire("new", ids)  # type: ignore[arg-type]
    assert sorted(L.blocks_of("new").tolist()) == [8, 9]
    assert L.blocks_of("new").dtype == np.int64
    assert not L.blocks_of("new").flags.writeable
    assert L.holders(ids).tolist() == [1, 1]  # type: ignore[arg-type]


def test_numeric_times_of_every_kind_are_accepted() -> None:
    L = populated()
    L.set_deadline("b", 3)  # an int
    assert L.inspect().requests["b"].deadline == 3
    L.set_deadline("b", np.float64(3.5))  # stored as a plain float
    assert type(L.inspect().requests["b"].deadline) is float
    assert L.expire(np.int64(60)) == ["b"]  # type: ignore[arg-type]
    L.allocate("n", np.int64(2))  # type: ignore[arg-type]
    st = L.stats(now=np.float32(65.0))  # type: ignore[arg-type]
    assert st.quarantined[0].age == pytest.approx(5.0)


def test_empty_batches_are_valid() -> None:
    L = populated()
    empties: list[Any] = [[], (), np.array([], dtype=np.int64), range(0)]
    for empty in empties:
        assert L.generation(empty).tolist() == []
        assert L.holders(empty).tolist() == []


# --------------------------------------------------------------------------- the issue's cases


@pytest.mark.parametrize(
    ("ids", "coerced_to"),
    [([0.9, 1.9], [0, 1]), ([True], [1]), (["3"], [3]), ([4.5], [4])],
    ids=["floats", "bool", "str", "float"],
)
def test_issue_block_ids_are_never_coerced(ids: object, coerced_to: list[int]) -> None:
    L = BlockLedger(8)
    with pytest.raises(InvalidBlockIds):
        L.acquire("r", ids)  # type: ignore[arg-type]
    assert L.live_requests() == []
    assert L.holders(coerced_to).tolist() == [0] * len(coerced_to)


@pytest.mark.parametrize(
    ("ids", "exc"),
    [
        (None, InvalidBlockIds),
        ([2**63], BlockOutOfRange),
        ([float("nan")], InvalidBlockIds),
        ([1 + 0j], InvalidBlockIds),
    ],
    ids=["none", "2**63", "nan", "complex"],
)
def test_issue_ids_that_crashed_inside_raise_kvlifetime_errors(
    ids: object, exc: type[Exception]
) -> None:
    L = BlockLedger(8)
    for shared in (False, True):
        with pytest.raises(exc):
            L.acquire("r", ids, shared=shared)  # type: ignore[arg-type]
    assert L.live_requests() == []


@pytest.mark.parametrize("call", ["state", "reject", "release", "allocate"])
def test_issue_unhashable_request_keys(call: str) -> None:
    L = populated()
    before = snapshot(L)
    with pytest.raises(InvalidField):
        if call == "allocate":
            L.allocate(["r"], 1)  # type: ignore[arg-type]
        else:
            getattr(L, call)(["r"])
    assert snapshot(L) == before


def test_issue_of_refuses_a_non_grant() -> None:
    with pytest.raises(InvalidField):
        TransferQuiesced.of(None, through_seq=1)  # type: ignore[arg-type]


def test_issue_a_bad_deadline_is_refused_when_set_not_inside_expire() -> None:
    L = BlockLedger(4)
    L.acquire("q", [0])
    L.grant("q", "p", [0], deadline=1.0)
    L.reject("q")  # waits for proof; times out at 1.0
    L.acquire("b", [1])
    L.grant("b", "p", [1])
    L.reject("b")
    before = snapshot(L)
    with pytest.raises(InvalidField):
        L.set_deadline("b", "soon")  # type: ignore[arg-type]
    assert snapshot(L) == before
    # Every later expire still works, and quarantines q (before: TypeError, after it had
    # quarantined q: a refused call that changed state).
    assert L.expire(5.0) == ["q"]
    assert L.state("q") is RequestState.QUARANTINED
    assert L.expire(6.0) == []


@pytest.mark.parametrize(
    "call",
    [
        lambda L: L.expire("now"),
        lambda L: L.allocate("n", 1, deadline="soon"),
        lambda L: L.set_deadline("b", float("nan")),
        lambda L: L.acquire("n", [3], deadline=float("nan")),
        lambda L: L.expire(float("nan")),
        lambda L: L.expire(float("inf")),
    ],
    ids=["expire-str", "allocate-str", "nan-deadline", "acquire-nan", "expire-nan", "expire-inf"],
)
def test_issue_non_finite_clocks_and_deadlines(call: Call) -> None:
    L = BlockLedger(4)
    L.acquire("b", [0])
    L.grant("b", "p", [0], deadline=10.0)
    L.reject("b")
    assert_refused(L, call, InvalidField)
    assert L.inspect().clock is None  # a refused expire did not set the clock either


@pytest.mark.parametrize(
    ("ids", "exc"),
    [
        ([2, 2], DuplicateBlockIds),
        (np.array([1.0]), InvalidBlockIds),
        (np.array([True]), InvalidBlockIds),
    ],
    ids=["duplicate", "float-array", "bool-array"],
)
@pytest.mark.parametrize("shared", [False, True])
def test_issue_duplicates_and_non_integer_arrays_have_their_own_class(
    ids: object, exc: type[Exception], shared: bool
) -> None:
    L = BlockLedger(4)
    L.acquire("o", [1])
    with pytest.raises(exc) as info:
        L.acquire("r", ids, shared=shared)  # type: ignore[arg-type]
    assert not isinstance(info.value, BlockOutOfRange)
    assert isinstance(info.value, errors.BlockError)
    assert info.value.kind in ("duplicate_block_ids", "invalid_block_ids")


def test_issue_state_of_a_released_request_is_unknown_not_a_double_release() -> None:
    L = BlockLedger(2)
    L.acquire("r", [0])
    L.finish("r")
    L.release("r")
    with pytest.raises(UnknownRequest) as info:
        L.state("r")
    assert not isinstance(info.value, DoubleRelease)
    with pytest.raises(DoubleRelease):
        L.release("r")


# --------------------------------------------------------------------------- counters never wrap


def test_holder_limit_is_refused_at_the_limit_never_wrapped() -> None:
    """The real limit (65,535 sharers: under a second, shared acquire being O(batch))."""
    L = BlockLedger(4)
    L.acquire("owner", [0, 1])
    for i in range(BlockLedger.MAX_SHARERS):
        L.acquire(i, [0], shared=True)
    assert L.holders([0, 1]).tolist() == [BlockLedger.MAX_SHARERS + 1, 1]
    before = snapshot(L)
    with pytest.raises(HolderLimit) as info:
        L.acquire("one-too-many", [1, 0], shared=True)  # block 1 could take it; 0 cannot
    assert info.value.kind == "holder_limit"
    assert snapshot(L) == before
    # Before: the counter wrapped to 0, so the owner's release handed block 0 back while it
    # was shared and allocate gave it to an intruder.
    L.finish("owner")
    assert L.release("owner").tolist() == [1]
    assert L.holders([0]).tolist() == [BlockLedger.MAX_SHARERS]
    assert 0 not in L.allocate("intruder", 2).tolist()
    # One sharer lets go: there is room for one more, and only one.
    L.finish(0)
    assert L.release(0).tolist() == []
    L.acquire("one-more", [0], shared=True)
    with pytest.raises(HolderLimit):
        L.acquire("and-another", [0], shared=True)


def test_unsettled_counter_widens_before_it_could_wrap() -> None:
    """65,536 open write grants on one block: the counter would read 0 in uint16 and let a
    sharer in under an open write grant. It widens to uint32 first."""
    L = BlockLedger(3)
    L.acquire("x", [1])
    L.acquire("y", [1], shared=True)  # the ledger shares: the counter is kept from here on
    L.acquire("w", [0])
    n = 1 << 16
    held = L.blocks_of("w")  # the held batch itself: grant's fast path
    for _ in range(n):
        L.grant("w", "p", held, Access.WRITE)
    assert L.inspect().unsettled.dtype == np.uint32
    assert int(L.inspect().unsettled[0]) == n
    before = snapshot(L)
    with pytest.raises(errors.BlockUnavailable):
        L.acquire("s", [0], shared=True)
    assert snapshot(L) == before
    # One fence closes them all (while the owner runs: one pass, no request transition);
    # the content is then settled and may be shared.
    L.apply(AccessRevoked("p"))
    assert int(L.inspect().unsettled[0]) == 0
    L.acquire("s", [0], shared=True)
    assert L.holders([0]).tolist() == [2]


def test_shared_acquire_among_many_sharers_sees_only_write_grants() -> None:
    """The O(batch) check stays exact with many sharers: a sharer that ended with an open read
    grant leaves the block shareable (a reader does not change the content); a write grant on
    a block of the same batch is seen, and refused, until it is proven over."""
    L = BlockLedger(4)
    L.acquire("owner", [0, 1, 2])
    for i in range(2000):
        L.acquire(i, [0, 1], shared=True)
    g = L.grant(1234, "reader", [1], Access.READ)
    L.acquire("ok", [0, 1], shared=True)  # a read grant of a running sharer: settled
    L.reject(1234)  # draining under a read grant: still settled
    L.acquire("late", [1], shared=True)
    gw = L.grant("owner", "writer", [2], Access.WRITE)
    assert_refused(L, lambda L: L.acquire("w", [1, 2], shared=True), errors.BlockUnavailable)
    L.apply(TransferCompleted.of(gw, 0))
    L.acquire("w", [1, 2], shared=True)
    L.apply(TransferCompleted.of(g, 0))
    assert L.holders([0, 1, 2]).tolist() == [2002, 2004, 2]


def test_unsettled_counter_is_built_exactly_at_the_first_shared_acquire() -> None:
    """A ledger that never shared does not keep the counter; the first shared acquire builds it
    from the open grants: open write grants only, whether their request runs or has ended
    (an open read grant, even of a request that ended, does not unsettle a block)."""
    L = BlockLedger(8)
    L.acquire("w", [0, 1])
    L.grant("w", "p", [0])  # open write grant on 0, owner running
    L.acquire("r", [2, 3])
    L.grant("r", "p", [2], Access.READ)
    L.reject("r")  # ended with an open read grant on 2: draining, settled
    L.acquire("k", [4, 5])
    L.grant("k", "p", [4], Access.READ)  # a running owner's read grant: settled
    gw = L.grant("w", "p", [1])
    L.apply(TransferCompleted.of(gw, 0))  # closed: 1 is settled again
    L.acquire("x", [6])
    L.grant("x", "p", [6])
    L.finish("x")  # ended with an open write grant on 6: draining, unsettled
    assert not L.inspect().tracking
    before = L.fingerprint(), L.stats()
    with pytest.raises(errors.BlockUnavailable):
        L.acquire("s", [0], shared=True)  # the first one builds the counter, and refuses
    assert (L.fingerprint(), L.stats()) == before
    assert L.inspect().tracking
    share: list[Any] = [[0], [6], [0, 4], [2, 6]]
    for blocks in share:

        def share_again(L: BlockLedger, b: Any = blocks) -> None:
            L.acquire("s", b, shared=True)

        assert_refused(L, share_again, errors.BlockUnavailable)
    assert L.inspect().unsettled.tolist() == [1, 0, 0, 0, 0, 0, 1, 0]
    L.acquire("s", [1, 2, 3, 4, 5], shared=True)
    assert L.holders(np.arange(7)).tolist() == [1, 2, 2, 2, 2, 2, 1]


# --------------------------------------------------------------------------- the constructor


@pytest.mark.parametrize(
    ("kwargs", "exc"),
    [
        ({"num_blocks": 0}, InvalidField),
        ({"num_blocks": -1}, InvalidField),
        ({"num_blocks": 1.5}, InvalidField),
        ({"num_blocks": 4.0}, InvalidField),
        ({"num_blocks": True}, InvalidField),
        ({"num_blocks": "4"}, InvalidField),
        ({"num_blocks": None}, InvalidField),
        ({"num_blocks": 2**31}, InvalidField),
        ({"num_blocks": 4, "checked": "yes"}, InvalidField),
        ({"num_blocks": 4, "checked": None}, InvalidField),
        ({"num_blocks": 4, "incarnation": ""}, InvalidField),
        ({"num_blocks": 4, "incarnation": 7}, InvalidField),
        ({"num_blocks": 4, "counts": "owner"}, InvalidField),
        ({"num_blocks": 4, "counts": "Engine"}, InvalidField),
        ({"num_blocks": 4, "counts": None}, InvalidField),
        ({"num_blocks": 4, "counts": 1}, InvalidField),
        ({"num_blocks": 4, "counts": ["engine"]}, InvalidField),
    ],
    ids=lambda v: repr(v),
)
def test_constructor_refuses_bad_arguments(kwargs: dict[str, Any], exc: type[Exception]) -> None:
    with pytest.raises(exc):
        BlockLedger(**kwargs)


def test_constructor_accepts_a_numpy_integer() -> None:
    assert BlockLedger(np.int64(4)).num_blocks == 4  # type: ignore[arg-type]


# --------------------------------------------------------------------------- evidence and grants


def _grant() -> Grant:
    L = BlockLedger(4, incarnation="inc")
    L.acquire("r", [0, 1])
    return L.grant("r", "p", [0, 1])


OF_CALLS: list[tuple[str, Callable[[Any], object]]] = [
    ("CancelReceived", CancelReceived.of),
    ("SchedulingStopped", lambda g: SchedulingStopped.of(g, 1)),
    ("TransferQuiesced", lambda g: TransferQuiesced.of(g, through_seq=1)),
    ("TransferCompleted", lambda g: TransferCompleted.of(g, 1)),
    ("AccessRevoked", AccessRevoked.of),
    ("LeaseExpired", LeaseExpired.of),
    ("about", lambda g: about(g, "CancelReceived")),
    ("about-PeerLost", lambda g: about(g, "PeerLost")),
]


@pytest.mark.parametrize(("name", "of"), OF_CALLS, ids=[n for n, _ in OF_CALLS])
@pytest.mark.parametrize(("label", "bad"), NOT_A_GRANT, ids=[n for n, _ in NOT_A_GRANT])
def test_of_refuses_a_non_grant(
    name: str, of: Callable[[Any], object], label: str, bad: object
) -> None:
    with pytest.raises(InvalidField):
        of(bad)
    of(_grant())  # and builds from a real one


SEQ_OF: list[tuple[str, Callable[[Grant, Any], object]]] = [
    ("SchedulingStopped", SchedulingStopped.of),
    ("TransferQuiesced", TransferQuiesced.of),
    ("TransferCompleted", TransferCompleted.of),
    ("about", lambda g, s: about(g, "TransferQuiesced", s)),
]


@pytest.mark.parametrize(("name", "of"), SEQ_OF, ids=[n for n, _ in SEQ_OF])
@pytest.mark.parametrize(("label", "seq"), BAD_SEQS, ids=[n for n, _ in BAD_SEQS])
def test_sequence_numbers_are_ints_within_int64(
    name: str, of: Callable[[Grant, Any], object], label: str, seq: object
) -> None:
    with pytest.raises(InvalidField):
        of(_grant(), seq)
    of(_grant(), inputs.MAX_SEQ)  # the limit itself is a valid sequence number


GID = GrantId("inc", 1)


@pytest.mark.parametrize(
    ("cls", "args"),
    [
        (CancelReceived, (GID, ["r"], "p")),  # unhashable request key
        (CancelReceived, (GID, True, "p")),
        (CancelReceived, (GID, 1.0, "p")),
        (CancelReceived, (GID, "", "p")),
        (CancelReceived, (GID, "r", "")),
        (CancelReceived, (GID, "r", None)),
        (CancelReceived, (None, "r", "p")),
        (CancelReceived, ("inc#1", "r", "p")),
        (SchedulingStopped, (GID, "r", "p", -1)),
        (TransferQuiesced, (GID, "r", "p", 1.0)),
        (TransferCompleted, (GID, "r", "p", True)),
        (AccessRevoked, (7,)),
        (AccessRevoked, ("p", GID, None)),
        (AccessRevoked, ("p", None, "r")),
        (AccessRevoked, ("p", GID, ["r"])),
        (LeaseExpired, (GID, {"r"}, "p")),
        (PeerLost, (None,)),
        (PeerLost, ("",)),
        (GrantId, ("", 1)),
        (GrantId, ("inc", 0)),
        (GrantId, ("inc", True)),
        (GrantId, ("inc", 1.0)),
    ],
)
def test_evidence_constructors_refuse_bad_fields(cls: Any, args: tuple[Any, ...]) -> None:
    with pytest.raises(InvalidField):
        cls(*args)


@pytest.mark.parametrize(
    ("kwargs", "exc"),
    [
        ({"blocks": [0.5]}, InvalidBlockIds),
        ({"blocks": [True]}, InvalidBlockIds),
        ({"blocks": ["0"]}, InvalidBlockIds),
        ({"blocks": None}, InvalidBlockIds),
        ({"blocks": [-1]}, BlockOutOfRange),
        ({"blocks": [0, 0], "generations": [0, 0]}, DuplicateBlockIds),
        ({"generations": [0.0]}, InvalidField),
        ({"generations": [-1]}, InvalidField),
        ({"generations": [2**32]}, InvalidField),
        ({"generations": [0, 0]}, InvalidField),  # one per block
        ({"id": None}, InvalidField),
        ({"id": "inc#1"}, InvalidField),
        ({"request": ["r"]}, InvalidField),
        ({"request": True}, InvalidField),
        ({"peer": ""}, InvalidField),
        ({"access": "write"}, InvalidField),
    ],
    ids=lambda v: repr(v),
)
def test_grant_constructor_refuses_bad_fields(kwargs: dict[str, Any], exc: type[Exception]) -> None:
    fields: dict[str, Any] = {
        "id": GID,
        "request": "r",
        "peer": "p",
        "blocks": [0],
        "generations": [0],
        "access": Access.WRITE,
    }
    with pytest.raises(exc):
        Grant(**{**fields, **kwargs})
    g = Grant(**fields)
    assert g.blocks.tolist() == [0] and not g.blocks.flags.writeable
    assert g.generations.dtype == np.uint32 and not g.generations.flags.writeable


# --------------------------------------------------------------------------- batch calls, restart


class Pairs(Mapping[Any, Any]):
    """A mapping given as a list of pairs: it can carry keys a dict cannot (unhashable ones,
    one key twice), as a hostile or careless caller's own Mapping class may."""

    def __init__(self, pairs: list[tuple[Any, Any]]) -> None:
        self.pairs = pairs

    def __getitem__(self, key: Any) -> Any:
        for k, v in self.pairs:
            if k is key:
                return v
        raise KeyError(key)

    def __iter__(self) -> Iterator[Any]:
        return iter([k for k, _ in self.pairs])

    def __len__(self) -> int:
        return len(self.pairs)

    def items(self) -> Any:
        return list(self.pairs)


def _restart(**kw: Any) -> Call:
    return lambda _L: BlockLedger.after_restart(**{"num_blocks": N, "peers": ["p"], **kw})


def _many_ids_calls(ids: object) -> list[tuple[str, Call]]:
    v: Any = ids
    return [
        ("acquire_many", lambda L: L.acquire_many({"new": v})),
        ("acquire_many-live", lambda L: L.acquire_many({"a": v})),
        ("acquire_many-shared", lambda L: L.acquire_many({"new": v}, shared=True)),
        ("acquire_many-second", lambda L: L.acquire_many({"n1": [9], "n2": v})),
    ]


def _many_key_calls(key: object) -> list[tuple[str, Call]]:
    return [
        ("acquire_many", lambda L: L.acquire_many(Pairs([(key, [FREE_ID])]))),
        ("acquire_many-second", lambda L: L.acquire_many(Pairs([("n1", [9]), (key, [FREE_ID])]))),
    ]


def _batch_table() -> list[Any]:
    """The same bad values, through the calls that take many at once and the restart
    constructor: ``acquire_many`` is all or nothing (it raises the single call's error);
    ``after_restart`` builds a ledger or raises."""
    rows: list[Any] = []
    for label, ids, exc in BAD_IDS:
        calls = _many_ids_calls(ids)
        if ids is not None:  # exposed=None: every block (the default)
            calls.append(("after_restart-exposed", _restart(exposed=ids)))
        for call_name, call in calls:
            rows.append(pytest.param(call, exc, id=f"ids-{label}-{call_name}"))
    for label, key in BAD_KEYS:
        calls = [*_many_key_calls(key), ("after_restart-request", _restart(request=key))]
        for call_name, call in calls:
            rows.append(pytest.param(call, InvalidField, id=f"key-{label}-{call_name}"))
    for label, peer in BAD_PEERS:
        p: Any = peer
        rows.append(pytest.param(_restart(peers=[p]), InvalidField, id=f"peer-{label}-restart"))
        rows.append(
            pytest.param(_restart(peers=["ok", p]), InvalidField, id=f"peer-{label}-restart-2nd")
        )
    for label, peers in [
        ("str", "p"),
        ("empty", []),
        ("none", None),
        ("set", {"p"}),
        ("unhashable-item", [["p"]]),
        ("dict-item", [{"p": 1}]),
        ("bytes", b"p"),
    ]:
        ps: Any = peers
        rows.append(pytest.param(_restart(peers=ps), InvalidField, id=f"peers-{label}-restart"))
    for label, n in BAD_COUNTS:
        nv: Any = n
        rows.append(pytest.param(_restart(num_blocks=nv), InvalidField, id=f"n-{label}-restart"))
    for label, bad in [("str", "yes"), ("int", 1), ("none", None)]:
        f: Any = bad
        rows.append(
            pytest.param(
                lambda L, f=f: L.acquire_many({"new": [8]}, shared=f),
                InvalidField,
                id=f"shared-{label}-acquire_many",
            )
        )
        rows.append(pytest.param(_restart(checked=f), InvalidField, id=f"checked-{label}-restart"))
    for label, bad in [("list", [("a", [8])]), ("none", None), ("str", "a")]:
        h: Any = bad
        rows.append(
            pytest.param(lambda L, h=h: L.acquire_many(h), InvalidField, id=f"holds-{label}")
        )
    rows += [
        pytest.param(
            lambda L: L.acquire_many(Pairs([("n", [8]), ("n", [9])])),
            InvalidField,
            id="holds-one-key-twice",
        ),
        pytest.param(
            lambda L: L.acquire_many({"gone": [8], "b": [9]}),
            errors.IllegalTransition,
            id="acquire_many-ended",
        ),
        pytest.param(_restart(exposed=[1, 1]), DuplicateBlockIds, id="restart-exposed-twice"),
        pytest.param(_restart(counts="owner"), InvalidField, id="restart-counts"),
        pytest.param(_restart(incarnation=""), InvalidField, id="restart-incarnation"),
    ]
    return rows


@pytest.mark.parametrize(("call", "exc"), _batch_table())
@pytest.mark.parametrize("counts", ["ledger", "engine"])
def test_the_batch_calls_and_the_restart_refuse_the_same_bad_values(
    call: Call, exc: type[Exception], counts: Counts
) -> None:
    L = populated(counts=counts)
    assert_refused(L, call, exc)
    L.acquire("after", [FREE_ID])
    assert L.expire(60.0) == ["b"]


def _per_item_table() -> list[Any]:
    """``finish_many`` / ``reject_many`` / ``apply_many`` take each item on its own: a bad
    one is refused as data (the single call's error) between good ones, never raised."""
    rows: list[Any] = []
    for label, key in BAD_KEYS:
        for call in ("finish_many", "reject_many"):
            rows.append(pytest.param(call, key, InvalidField, id=f"key-{label}-{call}"))
    for call in ("finish_many", "reject_many"):
        rows.append(pytest.param(call, "gone", DoubleRelease, id=f"released-{call}"))
        rows.append(pytest.param(call, "never", UnknownRequest, id=f"unknown-{call}"))
        rows.append(pytest.param(call, 10**5000, UnknownRequest, id=f"long-int-{call}"))
    for label, bad in [
        *BAD_KEYS,
        ("cancel-of-another-ledger", CancelReceived(GrantId("other", 1), "a", "p")),
    ]:
        exc = (
            MalformedEvidence if label != "cancel-of-another-ledger" else errors.MismatchedEvidence
        )
        rows.append(pytest.param("apply_many", bad, exc, id=f"evidence-{label}"))
    return rows


@pytest.mark.parametrize(("call", "bad", "exc"), _per_item_table())
@pytest.mark.parametrize("counts", ["ledger", "engine"])
def test_every_batch_call_refuses_each_bad_item_as_data(
    call: str, bad: object, exc: type[Exception], counts: Counts
) -> None:
    L = populated(counts=counts)
    before = snapshot(L, evidence_counters=False)
    out = getattr(L, call)([bad])
    assert [(r.position, r.item is bad, type(r.error)) for r in out.refused] == [(0, True, exc)]
    assert out.transitions == ()
    assert snapshot(L, evidence_counters=False) == before
    # A refused piece of evidence is counted; a refused end is not evidence.
    assert L.stats().refused_evidence == ({exc.kind: 1} if call == "apply_many" else {})  # type: ignore[attr-defined]
