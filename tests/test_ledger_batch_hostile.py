"""Hostile arguments: a refusal changes nothing and a batch never stops half-way (issue 20,
item 9).

Each case here was reproduced on the code before the fix: an item whose ``repr`` raises or
nests without end aborted ``apply_many`` / ``finish_many`` / ``reject_many`` half-applied (the
error message's own formatting raised); a mapping naming one request twice left it admitted
when ``acquire_many`` refused the batch; a mapping whose ``values()`` disagree with its keys
left a block held by nobody; a sequence that changes between walks got another value stored
than the one checked; ``str`` / ``int`` / ``float`` subclasses were stored through their own
``__str__`` / ``__int__`` / ``__float__``; unhashable peers made ``after_restart`` raise
``TypeError``.
"""

from __future__ import annotations

from collections.abc import Iterator, MutableMapping, Sequence
from typing import Any

import numpy as np
import pytest
import structlog
from structlog.testing import capture_logs

from kvlifetime import errors
from kvlifetime.errors import InvalidField, KVLifetimeError, MalformedEvidence, show
from kvlifetime.evidence import TransferCompleted
from kvlifetime.grant import Access
from kvlifetime.ledger import BlockLedger, Transition


class ReprRaises:
    def __repr__(self) -> str:
        raise RuntimeError("no repr for you")


class KeyReprRaises(str):
    """A request key whose characters are fine and whose ``repr`` raises."""

    def __repr__(self) -> str:
        raise RuntimeError("no repr for you")


def nested(depth: int) -> list[Any]:
    outer: list[Any] = []
    cur = outer
    for _ in range(depth):
        inner: list[Any] = []
        cur.append(inner)
        cur = inner
    return outer


def self_referencing() -> list[Any]:
    s: list[Any] = []
    s.append(s)
    return s


HOSTILE: list[tuple[str, Any]] = [
    ("repr-raises", ReprRaises()),
    ("nested-10**5", nested(10**5)),
    ("self-referencing", self_referencing()),
    ("int-of-5000-digits", 10**5000),  # repr raises ValueError past 4,300 digits
    ("str-key-whose-repr-raises", KeyReprRaises("nobody")),
]
# What the single call refuses each with: a key of the wrong type, or a well-formed key of a
# request that does not exist.
END_ERROR: dict[str, type[KVLifetimeError]] = {
    "repr-raises": InvalidField,
    "nested-10**5": InvalidField,
    "self-referencing": InvalidField,
    "int-of-5000-digits": errors.UnknownRequest,
    "str-key-whose-repr-raises": errors.UnknownRequest,
}


def test_show_is_bounded_and_never_raises() -> None:
    for _, value in HOSTILE:
        text = show(value)
        assert isinstance(text, str) and 0 < len(text) <= 80
    assert show(10**5000) == "<int of 16610 bits>"
    assert show("a" * 1000, 20) == repr("a" * 1000)[:17] + "..."
    assert show([1, [2, [3, [4, [5]]]]]) == "[1, [2, [3, [...]]]]"


def _ledger() -> tuple[BlockLedger, Any]:
    led = BlockLedger(8, incarnation="inc")
    for key, block in (("a", 0), ("b", 1), ("c", 2)):
        led.acquire(key, [block])
    ga = led.grant("a", "p", [0])
    gc = led.grant("c", "p", [2])
    return led, (ga, gc)


@pytest.fixture(params=[False, True], ids=["silent", "logging"])
def logging(request: pytest.FixtureRequest) -> Iterator[list[MutableMapping[str, Any]] | None]:
    if not request.param:
        yield None
        return
    with capture_logs() as cap:
        yield cap
    structlog.reset_defaults()


@pytest.mark.parametrize(("label", "bad"), HOSTILE, ids=[h[0] for h in HOSTILE])
@pytest.mark.parametrize("call", ["finish_many", "reject_many"])
def test_a_hostile_key_is_refused_between_good_ones_never_raised(
    label: str, bad: Any, call: str, logging: list[MutableMapping[str, Any]] | None
) -> None:
    led, _ = _ledger()
    ref = led.copy()
    single = getattr(ref, call.removesuffix("_many"))
    expected: list[Transition] = [*single("a"), *single("c")]
    out = getattr(led, call)(["a", bad, "c"])
    assert [(r.position, r.item is bad, type(r.error)) for r in out.refused] == [
        (1, True, END_ERROR[label])
    ]
    assert list(out.transitions) == expected  # both good ones, as the single calls do them
    assert led.fingerprint() == ref.fingerprint()
    if logging is not None:
        warned = [e for e in logging if e["event"] == f"{call.removesuffix('_many')}_refused"]
        assert [(e["error"], len(e["request"]) <= 80) for e in warned] == [
            (END_ERROR[label].kind, True)
        ]


@pytest.mark.parametrize(("label", "bad"), HOSTILE, ids=[h[0] for h in HOSTILE])
def test_a_hostile_piece_of_evidence_is_refused_between_good_ones_never_raised(
    label: str, bad: Any, logging: list[MutableMapping[str, Any]] | None
) -> None:
    led, (ga, gc) = _ledger()
    led.finish("a")
    led.finish("c")
    ref = led.copy()
    expected = [*ref.apply(TransferCompleted.of(ga, 0)), *ref.apply(TransferCompleted.of(gc, 0))]
    out = led.apply_many([TransferCompleted.of(ga, 0), bad, TransferCompleted.of(gc, 0)])
    assert [(r.position, r.item is bad, type(r.error)) for r in out.refused] == [
        (1, True, MalformedEvidence)
    ]
    assert list(out.transitions) == expected
    assert led.fingerprint() == ref.fingerprint()
    assert led.stats().refused_evidence == {"malformed_evidence": 1}
    if logging is not None:
        (warned,) = [e for e in logging if e["event"] == "evidence_refused"]
        assert warned["error"] == "malformed_evidence" and len(warned["evidence"]) <= 200


@pytest.mark.parametrize(("label", "bad"), HOSTILE, ids=[h[0] for h in HOSTILE])
def test_a_hostile_single_call_raises_its_own_error(label: str, bad: Any) -> None:
    led, _ = _ledger()
    before = led.fingerprint()
    with pytest.raises(END_ERROR[label]):
        led.finish(bad)
    with pytest.raises(MalformedEvidence):
        led.apply(bad)
    assert led.fingerprint() == before


# --------------------------------------------------------------------------- acquire_many


class Pairs(dict[Any, Any]):
    """A dict subclass whose ``items()`` (and iteration) name one key twice."""

    def __init__(self, pairs: list[tuple[Any, Any]]) -> None:
        super().__init__(pairs)
        self.pairs = pairs

    def __iter__(self) -> Iterator[Any]:
        return iter([k for k, _ in self.pairs])

    def __len__(self) -> int:
        return len(self.pairs)

    def items(self) -> Any:
        return list(self.pairs)

    def values(self) -> Any:
        return [v for _, v in self.pairs]


class ValuesDisagree(dict[Any, Any]):
    """A dict whose ``values()`` are not the values of its keys (one fewer, and shifted)."""

    def values(self) -> Any:
        return list(super().values())[1:]


@pytest.mark.parametrize("shared", [False, True])
@pytest.mark.parametrize("counts", ["ledger", "engine"])
def test_acquire_many_naming_a_request_twice_admits_nobody(shared: bool, counts: Any) -> None:
    led = BlockLedger(8, counts=counts)
    led.acquire("held", [5, 6])
    before = led.fingerprint(), led.free_count()
    ids = [5] if shared else [1]
    with pytest.raises(InvalidField):
        led.acquire_many(Pairs([("a", ids), ("a", [7] if not shared else [6])]), shared=shared)
    assert (led.fingerprint(), led.free_count()) == before
    assert led.live_requests() == ["held"]


@pytest.mark.parametrize("counts", ["ledger", "engine"])
def test_acquire_many_pairs_each_request_with_its_own_ids(counts: Any) -> None:
    led = BlockLedger(8, counts=counts)
    ref = led.copy()
    led.acquire_many(ValuesDisagree({"a": [1], "b": [2, 3], "c": [4]}))
    for key, ids in (("a", [1]), ("b", [2, 3]), ("c", [4])):
        ref.acquire(key, ids)
    assert led.fingerprint() == ref.fingerprint()
    # No block is marked taken without a holder: every block not held is free.
    assert led.free_count() == 8 - 4
    assert led.holders(np.arange(8)).tolist() == [0, 1, 1, 1, 1, 0, 0, 0]


# --------------------------------------------------------------------------- one walk


class Shifty(Sequence[Any]):
    """Block ids that are ints on the first walk and floats on every later one."""

    def __init__(self, first: list[int], later: list[float]) -> None:
        self.first, self.later, self.walks = first, later, 0

    def _now(self) -> list[Any]:
        return self.first if self.walks == 0 else self.later

    def __iter__(self) -> Iterator[Any]:
        items = self._now()
        self.walks += 1
        return iter(items)

    def __len__(self) -> int:
        return len(self._now())

    def __getitem__(self, i: Any) -> Any:
        return self._now()[i]


def shifty() -> Shifty:
    return Shifty([3, 4], [5.9, 6.9])


@pytest.mark.parametrize(
    ("call", "shared"),
    [
        (lambda L, v: L.acquire("r", v), False),
        (lambda L, v: L.acquire("r", v, shared=True), True),
        (lambda L, v: L.acquire_many({"r": v}), False),
        (lambda L, v: L.acquire_many({"r": v, "s": [7]}, shared=True), True),
        (lambda L, v: L.acquire_and_grant("r", v, "p", Access.READ), False),
    ],
    ids=["acquire", "acquire-shared", "acquire_many", "acquire_many-shared", "acquire_and_grant"],
)
def test_ids_that_change_between_walks_are_stored_as_checked(call: Any, shared: bool) -> None:
    led = BlockLedger(8)
    if shared:
        led.acquire("owner", [3, 4, 5, 6, 7])  # something to share
    call(led, shifty())
    assert led.blocks_of("r").tolist() == [3, 4]


def test_ids_that_change_between_walks_are_stored_as_checked_by_grant_and_restart() -> None:
    led = BlockLedger(8)
    led.acquire("r", [3, 4, 5, 6])
    g = led.grant("r", "p", shifty())
    assert g.blocks.tolist() == [3, 4]
    assert led.generation(shifty()).tolist() == [0, 0]
    r = BlockLedger.after_restart(8, peers=["p"], exposed=shifty())
    assert r.blocks_of("previous-incarnation").tolist() == [3, 4]
    assert r.free_count() == 6


class ShiftyEvidence(Sequence[Any]):
    """A batch of evidence that is one piece on the first walk and another on later ones."""

    def __init__(self, first: Any, later: Any) -> None:
        self.items, self.walks = [first, later], 0

    def __iter__(self) -> Iterator[Any]:
        item = self.items[min(self.walks, 1)]
        self.walks += 1
        return iter([item])

    def __len__(self) -> int:
        return 1

    def __getitem__(self, i: Any) -> Any:
        return self.items[min(self.walks, 1)]


def test_a_batch_of_evidence_is_walked_once() -> None:
    led, (ga, _) = _ledger()
    led.finish("a")
    good = TransferCompleted.of(ga, 0)
    out = led.apply_many(ShiftyEvidence(good, ReprRaises()))
    assert out.refused == ()
    assert led.collect_releasable()["a"].tolist() == [0]


def test_a_batch_whose_walk_raises_is_refused_whole() -> None:
    class Broken(Sequence[Any]):
        def __iter__(self) -> Iterator[Any]:
            raise RuntimeError("broken iterator")

        def __len__(self) -> int:
            return 1

        def __getitem__(self, i: Any) -> Any:
            raise RuntimeError("broken")

    led, _ = _ledger()
    before = led.fingerprint()
    for call in (led.finish_many, led.reject_many, led.apply_many):
        with pytest.raises(InvalidField):
            call(Broken())
    with pytest.raises(errors.InvalidBlockIds):
        led.acquire("n", Broken())
    assert led.fingerprint() == before


# --------------------------------------------------------------------------- plain values


class Name(str):
    """A str subclass that lies: another ``__str__``, one hash for all, equal to anything."""

    def __str__(self) -> str:
        return "somebody-else"

    def __hash__(self) -> int:
        return 0

    def __eq__(self, other: object) -> bool:
        return True

    def __ne__(self, other: object) -> bool:
        return False


class Number(int):
    def __int__(self) -> int:
        return 99

    def __index__(self) -> int:
        return 98

    def __hash__(self) -> int:
        return 0

    def __eq__(self, other: object) -> bool:
        return True


class Moment(float):
    def __float__(self) -> float:
        return float("nan")


def test_subclasses_are_stored_as_the_plain_value_their_checks_saw() -> None:
    led = BlockLedger(8)
    led.acquire(Name("a"), [Number(1)], deadline=Moment(5.0))
    (key,) = led.live_requests()
    assert (type(key), key) == (str, "a")
    assert led.blocks_of("a").tolist() == [1]
    deadline = led.inspect().requests["a"].deadline
    assert (type(deadline), deadline) == (float, 5.0)
    led.acquire(Number(7), [2])
    assert sorted(map(repr, led.live_requests())) == ["'a'", "7"]
    assert type(next(k for k in led.live_requests() if k != "a")) is int
    g = led.grant("a", Name("p"), [1])
    assert (type(g.peer), g.peer) == (str, "p")
    assert led.allocate("n", Number(2)).tolist() == [0, 3]  # two blocks, not 99
    led.set_deadline(7, Moment(9.0))
    assert led.inspect().requests[7].deadline == 9.0
    led.expire(Moment(1.0))
    assert led.inspect().clock == 1.0
    led.reject(Name("a"), Name("why"))
    assert led.state("a").value == "rejected"
    r = BlockLedger.after_restart(Number(4), peers=[Name("p0")], request=Name("old"))
    assert r.num_blocks == 4 and type(r.num_blocks) is int
    assert [(type(x.peer), x.peer) for x in r.grants_of("old")] == [(str, "p0")]
    assert r.live_requests() == ["old"] and type(r.live_requests()[0]) is str


class Alias(str):
    def __str__(self) -> str:
        return "somebody-else"


class Count(int):
    def __int__(self) -> int:
        return 99

    def __index__(self) -> int:
        return 98


def test_acquire_many_stores_plain_keys_and_ids() -> None:
    led = BlockLedger(8)
    # (A dict of them: keys that hash and compare as their plain values.)
    holds: dict[Any, Any] = {Alias("a"): [Number(1)], Count(5): (Number(2), 3)}
    led.acquire_many(holds)
    assert sorted(map(repr, led.live_requests())) == ["'a'", "5"]
    assert all(type(k) in (str, int) for k in led.live_requests())
    assert led.blocks_of("a").tolist() == [1] and led.blocks_of(5).tolist() == [2, 3]


@pytest.mark.parametrize(
    "peers",
    [[["p"]], [{"p": 1}], [set()], ["p", ["q"]], [np.array([1])]],
    ids=["list", "dict", "set", "second", "ndarray"],
)
def test_after_restart_refuses_unhashable_peers_with_a_typed_error(peers: Any) -> None:
    with pytest.raises(InvalidField):
        BlockLedger.after_restart(4, peers=peers)
