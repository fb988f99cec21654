"""PrefixCache: decode's emulated prefix cache in the push harness.

A request that consumed its KV and still decodes may lend its first blocks to a newer request
with the same prompt prefix, as an engine's prefix cache does: the newer request takes them
with a shared acquire, and the ledger refuses what is not settled (an open write grant, a
holder draining or quarantined), in which case the newer request writes all its blocks
itself. The cache remembers the 64 most recent lenders; one gone, not decoding any more, or
too short is forgotten when looked at.
"""

from __future__ import annotations

import collections
from collections.abc import Callable

import numpy as np
import numpy.typing as npt

from kvlifetime.errors import BlockUnavailable
from kvlifetime.grant import Grant
from kvlifetime.harness import pattern
from kvlifetime.ledger import BlockLedger

Hit = tuple[npt.NDArray[np.int64] | None, npt.NDArray[np.uint64] | None]
"""The blocks shared and the words they hold (None, None: no hit)."""


class PrefixCache:
    """The recent requests still decoding whose first blocks a new request may share."""

    def __init__(self) -> None:
        self._sources: collections.deque[int] = collections.deque(maxlen=64)

    def lend(self, key: int) -> None:
        """``key`` consumed its KV and decodes: its settled blocks may serve a prefix hit."""
        self._sources.append(key)

    def hit(
        self, key: int, k: int, ledger: BlockLedger, decoding: Callable[[int], Grant | None]
    ) -> Hit:
        """Share the first ``k`` blocks of the most recent lender still decoding (``decoding``:
        its WRITE grant if it does, else None) with ``key``: acquired shared in ``ledger``."""
        src = self._sources
        while k and src:
            g = decoding(src[-1])
            if g is None or len(g.blocks) < k:  # a sharer itself may have written fewer
                src.pop()
                continue
            blocks = g.blocks[:k]
            try:
                ledger.acquire(key, blocks, shared=True)
            except BlockUnavailable:
                src.pop()
                continue
            return blocks, pattern.words(src[-1], blocks, g.generations[:k])
        return None, None


__all__ = ["Hit", "PrefixCache"]
