"""Snapshots: each part of the ledger copies itself, field by field, by the kind of value.

``BlockLedger.copy`` (the explorer's what-if branches) is the copy of each part: the per-block
state, the request table and its records. Each copies every slot of its class with
``copy_slots``: a field added to a part is copied without anyone restating it, and a field
holding a value of a kind this module does not know (or a container of mutable values: records,
say, told by its first item) raises ``TypeError`` until the part says how to copy it
(``replace``), instead of being shared between the copy and the original by accident.

``BlockLedger.fingerprint`` is the observable state (what the explorer keys states by): each
part says what of it is observable (``BlockCounts.fingerprint``,
``RequestTable.fingerprint``).
"""

from __future__ import annotations

import collections
import enum
from typing import Any, TypeVar

import numpy as np

from kvlifetime.grant import Grant, GrantId

T = TypeVar("T")

# Values shared as they are: immutable.
_IMMUTABLE: tuple[type, ...] = (
    type(None),
    bool,
    int,
    float,
    str,
    bytes,
    tuple,
    frozenset,
    enum.Enum,
    Grant,
    GrantId,
)
# Containers copied one level deep (their items must be immutable, or read-only arrays).
_CONTAINERS: tuple[type, ...] = (
    list,
    dict,
    collections.OrderedDict,
    collections.Counter,
)

# Exact types shared as they are without a call (immutable; the grant types are frozen).
_PLAIN = frozenset({type(None), bool, int, float, str, bytes, tuple, frozenset, Grant, GrantId})

_SLOTS: dict[type, tuple[str, ...]] = {}


def slots_of(cls: type) -> tuple[str, ...]:
    """Every slot of ``cls`` and its bases, base first (of a class compiled by mypyc, the
    optional accelerator: its attributes, which it lists in ``__mypyc_attrs__``)."""
    names = _SLOTS.get(cls)
    if names is None:
        compiled = cls.__dict__.get("__mypyc_attrs__")
        if compiled is not None:
            names = _SLOTS[cls] = tuple(sorted(n for n in compiled if n != "__dict__"))
            return names
        seen: dict[str, None] = {}
        for klass in reversed(cls.__mro__):
            s = klass.__dict__.get("__slots__", ())
            for n in (s,) if isinstance(s, str) else s:
                seen[n] = None
        names = _SLOTS[cls] = tuple(seen)
    return names


def copy_slots(obj: T, **replace: Any) -> T:
    """A copy of ``obj`` (a class with ``__slots__``): each slot named in ``replace`` takes
    that value, every other one a copy of its own (``copy_value``; an immutable value of a
    common kind is shared without a call)."""
    result: T = copier(type(obj), *replace)(obj, *replace.values())
    return result


def copier(cls: type, *replaced: str) -> Any:
    """``copy_slots`` for ``cls`` with the slots ``replaced`` given, as a function
    ``(obj, *values of replaced, in order) -> copy``: a part that copies many objects of one
    class (the records) looks it up once."""
    fn = _COPIERS.get((cls, *replaced))
    if fn is None:
        fn = _COPIERS[(cls, *replaced)] = _compile(cls, replaced)
    return fn


# (class, names replaced) -> its copier: generated once from the class's slots, so that a copy
# costs what a hand-written one would (one attribute read, one type test and one write a slot).
_COPIERS: dict[tuple[Any, ...], Any] = {}


def _compile(cls: type, replaced: tuple[str, ...]) -> Any:
    args = "".join(f", r{k}" for k in range(len(replaced)))
    lines = [f"def copy(obj{args}):", "    new = _new(_cls)"]
    for i, name in enumerate(slots_of(cls)):
        if name in replaced:
            lines.append(f"    new.{name} = r{replaced.index(name)}")
        else:
            lines += [
                f"    v{i} = obj.{name}",
                f"    t{i} = type(v{i})",
                f"    if t{i} is _ndarray:",
                f"        new.{name} = v{i}.copy() if v{i}.flags.writeable else v{i}",
                "    else:",
                f"        new.{name} = v{i} if t{i} in _PLAIN else _copy(v{i}, {name!r})",
            ]
    lines.append("    return new")
    # ``cls.__new__``: ``object.__new__`` for an interpreted class; a compiled one (mypyc) is
    # created blank only by a ``__new__`` of its own (its constructor would run ``__init__``),
    # so each class copied here defines one (``RequestTable``, ``BlockCounts``, the records).
    scope: dict[str, Any] = {"_new": cls.__new__, "_cls": cls, "_PLAIN": _PLAIN}
    scope["_ndarray"] = np.ndarray
    scope["_copy"] = copy_value
    exec("\n".join(lines), scope)  # the source is built from the slot names above
    return scope["copy"]


def copy_value(value: Any, name: str = "?") -> Any:
    """``value`` as a copy shares it with nothing mutable: an immutable value as it is, an
    array copied (a read-only one shared), a container of immutable values (or read-only
    arrays) copied one level deep. Anything else is ``TypeError``: its part must say how.
    A container's items are told by its first one (a part's containers hold one kind)."""
    kind = type(value)
    if kind in _CONTAINERS:
        if value:
            first = next(iter(value.values() if isinstance(value, dict) else value))
            if not _shareable(first):
                raise TypeError(
                    f"field {name!r} holds a {kind.__name__} of mutable "
                    f"{type(first).__name__}: its part must say how to copy it"
                )
            if isinstance(value, dict) and not _shareable(next(iter(value))):
                raise TypeError(f"field {name!r}: a mutable key {type(next(iter(value))).__name__}")
        if kind is collections.Counter:
            counter = dict.__new__(collections.Counter)  # its constructor counts item by item
            dict.update(counter, value)
            return counter
        return kind(value)
    if kind is np.ndarray:
        return value if not value.flags.writeable else value.copy()
    if isinstance(value, _IMMUTABLE):
        return value
    raise TypeError(f"field {name!r} holds a {kind.__name__}: its part must say how to copy it")


def _shareable(item: Any) -> bool:
    kind = type(item)
    if kind is np.ndarray:
        return not item.flags.writeable
    return kind in _PLAIN or isinstance(item, _IMMUTABLE)
