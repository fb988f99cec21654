"""``Evidence.of(grant, ...)`` for a plain ``Grant`` skips re-validating the grant's fields (they
passed the same checks when the grant was built). The evidence it builds must be the very value
the validating constructor builds, and everything the shortcut does not cover (a bad sequence
number, a ``Grant`` subclass, an evidence subclass, not a grant at all) must still go through
the validating constructor and its typed errors.
"""

from __future__ import annotations

from typing import Any

import attrs
import pytest

from kvlifetime import errors
from kvlifetime.evidence import (
    CancelReceived,
    Evidence,
    LeaseExpired,
    SchedulingStopped,
    TransferCompleted,
    TransferQuiesced,
)
from kvlifetime.grant import Access, Grant, GrantId
from kvlifetime.inputs import MAX_SEQ
from kvlifetime.ledger import BlockLedger
from kvlifetime.source import LOCAL

WITH_SEQ: list[Any] = [SchedulingStopped, TransferQuiesced, TransferCompleted]
WITHOUT_SEQ: list[Any] = [CancelReceived, LeaseExpired]


def _grants() -> list[Grant]:
    led = BlockLedger(8)
    led.acquire("r", [0, 1])
    led.acquire(7, [2])
    built = Grant(GrantId("x", 3), "s", "peer-9", [4, 5], [1, 1], Access.READ)
    return [led.grant("r", "p", [0, 1]), led.grant(7, "q", [2], Access.READ), built]


def _validated(cls: Any, g: Grant, *seq: int) -> Evidence:
    ev: Evidence = cls(g.id, g.request, g.peer, *seq)
    return ev


@pytest.mark.parametrize("g", _grants(), ids=["ledger", "ledger-int-key", "constructor"])
def test_the_shortcut_builds_what_the_validating_constructor_builds(g: Grant) -> None:
    cases: list[tuple[Any, tuple[int, ...]]] = [(c, ()) for c in WITHOUT_SEQ]
    cases += [(c, (n,)) for c in WITH_SEQ for n in (0, 1, MAX_SEQ)]
    for cls, seq in cases:
        ev = cls.of(g, *seq)
        ref = _validated(cls, g, *seq)
        assert type(ev) is cls
        assert ev == ref and hash(ev) == hash(ref)
        assert attrs.asdict(ev, recurse=False) == attrs.asdict(ref, recurse=False)
        assert ev.source is LOCAL
        with pytest.raises(attrs.exceptions.FrozenInstanceError):
            ev.peer = "other"  # still frozen


@pytest.mark.parametrize("cls", WITH_SEQ)
@pytest.mark.parametrize("bad", [-1, MAX_SEQ + 1, True, 1.0, "1", None])
def test_a_bad_sequence_number_is_refused_as_before(cls: Any, bad: Any) -> None:
    g = _grants()[0]
    with pytest.raises(errors.InvalidField):
        cls.of(g, bad)


@pytest.mark.parametrize("cls", WITHOUT_SEQ + WITH_SEQ)
@pytest.mark.parametrize("bad", [None, "grant", GrantId("x", 1)])
def test_not_a_grant_is_refused_as_before(cls: Any, bad: Any) -> None:
    args = (0,) if cls in WITH_SEQ else ()
    with pytest.raises(errors.InvalidField):
        cls.of(bad, *args)


def test_subclasses_take_the_validating_constructor() -> None:
    seen: list[object] = []

    def _record(_inst: object, _a: object, value: object) -> None:
        seen.append(value)

    @attrs.frozen(slots=True)
    class Audited(TransferCompleted):
        note: str = attrs.field(default="n", validator=_record)

    g = _grants()[0]
    ev = Audited.of(g, 2)
    assert type(ev) is Audited and seen == ["n"]  # its own validator ran

    @attrs.frozen(slots=True, eq=False)
    class MyGrant(Grant):
        pass

    # A subclass may store what Grant's own constructor would refuse: it is checked again.
    mine = object.__new__(MyGrant)
    for name in ("id", "peer", "blocks", "generations", "access"):
        object.__setattr__(mine, name, getattr(g, name))
    object.__setattr__(mine, "request", "")
    for cls, seq in [(TransferCompleted, (0,)), (CancelReceived, ()), (TransferQuiesced, (1,))]:
        with pytest.raises(errors.InvalidField):
            cls.of(mine, *seq)  # type: ignore[attr-defined]
