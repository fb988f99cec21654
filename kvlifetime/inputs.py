"""Argument checks for every public call, in one place (README, "Strict inputs").

Every public entry point of ``BlockLedger``, the evidence classes and ``Grant`` validates its
arguments with these functions *before* it touches anything, so that a refused call raises one of
kvlifetime's own exceptions (never a ``TypeError`` from deep inside numpy or a dict) and changes
nothing, for anyone. Nothing is coerced: a value of the wrong type is refused, not converted.

- **Block id batches** (``block_ids``): a sequence of ``int`` (numpy integer scalars allowed) or a
  1-d numpy integer array. A float, bool, str, None, complex or object value, a 2-d batch or a
  bare scalar is ``InvalidBlockIds``; a value outside ``[0, num_blocks)`` (beyond int64
  included) is ``BlockOutOfRange``; the same id twice is ``DuplicateBlockIds``.
- **Request keys** (``request_key``): a non-empty ``str`` or an ``int`` (not ``bool``, which is
  an int subclass but never an id; not a float that happens to equal an int key). Anything else,
  unhashable values included, is ``InvalidField``.
- **Times** (``finite_time``): deadlines and clocks are finite real numbers, ``int`` or ``float``
  (numpy scalars allowed), not ``bool``, NaN or infinity. A bad deadline is refused when it is
  set, never later inside ``expire``.
- **Peers** (``peer_id``): a non-empty ``str``.
- **Counts and sequence numbers** (``count``, ``seq``): ``int`` (not ``bool``) within bounds;
  sequence numbers stay within int64 (``MAX_SEQ``), as on the wire.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, TypeVar

import numpy as np
import numpy.typing as npt

from kvlifetime.errors import (
    BlockOutOfRange,
    DuplicateBlockIds,
    InvalidBlockIds,
    InvalidField,
)

MAX_SEQ = (1 << 63) - 1
"""The largest sequence number: int64, as numpy and the wire schema carry it."""

T = TypeVar("T")

# Not batches of ids even though Python calls them sequences (of characters, of bytes).
_NOT_BATCHES = (str, bytes, bytearray, memoryview)


def _show(value: object, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


# --------------------------------------------------------------------------- block id batches


# A batch this short is checked with plain Python on its list of ints: below it, numpy's
# per-call overhead (a sort, a comparison) costs more than looking at every id.
_SMALL = 16
_INT64 = np.dtype(np.int64)


def block_ids(
    value: object, num_blocks: int | None, *, unique: bool = True
) -> npt.NDArray[np.int64]:
    """``value`` as a private, read-only, 1-d int64 copy; refused unless it is a batch of
    integer ids in ``[0, num_blocks)`` (``num_blocks=None``: only ``>= 0`` and within int64).

    ``unique=False`` skips the duplicate check (a caller that detects repeats more cheaply
    itself). Raises ``InvalidBlockIds``, ``BlockOutOfRange`` or ``DuplicateBlockIds``.
    """
    # The fast paths only ever accept: anything they do not prove valid goes to the full check,
    # which says what is wrong. One rule, two speeds.
    hi = (1 << 63) if num_blocks is None else num_blocks
    t = type(value)
    if t is tuple or t is list:
        ids: Sequence[Any] = value  # type: ignore[assignment]
        n = len(ids)
        if 0 < n <= _SMALL:
            for v in ids:
                if type(v) is not int:
                    break
            else:
                if min(ids) >= 0 and max(ids) < hi and (not unique or len(set(ids)) == n):
                    arr = np.array(ids, dtype=np.int64)
                    arr.flags.writeable = False
                    return arr
    elif t is np.ndarray:
        given: npt.NDArray[Any] = value  # type: ignore[assignment]
        if given.ndim == 1 and given.dtype == _INT64 and len(given) > 1:
            arr = given.copy()  # the caller may change its array afterwards
            if unique:
                # One sort proves both ends and (adjacent equal) every repeat.
                s = np.sort(arr)
                ok = s[0] >= 0 and s[-1] < hi and not np.count_nonzero(s[1:] == s[:-1])
            else:
                # Seen as unsigned, a negative id is huge: one reduction checks both ends.
                ok = int(np.maximum.reduce(arr.view(np.uint64))) < hi
            if ok:
                arr.flags.writeable = False
                return arr
    return _checked_block_ids(value, num_blocks, unique)


def _checked_block_ids(
    value: object, num_blocks: int | None, unique: bool
) -> npt.NDArray[np.int64]:
    """The full check of ``block_ids``: every kind of batch, and the error that says what is
    wrong with it."""
    if isinstance(value, np.ndarray):
        if value.ndim != 1 or value.dtype.kind not in "iu":
            raise InvalidBlockIds(
                f"block ids must be a 1-d integer array, got a {value.ndim}-d {value.dtype} "
                f"array: {_show(value)}"
            )
        # Exact for every signed dtype; a uint64 id >= 2**63 becomes negative, which the range
        # check below refuses like any other out-of-range id. Always a copy: the caller may
        # change its array afterwards.
        arr = np.array(value, dtype=np.int64, copy=True)
        original: npt.NDArray[Any] = value
    elif isinstance(value, Sequence) and not isinstance(value, _NOT_BATCHES):
        types = set(map(type, value))
        if not types <= {int}:
            for t in types:
                if (
                    not issubclass(t, int | np.integer)
                    or issubclass(t, bool)
                    or issubclass(t, np.bool_)
                ):
                    bad = next(v for v in value if type(v) is t)
                    raise InvalidBlockIds(
                        f"block ids must be ints, got {type(bad).__name__} {_show(bad)} "
                        f"(never coerced)"
                    )
            value = [int(v) for v in value]
        try:
            arr = np.array(value, dtype=np.int64)
        except OverflowError:
            big = [v for v in value if not -(1 << 63) <= v < (1 << 63)]
            raise BlockOutOfRange(f"block ids out of range: {_show(big[:16])}") from None
        original = arr
    else:
        raise InvalidBlockIds(
            "block ids must be a 1-d integer numpy array or a sequence of ints, got "
            f"{type(value).__name__} {_show(value)}"
        )
    if len(arr):
        # Seen as unsigned, a negative id is huge: one reduction checks both ends.
        hi = (1 << 63) if num_blocks is None else num_blocks
        if int(np.maximum.reduce(arr.view(np.uint64))) >= hi:
            bad_ids = original[(arr < 0) | (arr >= hi)]
            where = f"[0, {num_blocks})" if num_blocks is not None else ">= 0"
            raise BlockOutOfRange(f"block ids out of range {where}: {bad_ids[:16].tolist()}")
        if unique:
            s = np.sort(arr)
            if np.count_nonzero(s[1:] == s[:-1]):
                dup = np.unique(s[1:][s[1:] == s[:-1]])
                raise DuplicateBlockIds(
                    f"duplicate block ids in one batch: {dup[:16].tolist()} "
                    f"(batch {_show(arr.tolist(), 200)})"
                )
    arr.flags.writeable = False
    return arr


# --------------------------------------------------------------------------- keys and names


def request_key(value: object, name: str = "request") -> str | int:
    """A request key: a non-empty ``str`` or an ``int`` (not ``bool``). ``InvalidField``
    otherwise, for unhashable values too (checked before any dict sees them)."""
    t = type(value)
    if t is str:
        if value == "":
            raise InvalidField(f"{name} must be a non-empty str or an int, got ''")
        return value  # type: ignore[return-value]
    if t is int:
        return value  # type: ignore[return-value]
    # Subclasses (an IntEnum, a str subclass) keep the plain value's equality and hash; bool
    # is an int subclass but never an id.
    if isinstance(value, str) and value != "":
        return str(value)
    if isinstance(value, int) and not isinstance(value, bool):
        return int(value)
    raise InvalidField(f"{name} must be a non-empty str or an int, got {_show(value)}")


def peer_id(value: object, name: str = "peer") -> str:
    """A peer: a non-empty ``str``."""
    if not isinstance(value, str) or not value:
        raise InvalidField(f"{name} must be a non-empty str, got {_show(value)}")
    return str(value)


def text(value: object, name: str) -> str:
    """A free-text argument (a reason): any ``str``."""
    if not isinstance(value, str):
        raise InvalidField(f"{name} must be a str, got {_show(value)}")
    return str(value)


def flag(value: object, name: str) -> bool:
    """A ``bool`` argument: ``True`` or ``False`` only (``shared="no"`` is not false)."""
    if not isinstance(value, bool | np.bool_):
        raise InvalidField(f"{name} must be a bool, got {_show(value)}")
    return bool(value)


def choice(value: object, name: str, options: tuple[str, ...]) -> str:
    """One of ``options`` (``str``s), exactly: anything else is ``InvalidField``."""
    if not isinstance(value, str) or value not in options:
        raise InvalidField(f"{name} must be one of {options!r}, got {_show(value)}")
    return str(value)


def instance(value: object, cls: type[T], name: str) -> T:
    """``value`` if it is a ``cls``; ``InvalidField`` otherwise."""
    if not isinstance(value, cls):
        raise InvalidField(f"{name} must be a {cls.__name__}, got {_show(value)}")
    return value


# --------------------------------------------------------------------------- numbers


def finite_time(value: object, name: str) -> float | int:
    """A deadline or a clock reading: a finite ``int`` or ``float`` (numpy scalars allowed), not
    ``bool``, NaN or infinity. Returned as a plain Python number."""
    if isinstance(value, bool | np.bool_):
        raise InvalidField(f"{name} must be a finite number, got {_show(value)}")
    if isinstance(value, int | np.integer):
        return int(value)
    if isinstance(value, float | np.floating):
        f = float(value)
        if math.isfinite(f):
            return f
    raise InvalidField(f"{name} must be a finite int or float, got {_show(value)}")


def optional_time(value: object, name: str) -> float | int | None:
    """``None`` (no deadline) or a ``finite_time``."""
    return None if value is None else finite_time(value, name)


def count(value: object, name: str, minimum: int = 0) -> int:
    """An ``int`` (numpy integer scalars allowed, not ``bool``) ``>= minimum``."""
    if isinstance(value, int | np.integer) and not isinstance(value, bool | np.bool_):
        v = int(value)
        if v >= minimum:
            return v
    raise InvalidField(f"{name} must be an int >= {minimum}, got {_show(value)}")


def seq(value: object, name: str) -> int:
    """A sequence number: an ``int`` (not ``bool``) in ``[0, MAX_SEQ]``."""
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_SEQ:
        raise InvalidField(f"{name} must be an int in [0, 2**63 - 1], got {_show(value)}")
    return int(value)
