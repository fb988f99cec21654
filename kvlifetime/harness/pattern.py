"""The deterministic content of a block: one 64-bit word per (request, block, generation).

Prefill fills every block it writes with its owner's word; decode checks each block it consumes
against the word of the block's *current* owner. A block holding any other word was written by
someone else - typically a late write of the previous owner landing after the block was reused:
that is a contaminated block, counted, not guessed.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

WORD = np.dtype(np.uint64)

_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_K_REQ = np.uint64(0x9E3779B97F4A7C15)
_K_BLOCK = np.uint64(0xC2B2AE3D27D4EB4F)
_K_GEN = np.uint64(0x165667B19E3779F9)


def _mix(x: npt.NDArray[np.uint64]) -> npt.NDArray[np.uint64]:
    # splitmix64's finaliser: a change in any input bit flips about half of the output bits, so
    # two owners never share a word in practice.
    x = x ^ (x >> np.uint64(30))
    x = x * _M1
    x = x ^ (x >> np.uint64(27))
    x = x * _M2
    return x ^ (x >> np.uint64(31))


def words(
    request: int, blocks: npt.ArrayLike, generations: npt.ArrayLike
) -> npt.NDArray[np.uint64]:
    """The word of each (request, block, generation); never zero (a zeroed block is nobody's)."""
    b = np.asarray(blocks, dtype=np.uint64)
    g = np.asarray(generations, dtype=np.uint64)
    with np.errstate(over="ignore"):
        x = np.uint64(request & 0xFFFFFFFFFFFFFFFF) * _K_REQ + b * _K_BLOCK + g * _K_GEN
        w = _mix(x)
    w[w == 0] = np.uint64(1)
    return w


def fill(out: npt.NDArray[np.uint8], w: npt.NDArray[np.uint64], block_bytes: int) -> None:
    """Write one block per word into ``out`` (len(w) * block_bytes bytes, 8-byte aligned)."""
    view = out[: len(w) * block_bytes].view(WORD).reshape(len(w), block_bytes // 8)
    view[:] = w[:, None]


def mismatched(
    arena: npt.NDArray[np.uint8],
    blocks: npt.ArrayLike,
    w: npt.NDArray[np.uint64],
    block_bytes: int,
) -> npt.NDArray[np.bool_]:
    """For each block, whether its content differs anywhere from its expected word."""
    table = arena.view(WORD).reshape(-1, block_bytes // 8)
    got = table[np.asarray(blocks, dtype=np.int64)]
    bad: npt.NDArray[np.bool_] = (got != w[:, None]).any(axis=1)
    return bad
