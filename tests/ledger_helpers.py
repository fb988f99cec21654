"""Shared helpers for the BlockLedger tests: whole-state assertions, h11-style; evidence made
from a claim code (``spec.proof.CODE_OF``)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from kvlifetime.evidence import (
    AccessRevoked,
    Evidence,
    LeaseExpired,
    PeerLost,
    SchedulingStopped,
    TransferCompleted,
    TransferQuiesced,
)
from kvlifetime.grant import Grant, RequestKey
from kvlifetime.ledger import BlockLedger
from kvlifetime.spec.proof import CODE_OF
from kvlifetime.spec.vocabulary import BlockState, RequestState

F = BlockState.FREE
O = BlockState.OWNED  # noqa: E741
X = BlockState.EXPOSED
D = BlockState.DRAINING
Q = BlockState.QUIESCED
QQ = BlockState.QUARANTINED


def all_ids(ledger: BlockLedger) -> np.ndarray:
    return np.arange(ledger.num_blocks, dtype=np.int64)


def assert_whole_state(
    ledger: BlockLedger,
    *,
    requests: Mapping[RequestKey, RequestState],
    blocks: Sequence[BlockState],
    generations: Sequence[int] | None = None,
    holders: Sequence[int] | None = None,
) -> None:
    """Assert everything observable about the ledger at once."""
    ids = all_ids(ledger)
    assert sorted(map(repr, ledger.live_requests())) == sorted(map(repr, requests))
    assert {k: ledger.state(k) for k in requests} == dict(requests)
    got_blocks = [BlockState(int(c)) for c in ledger.block_state(ids)]
    assert got_blocks == list(blocks)
    if generations is not None:
        assert ledger.generation(ids).tolist() == list(generations)
    if holders is not None:
        assert ledger.holders(ids).tolist() == list(holders)
    st = ledger.stats()
    assert st.num_blocks == ledger.num_blocks
    assert sum(st.blocks_by_state.values()) == ledger.num_blocks
    assert st.blocks_by_state == {s.label: list(blocks).count(s) for s in BlockState}
    expected_reqs = {s.value: 0 for s in RequestState if s is not RequestState.RELEASED}
    for s in requests.values():
        expected_reqs[s.value] += 1
    assert st.requests_by_state == expected_reqs
    assert ledger.free_count() == list(blocks).count(BlockState.FREE)
    assert st.open_grants == sum(len(ledger.open_grants(k)) for k in requests)


_CLAIM = {code: cls for cls, code in CODE_OF.items()}


def evidence_of(code: int, g: Grant, seq: int = 0, fence: str = "f") -> Evidence:
    """The piece of evidence of claim ``code`` about grant ``g`` (``seq``: its last_seq or
    through_seq where it has one; ``PeerLost`` names ``g``'s peer)."""
    cls = _CLAIM[code]
    if cls in (SchedulingStopped, TransferCompleted, TransferQuiesced):
        return cls.of(g, seq)
    if cls is AccessRevoked:
        return AccessRevoked.of(g, fence=fence)
    if cls is PeerLost:
        return PeerLost(g.peer)
    if cls is LeaseExpired:
        return LeaseExpired.of(g)
    return cls.of(g)  # type: ignore[attr-defined,no-any-return]
