"""Snapshots of the ledger's parts (``kvlifetime.ledger.snapshot``): a field added to a part is
copied by its kind without anyone restating it, and a field the copier cannot copy safely is
refused loudly instead of being shared between a copy and its original."""

from __future__ import annotations

import collections

import numpy as np
import pytest

from kvlifetime.evidence import TransferCompleted
from kvlifetime.grant import Access
from kvlifetime.ledger import COUNTS, BlockLedger, Counts
from kvlifetime.ledger.snapshot import copy_slots, slots_of


class _Base:
    __slots__ = ("arr", "n")

    def __init__(self) -> None:
        self.arr = np.zeros(3, dtype=np.int64)
        self.n = 1


class _Part(_Base):
    __slots__ = ("counter", "frozen", "keys", "later", "ordered")

    def __init__(self) -> None:
        super().__init__()
        self.keys: dict[str, None] = {"a": None}
        self.counter: collections.Counter[str] = collections.Counter(x=1)
        self.ordered: collections.OrderedDict[int, None] = collections.OrderedDict({1: None})
        ro = np.arange(2, dtype=np.int64)
        ro.flags.writeable = False
        self.frozen = [ro]
        self.later = "a field added later"


def test_every_slot_of_the_class_and_its_bases_is_copied_by_its_kind() -> None:
    part = _Part()
    dup = copy_slots(part)
    assert slots_of(_Part) == ("arr", "n", "counter", "frozen", "keys", "later", "ordered")
    for name in slots_of(_Part):
        if name not in ("arr", "frozen"):
            assert getattr(dup, name) == getattr(part, name)
    assert dup.arr is not part.arr and dup.arr.tolist() == [0, 0, 0]
    assert dup.keys is not part.keys and dup.counter is not part.counter
    assert type(dup.ordered) is collections.OrderedDict and dup.ordered is not part.ordered
    assert dup.frozen is not part.frozen and dup.frozen[0] is part.frozen[0]  # read-only: shared
    assert dup.later == "a field added later"
    dup.arr[0] = 7
    dup.keys["b"] = None
    assert part.arr[0] == 0 and "b" not in part.keys


@pytest.mark.parametrize(
    "value",
    [
        object(),
        {"k": [1]},  # a container of mutable values: records, say
        [np.zeros(2)],  # a writable array inside a list
        {frozenset(): set()},
    ],
)
def test_a_field_of_a_kind_it_cannot_copy_safely_is_refused(value: object) -> None:
    part = _Part()
    part.later = value  # type: ignore[assignment]
    with pytest.raises(TypeError, match="later"):
        copy_slots(part)
    assert copy_slots(part, later="said how")  # the part says how: no refusal


@pytest.mark.parametrize("counts", COUNTS)
def test_a_copy_and_its_original_go_their_own_ways(counts: Counts) -> None:
    led = BlockLedger(8, counts=counts, checked=True)
    led.acquire("a", [0, 1])
    led.acquire("b", [1], shared=True)
    g = led.grant("a", "p", [0], Access.WRITE, deadline=5.0)
    led.open_access([0])
    led.reject("a")
    dup = led.copy()
    assert dup.fingerprint() == led.fingerprint() and dup.stats() == led.stats()
    before = led.fingerprint(), led.stats(), led.inspect().unsettled.tolist()
    dup.apply(TransferCompleted.of(g, 0))
    dup.collect_releasable()
    dup.acquire("c", [3])
    dup.expire(9.0)
    assert (led.fingerprint(), led.stats(), led.inspect().unsettled.tolist()) == before
    assert led.state("a").value == "rejected" and "a" not in dup.live_requests()
