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

- **Outside data** (``shallow``, ``json_value``): what a decoder of bytes or plain data takes
  (evidence from a mapping, a wire frame, a log line, a results file) is refused when lists,
  tuples, dicts or sets nest in it deeper than ``MAX_NESTING``: Python's ``repr``, ``==`` and
  ``json`` recurse, and 1,200 levels would come out of them as an untyped ``RecursionError``.

Every argument is read once and what is returned is exactly what was checked: a sequence or
iterable is materialised before it is looked at (``materialised``), and a ``str`` / ``int`` /
``float`` subclass comes back as the plain value (through the base class's own slot, never the
subclass's ``__str__`` / ``__int__`` / ``__float__``, comparisons or hash). Error messages show
values through ``errors.show``: bounded, and never raising, whatever the value's ``repr`` does.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, TypeVar, cast

import numpy as np
import numpy.typing as npt

from kvlifetime.errors import (
    BlockOutOfRange,
    DuplicateBlockIds,
    InvalidBlockIds,
    InvalidField,
    show,
)

MAX_SEQ = (1 << 63) - 1
"""The largest sequence number: int64, as numpy and the wire schema carry it."""

MAX_NESTING = 32
"""The deepest outside data a decoder takes (the value itself is level 1). Evidence is two
levels deep, a log line or a results file a handful; Python's recursion limit is 1,000."""

T = TypeVar("T")

# Not batches of ids even though Python calls them sequences (of characters, of bytes).
_NOT_BATCHES = (str, bytes, bytearray, memoryview)


_show = show  # bounded, never raising: a hostile value is still refused with the right error


# What is stored is exactly what was checked. A ``str`` / ``int`` / ``float`` subclass may
# override ``__str__``, ``__int__``, ``__index__``, ``__float__``, ``__eq__`` or ``__hash__``:
# ``str(v)`` or ``int(v)`` would run its code and could hand back another value than the one
# looked at (or raise ``TypeError``). The base class's own slot takes the value itself, as a
# plain object, without calling anything the subclass defines; and every type test below is
# on ``type(value)``, which a ``__class__`` property cannot fake.
_plain_str = str.__str__
_plain_int = int.__int__
_plain_float = float.__float__
_item: Any = np.generic.item  # a numpy scalar's own value, whatever a subclass overrides


def _plain_integer(value: object) -> int | None:
    """``value`` as a plain ``int`` if it is an integer (a Python or numpy integer, not a
    ``bool``), else ``None``."""
    t = type(value)
    if t is int:
        return value  # type: ignore[return-value]
    if issubclass(t, bool) or issubclass(t, np.bool_):
        return None
    if issubclass(t, int):
        return _plain_int(value)  # type: ignore[arg-type]
    if issubclass(t, np.integer):
        return int(_item(value))
    return None


def materialised(value: object, name: str) -> list[Any]:
    """One walk over a sequence or iterable argument, as a plain list: every later check and
    conversion reads this list, so a ``Sequence`` whose contents change between walks cannot
    have one walk checked and another stored. A walk that raises is ``InvalidField``."""
    if type(value) is list:
        return value[:]  # C-level copy: no code of the caller's runs
    try:
        return list(cast(Any, value))
    except Exception as e:
        raise InvalidField(
            f"{name} could not be read: iterating {type(value).__name__} raised {type(e).__name__}"
        ) from e


def str_ids(value: object, name: str) -> tuple[list[str], InvalidField | None]:
    """A collection of ``str`` ids an engine reports (vLLM's ``failed_recving``): the good ones,
    and the error for the rest (None: none bad). One ``str`` is not a collection of ids (it is
    not split into letters); an id that is no ``str`` (a subclass included) is bad."""
    if isinstance(value, str | bytes):
        return [], InvalidField(f"{name} must be a collection of str ids, got {_show(value)}")
    try:
        items = materialised(value, name)
    except InvalidField as e:
        return [], e
    good = [r for r in items if type(r) is str]
    if len(good) == len(items):
        return good, None
    bad = next(r for r in items if type(r) is not str)
    return good, InvalidField(f"{name} must hold str ids, got {_show(bad)}")


# --------------------------------------------------------------------------- block id batches


# A batch this short is checked with plain Python on its list of ints: below it, numpy's
# per-call overhead (a sort, a comparison) costs more than looking at every id.
_SMALL = 16
_INT64 = np.dtype(np.int64)
# Integer dtypes whose every value is an int64 (uint64 is not: the full check refuses past 2**63).
_EXACT_IN_INT64 = frozenset(
    d
    for t in (np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32)
    for d in (np.dtype(t).newbyteorder("<"), np.dtype(t).newbyteorder(">"))
)


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
        # A list is copied (C-level, no caller code runs): another thread changing it between
        # the walks below cannot get an unchecked value stored.
        listed: Any = value
        ids: Sequence[Any] = listed if t is tuple else listed[:]
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
        dt = given.dtype
        if given.ndim == 1 and dt in _EXACT_IN_INT64 and len(given) > 1:
            # A copy (the caller may change its array afterwards), int64 whatever the given
            # integer dtype (SGLang's page indices are int32): exact for each of them.
            arr = given.copy() if dt == _INT64 else given.astype(_INT64)
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
    t = type(value)
    if issubclass(t, np.ndarray):
        # A subclass may override ``ndim`` or ``dtype``: read them off the plain array view.
        base: npt.NDArray[Any] = np.ndarray.view(cast(Any, value), np.ndarray)
        if base.ndim != 1 or base.dtype.kind not in "iu":
            raise InvalidBlockIds(
                f"block ids must be a 1-d integer array, got a {base.ndim}-d {base.dtype} "
                f"array: {_show(base)}"
            )
        # Exact for every signed dtype; a uint64 id >= 2**63 becomes negative, which the range
        # check below refuses like any other out-of-range id. Always a copy: the caller may
        # change its array afterwards.
        arr = np.array(base, dtype=np.int64, copy=True)
        original: npt.NDArray[Any] = base
    elif isinstance(value, Sequence) and not issubclass(t, _NOT_BATCHES):
        try:
            items = materialised(value, "block ids")
        except InvalidField as e:
            raise InvalidBlockIds(str(e)) from e.__cause__
        if not set(map(type, items)) <= {int}:
            plain: list[int] = []
            for v in items:
                i = _plain_integer(v)
                if i is None:
                    raise InvalidBlockIds(
                        f"block ids must be ints, got {type(v).__name__} {_show(v)} (never coerced)"
                    )
                plain.append(i)
            items = plain
        try:
            arr = np.array(items, dtype=np.int64)
        except OverflowError:
            big = [v for v in items if not -(1 << 63) <= v < (1 << 63)]
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
    """A request key: a non-empty ``str`` or an ``int`` (not ``bool``), returned as the plain
    value (a subclass's characters or number, never through its own ``__str__`` / ``__int__``).
    ``InvalidField`` otherwise, for unhashable values too (checked before any dict sees
    them)."""
    t = type(value)
    if t is str:
        if value == "":
            raise InvalidField(f"{name} must be a non-empty str or an int, got ''")
        return value  # type: ignore[return-value]
    if t is int:
        return value  # type: ignore[return-value]
    # Subclasses (an IntEnum, a str subclass) are stored as the plain value; bool is an int
    # subclass but never an id.
    if issubclass(t, str):
        plain = _plain_str(value)
        if plain:
            return plain
    elif issubclass(t, int) and not issubclass(t, bool):
        return _plain_int(value)  # type: ignore[arg-type]
    raise InvalidField(f"{name} must be a non-empty str or an int, got {_show(value)}")


def _plain_text(value: object) -> str | None:
    t = type(value)
    if t is str:
        return value  # type: ignore[return-value]
    return _plain_str(value) if issubclass(t, str) else None


def peer_id(value: object, name: str = "peer") -> str:
    """A peer: a non-empty ``str`` (returned plain)."""
    plain = _plain_text(value)
    if not plain:
        raise InvalidField(f"{name} must be a non-empty str, got {_show(value)}")
    return plain


def text(value: object, name: str) -> str:
    """A free-text argument (a reason): any ``str`` (returned plain)."""
    plain = _plain_text(value)
    if plain is None:
        raise InvalidField(f"{name} must be a str, got {_show(value)}")
    return plain


def flag(value: object, name: str) -> bool:
    """A ``bool`` argument: ``True`` or ``False`` only (``shared="no"`` is not false)."""
    if type(value) is bool:
        return value
    if type(value) is not np.bool_:
        raise InvalidField(f"{name} must be a bool, got {_show(value)}")
    return bool(value)


def choice(value: object, name: str, options: tuple[str, ...]) -> str:
    """One of ``options`` (``str``s), exactly: anything else is ``InvalidField``."""
    plain = _plain_text(value)
    if plain is None or plain not in options:
        raise InvalidField(f"{name} must be one of {options!r}, got {_show(value)}")
    return plain


def instance(value: object, cls: type[T], name: str) -> T:
    """``value`` if it is a ``cls``; ``InvalidField`` otherwise."""
    if not issubclass(type(value), cls):
        raise InvalidField(f"{name} must be a {cls.__name__}, got {_show(value)}")
    return value  # type: ignore[return-value]


# --------------------------------------------------------------------------- numbers


def finite_time(value: object, name: str) -> float | int:
    """A deadline or a clock reading: a finite ``int`` or ``float`` (numpy scalars allowed), not
    ``bool``, NaN or infinity. Returned as a plain Python number (a subclass's own value, never
    through its ``__float__`` / ``__int__``)."""
    t = type(value)
    if t is float:
        f: float = value  # type: ignore[assignment]
    else:
        i = _plain_integer(value)
        if i is not None:
            return i
        if issubclass(t, float):  # np.float64 too
            f = _plain_float(value)  # type: ignore[arg-type]
        elif issubclass(t, np.floating):
            f = float(_item(value))
        else:
            raise InvalidField(f"{name} must be a finite int or float, got {_show(value)}")
    if math.isfinite(f):
        return f
    raise InvalidField(f"{name} must be a finite int or float, got {_show(value)}")


def optional_time(value: object, name: str) -> float | int | None:
    """``None`` (no deadline) or a ``finite_time``."""
    return None if value is None else finite_time(value, name)


def count(value: object, name: str, minimum: int = 0) -> int:
    """An ``int`` (numpy integer scalars allowed, not ``bool``) ``>= minimum``, returned plain."""
    v = _plain_integer(value)
    if v is not None and v >= minimum:
        return v
    raise InvalidField(f"{name} must be an int >= {minimum}, got {_show(value)}")


def seq(value: object, name: str) -> int:
    """A sequence number: an ``int`` (not ``bool``) in ``[0, MAX_SEQ]``, returned plain (the
    range is checked on the plain value, not through a subclass's comparisons)."""
    t = type(value)
    if t is int or (issubclass(t, int) and not issubclass(t, bool)):
        v = _plain_int(value)  # type: ignore[arg-type]
        if 0 <= v <= MAX_SEQ:
            return v
    raise InvalidField(f"{name} must be an int in [0, 2**63 - 1], got {_show(value)}")


# --------------------------------------------------------------------------- outside data

# The built-in containers, walked through their own C slots (never a subclass's ``__iter__``,
# ``__len__`` or ``__getitem__``): a subclass is walked as the container it is.
_dict_items: Any = dict.items
_list_copy: Any = list.copy
_tuple_slice: Any = tuple.__getitem__
_set_iter: Any = set.__iter__
_frozenset_iter: Any = frozenset.__iter__
_ALL = slice(None)


def _children(value: object) -> list[Any] | None:
    """The items of a built-in container (a dict's keys and values), or ``None`` for a leaf."""
    t = type(value)
    if issubclass(t, dict):
        return [x for kv in _dict_items(value) for x in kv]
    if issubclass(t, list):
        return _list_copy(value)  # type: ignore[no-any-return]
    if issubclass(t, tuple):
        return list(_tuple_slice(value, _ALL))
    if issubclass(t, frozenset):
        return list(_frozenset_iter(value))
    if issubclass(t, set):
        return list(_set_iter(value))
    return None


def shallow(
    value: object,
    name: str,
    *,
    limit: int = MAX_NESTING,
    error: type[Exception] = InvalidField,
) -> None:
    """Refuse ``value`` with ``error`` when dicts, lists, tuples or sets nest in it deeper than
    ``limit`` levels (``value`` itself is level 1; a dict's keys count as its items).

    For a decoder of outside data, before it looks at anything: past the check, formatting a
    value, comparing or hashing it cannot recurse without end. The walk is iterative (it never
    recurses itself), reads each container through the built-in type's own slots, and treats
    anything else as a leaf it never looks into (its fields' checks refuse it, and
    ``errors.show`` prints it whatever its ``repr`` does). A container that holds itself is
    refused like any too deep one."""
    stack: list[tuple[object, int]] = [(value, 1)]
    while stack:
        v, depth = stack.pop()
        items = _children(v)
        if items is None:
            continue
        if depth > limit:
            raise error(f"{name} is nested deeper than {limit} levels")
        stack.extend((x, depth + 1) for x in items if issubclass(type(x), _CONTAINERS))


_CONTAINERS = (dict, list, tuple, set, frozenset)


def json_value(
    text: str | bytes,
    name: str,
    *,
    limit: int = MAX_NESTING,
    error: type[Exception] = InvalidField,
) -> Any:
    """``text`` parsed as JSON and checked ``shallow``; anything else is ``error`` naming
    ``name`` (not JSON, nested too deep for the parser itself, an integer too long to read)."""
    import json  # only a decoder needs it: this module stays cheap to import

    try:
        value = json.loads(text)
    except RecursionError:
        raise error(f"{name}: JSON is nested deeper than {limit} levels") from None
    except ValueError as e:  # JSONDecodeError, or an integer past int's digit limit
        raise error(f"{name}: not JSON: {str(e)[:200]}") from None
    shallow(value, f"{name}: JSON", limit=limit, error=error)
    return value
