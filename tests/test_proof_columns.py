"""``ProofColumns`` (the evidence rules over columns, for a whole step at once) against
``GrantProof`` (the same rules, one grant at a time): for any sequence of claims on any rows,
the same contradictions refused, the same "anything new" answers, the same facts after, row by
row."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from ledger_helpers import evidence_of

from kvlifetime.errors import ContradictoryEvidence
from kvlifetime.evidence import (
    Evidence,
)
from kvlifetime.grant import Access, Grant, GrantId
from kvlifetime.spec.proof import COMPLETED, QUIESCED, STOPPED, GrantProof, ProofColumns

ROWS = 4
GRANTS = [
    Grant(GrantId("t", i + 1), f"r{i}", "peer", np.array([i]), np.array([0]), Access.WRITE)
    for i in range(ROWS)
]


def _evidence(code: int, row: int, seq: int) -> Evidence:
    return evidence_of(code, GRANTS[row], seq)


claims = st.lists(
    st.tuples(
        st.integers(1, 7),  # claim code
        st.lists(st.integers(0, ROWS - 1), min_size=1, max_size=ROWS, unique=True),  # rows
        st.integers(0, 4),  # seq
    ),
    max_size=25,
)


@settings(max_examples=400, deadline=None)
@given(claims)
def test_columns_agree_with_one_grant_at_a_time(steps: list[tuple[int, list[int], int]]) -> None:
    cols = ProofColumns()
    for _ in range(ROWS):
        cols.add()
    one = [GrantProof() for _ in range(ROWS)]
    for code, rows, seq in steps:
        for r in rows:
            ev = _evidence(code, r, seq)
            try:
                one[r].check(ev)
                expect_bad = False
            except ContradictoryEvidence:
                expect_bad = True
            assert cols.contradicts(r, code, seq) is expect_bad
            if not expect_bad:
                assert cols.record(r, code, seq) is one[r].record(ev)
        for r in range(ROWS):
            assert cols.proof(r).key() == one[r].key(), (r, code)
            assert cols.closed(r) is one[r].closed
            assert cols.cancel_acknowledged(r) is one[r].cancel_acknowledged
            assert cols.scheduling_stopped(r) is one[r].scheduling_stopped


def test_a_weaker_report_and_a_contradiction() -> None:
    cols = ProofColumns()
    a, b = cols.add(), cols.add()
    assert cols.record(a, QUIESCED, 5) and cols.record(b, QUIESCED, 5)
    assert not cols.record(a, QUIESCED, 3) and cols.record(b, QUIESCED, 6)  # late, true
    assert cols.record(a, STOPPED, 5) and cols.record(b, STOPPED, 5)
    assert cols.closed(a) and cols.closed(b)
    assert not cols.contradicts(a, COMPLETED, 5) and cols.contradicts(b, COMPLETED, 4)
    cols.reset(b)
    assert cols.proof(b).key() == GrantProof().key()
