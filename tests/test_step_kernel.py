"""Issue 32's compiled kernel (``bench/step_kernel.pyx``, the step path in C) held to
``StepRows`` call by call: new requests granted over checked blocks, ends of every kind
(finished, rejected, unknown, released lately, ended twice), every claim kind with any sequence
number on open and closed grants, collects. After each call: the same transitions in the same
order, the same refusals, the same releases (keys, blocks, order), the same per-block counts and
generations, the same state and counters for every live request, the same open grants.

Built with Cython and the system's C compiler (the ``test`` extra has Cython): a missing
compiler fails here, it does not skip."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bench.step_kernel import load, new_kernel
from kvlifetime.ledger.block_rows import READ, WRITE
from kvlifetime.ledger.request_rows import CODE, EVENT_CODE, OPEN, RUNNING, SUSPECT, UNCANCELLED
from kvlifetime.ledger.step_rows import StepRows

NUM_BLOCKS = 48
CLAIMS = range(1, 8)  # every claim code of spec.proof


@pytest.fixture(scope="module")
def kernel_mod() -> Any:
    return load()


class Pair:
    """The kernel and ``StepRows`` on one workload, compared after every call."""

    def __init__(self, mod: Any) -> None:
        self.rows = StepRows(NUM_BLOCKS)
        b = self.rows.blocks
        self.k = new_kernel(mod, NUM_BLOCKS)
        self.k_blocks = (
            self.k.sharers_arr,
            self.k.unsettled_arr,
            self.k.readers_arr,
            self.k.generation_arr,
        )
        self.r_blocks: Callable[[], tuple[Any, ...]] = lambda: (
            b.sharers,
            b.unsettled,
            b.readers,
            b.generation,
        )
        self.handles: dict[str, int] = {}  # key -> its grant's row (the same on both sides)
        self.next_key = 0

    def recent(self, ages: list[int]) -> list[str]:
        """The keys ``ages`` name: 0 the newest key handed out (one past it: never used)."""
        return [f"k{self.next_key - 1 - a}" for a in ages]

    def free_blocks(self) -> list[int]:
        return [int(i) for i in np.flatnonzero(self.rows.blocks.sharers == 0)]

    def grant(self, n: int, lens: list[int], access: int) -> None:
        keys = [f"k{self.next_key + i}" for i in range(n)]
        self.next_key += n
        free = self.free_blocks()
        lens = lens[:n]
        if len(lens) < n or sum(lens) > len(free):
            return
        ids = np.array(free[: sum(lens)], dtype=np.int64)
        ids.flags.writeable = False
        if not self.rows.blocks.fresh_allowed(ids, access):
            return
        got_r = self.rows.acquire_and_grant_many(keys, ids, lens, access, None, True)
        got_k = self.k.grant_fresh(keys, ids, lens, access, None)
        assert got_r == got_k
        self.handles.update(zip(keys, got_k, strict=True))

    def end(self, keys: list[str], event: str) -> None:
        mr: list[tuple[int, int, int]] = []
        mk: list[tuple[int, int, int]] = []
        ref_r = self.rows.end(keys, event, mr)
        ref_k = self.k.end(keys, EVENT_CODE[event], mk)
        assert [(i, type(e).__name__) for i, e in ref_r] == ref_k
        assert mr == mk

    def prove(self, keys: list[str], code: int, seqs: list[int]) -> None:
        live = [k for k in keys if k in self.rows.slot_of]
        rows = [self.handles[k] for k in live]
        seqs = seqs[: len(rows)] + [0] * (len(rows) - len(seqs))
        mr: list[tuple[int, int, int]] = []
        mk: list[tuple[int, int, int]] = []
        assert self.rows.prove(rows, code, seqs, mr) == self.k.prove(rows, code, seqs, mk)
        assert mr == mk

    def collect(self) -> None:
        mr: list[tuple[int, int, int]] = []
        mk: list[tuple[int, int, int]] = []
        got_r = self.rows.collect(mr)
        got_k = self.k.collect(mk)
        assert list(got_r) == list(got_k)
        for key in got_r:
            assert got_r[key].tolist() == got_k[key].tolist()
        assert mr == mk

    def check(self) -> None:
        for a, b in zip(self.r_blocks(), self.k_blocks, strict=True):
            assert a.tolist() == b.tolist()
        r = self.rows
        assert set(r.slot_of) == set(self.k.slot_of)
        for key, slot in r.slot_of.items():
            assert isinstance(key, str)
            assert self.k.slot_of[key] == slot
            assert r.requests.state[slot] == self.k.state_of(key)
            c = r.requests.counters
            assert self.k.counters_of(key) == (
                c[OPEN][slot],
                c[UNCANCELLED][slot],
                c[RUNNING][slot],
                c[SUSPECT][slot],
            )
            row = self.handles[key]
            assert r.grants.open[row] == self.k.is_open(row)
            pr = r.proofs
            assert self.k.proof_of(row) == (
                pr.cancel[row],
                pr.last_seq[row],
                pr.through[row],
                pr.revoked[row],
                pr.suspect[row],
            )
        assert {p: list(d) for p, d in r.grants.by_peer.items()} == {
            p: list(d) for p, d in self.k.by_peer.items()
        }
        assert r.grants.row_of_serial == self.k.row_of_serial


def _ops() -> st.SearchStrategy[list[tuple[Any, ...]]]:
    # A key named by how recent it is (0: the newest granted; it may be ended, released or
    # never granted), so most calls name keys that exist.
    key = st.integers(0, 8)
    op = st.one_of(
        st.tuples(
            st.just("grant"),
            st.integers(1, 4),
            st.lists(st.integers(0, 5), min_size=4, max_size=4),
            st.sampled_from([READ, WRITE]),
        ),
        st.tuples(
            st.just("end"),
            st.lists(key, max_size=5),
            st.sampled_from(["finished", "rejected"]),
        ),
        st.tuples(
            st.just("prove"),
            st.lists(key, max_size=5),
            st.sampled_from(list(CLAIMS)),
            st.lists(st.integers(0, 3), max_size=5),
        ),
        st.tuples(st.just("collect")),
    )
    return st.lists(op, max_size=40)


@settings(max_examples=400, deadline=None)
@given(ops=_ops())
def test_the_kernel_steps_as_the_rows_do(kernel_mod: Any, ops: list[tuple[Any, ...]]) -> None:
    pair = Pair(kernel_mod)
    for op in ops:
        if op[0] == "grant":
            pair.grant(op[1], op[2], op[3])
        elif op[0] == "end":
            pair.end(pair.recent(op[1]), op[2])
        elif op[0] == "prove":
            pair.prove(pair.recent(op[1]), op[2], op[3])
        else:
            pair.collect()
        pair.check()


def test_the_bench_workload_releases_everything(kernel_mod: Any) -> None:
    """The bench's steps on both sides: every request released, every block back to no
    holder and its generation bumped once, on both."""
    pair = Pair(kernel_mod)
    for _ in range(3):
        pair.grant(3, [16, 16, 16], READ)
        keys = [str(k) for k in pair.rows.slot_of]
        pair.end(keys, "finished")
        pair.prove(keys, 4, [0] * len(keys))  # TransferCompleted
        pair.collect()
        pair.check()
        assert not pair.rows.slot_of
    assert pair.k.generation_arr.tolist() == [3] * NUM_BLOCKS


def test_a_planted_difference_is_caught(kernel_mod: Any) -> None:
    """The comparison sees a kernel that moved one request differently."""
    pair = Pair(kernel_mod)
    pair.grant(2, [2, 2], READ)
    mk: list[tuple[int, int, int]] = []
    pair.k.end(["k0"], EVENT_CODE["rejected"], mk)  # the kernel alone
    assert mk and mk[0][2] == CODE["rejected"]
    with pytest.raises(AssertionError):
        pair.check()
