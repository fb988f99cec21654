"""A bug found by ``test_ledger_stateful``'s ``grant_many`` rule (``RequestTable.hold_and_grant``):
``acquire_and_grant(..., shared=True)`` whose shared hold is the ledger's first (it starts the
per-block open-grant counters) decided whether to count its own new grant *before* the hold
started them, so the new grant was never counted: once the other grants on the block closed,
``open_access`` said the block was not exposed while that grant was still open (what the vLLM
guard's ``handed_out`` reads). Fixed: the decision is made inside the deferred call."""

from __future__ import annotations

import pytest

from kvlifetime.evidence import TransferCompleted
from kvlifetime.grant import Access
from kvlifetime.ledger import BlockLedger


@pytest.mark.parametrize("batch", [False, True])
def test_a_grant_opened_by_the_first_shared_hold_is_counted(batch: bool) -> None:
    led = BlockLedger(8)
    led.acquire("a", [0])
    first = led.grant("a", "p", [0], Access.READ)
    assert not led.inspect().tracking
    if batch:
        out = led.acquire_and_grant_many([("n", [0], "q", Access.READ)], shared=True)
        assert out.ok
    else:
        led.acquire_and_grant("n", [0], "q", Access.READ, shared=True)
    assert led.inspect().readers.tolist()[0] == 2  # two open read grants on block 0
    led.apply(TransferCompleted.of(first, 1))
    assert led.open_grants("n")  # still open: block 0 is exposed to "q"
    assert led.open_access([0]).tolist() == [1]
