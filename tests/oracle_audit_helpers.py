"""An independent write-by-write audit of the transport oracle (issue 20, item 11).

The oracle keeps its own picture of who holds each block, built from what decode tells it
(``granted``, ``shared``, ``let_go``, ``freed``). The audit keeps none: at every landing it asks
the ledger itself which requests hold the block and at which generation, and calls the landing
on time only when its word is the word one of those holders' peers was granted for that block
at that generation (a sharer is never granted a shared block's word, so only a writer that
still holds the block can match). Late into free: the ledger says nobody holds the block.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest

from kvlifetime.harness import pattern
from kvlifetime.harness import push_owner as decode_module
from kvlifetime.harness.push_owner import DecodeWorker


class WriteByWriteAudit:
    """Each landing classified against the ledger's holders and generations at that moment."""

    def __init__(self, worker: DecodeWorker) -> None:
        self.worker = worker
        self.writes = 0
        self.late = 0  # landings found late, each counted once as it is found
        self.late_into_owned = 0
        self.late_into_free = 0
        self.late_redelivered = 0
        self.late_blocks: set[int] = set()
        self.hit: set[int] = set()
        # landings the ledger calls late into a block held by sharers only, its writer gone
        self.late_after_writer_let_go = 0

    def landed(
        self,
        blocks: npt.ArrayLike,
        words: npt.ArrayLike,
        kinds: dict[str, npt.NDArray[np.bool_]] | None = None,
    ) -> None:
        ledger = self.worker.ledger
        holders: dict[int, list[int]] = {}
        for key in ledger.live_requests():
            assert isinstance(key, int)  # the harness's requests are numbered
            for blk in ledger.blocks_of(key).tolist():
                holders.setdefault(blk, []).append(key)
        b = np.asarray(blocks, dtype=np.int64).tolist()
        w = np.asarray(words, dtype=np.uint64).tolist()
        redelivered = (kinds or {}).get("redelivered")
        for i, (blk, word) in enumerate(zip(b, w, strict=True)):
            self.writes += 1
            held = holders.get(blk, [])
            gen = ledger.generation([blk])
            granted = {int(pattern.words(k, [blk], gen)[0]) for k in held}
            if word in granted:
                continue
            self.late += 1
            self.late_blocks.add(blk)
            if redelivered is not None and redelivered[i]:
                self.late_redelivered += 1
            if not held:
                self.late_into_free += 1
                continue
            self.late_into_owned += 1
            self.hit.update(held)
            # Its writer (the holder that acquired it exclusively, in the harness's own
            # records) is gone: only sharers hold it. What an oracle told only of returns to
            # the pool gets wrong.
            if not any(self._wrote(k, blk) for k in held):
                self.late_after_writer_let_go += 1

    def _wrote(self, key: int, blk: int) -> bool:
        r = self.worker.reqs.get(key)
        return r is not None and blk in r.grant.blocks.tolist()


@pytest.fixture(name="audits")
def audits_fixture(
    monkeypatch: pytest.MonkeyPatch,
) -> Iterator[list[tuple[DecodeWorker, WriteByWriteAudit]]]:
    """Every decode worker a run creates, with an audit that sees each landing just before
    the oracle does (the ledger then is what it was when the oracle classifies it)."""
    made: list[tuple[DecodeWorker, WriteByWriteAudit]] = []

    class Audited(DecodeWorker):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            audit = WriteByWriteAudit(self)
            oracle_landed = self.oracle.landed

            def landed(
                blocks: npt.ArrayLike,
                words: npt.ArrayLike,
                kinds: dict[str, npt.NDArray[np.bool_]] | None = None,
            ) -> None:
                audit.landed(blocks, words, kinds)
                oracle_landed(blocks, words, kinds)

            monkeypatch.setattr(self.oracle, "landed", landed)
            made.append((self, audit))

    monkeypatch.setattr(decode_module, "DecodeWorker", Audited)
    yield made
