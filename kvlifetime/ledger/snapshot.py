"""Snapshots: each part of the ledger copies itself, field by field, by the kind of value.

``BlockLedger.copy`` (the explorer's what-if branches) is the copy of each part: the per-block
state, the request table and its records. Each copies every slot of its class with
``copy_slots``: a field added to a part is copied without anyone restating it, and a field
holding a value of a kind this module does not know (or a container of mutable values: records,
say) raises ``TypeError`` until the part says how to copy it (``replace``), instead of being
shared between the copy and the original by accident.

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

_SLOTS: dict[type, tuple[str, ...]] = {}


def slots_of(cls: type) -> tuple[str, ...]:
    """Every slot of ``cls`` and its bases, base first."""
    names = _SLOTS.get(cls)
    if names is None:
        seen: dict[str, None] = {}
        for klass in reversed(cls.__mro__):
            s = klass.__dict__.get("__slots__", ())
            for n in (s,) if isinstance(s, str) else s:
                seen[n] = None
        names = _SLOTS[cls] = tuple(seen)
    return names


def copy_slots(obj: T, **replace: Any) -> T:
    """A copy of ``obj`` (a class with ``__slots__``): each slot named in ``replace`` takes
    that value, every other one a copy of its own (``copy_value``)."""
    new = object.__new__(type(obj))
    for name in slots_of(type(obj)):
        value = replace[name] if name in replace else copy_value(getattr(obj, name), name)
        object.__setattr__(new, name, value)
    return new


def copy_value(value: Any, name: str = "?") -> Any:
    """``value`` as a copy shares it with nothing mutable: an immutable value as it is, an
    array copied (a read-only one shared), a container of immutable values (or read-only
    arrays) copied one level deep. Anything else is ``TypeError``: its part must say how."""
    if isinstance(value, _IMMUTABLE):
        return value
    if type(value) is np.ndarray:
        return value if not value.flags.writeable else value.copy()
    if type(value) in _CONTAINERS:
        inner = value.values() if isinstance(value, dict) else value
        for item in inner:
            if not _shareable(item):
                raise TypeError(
                    f"field {name!r} holds a {type(value).__name__} of mutable "
                    f"{type(item).__name__}: its part must say how to copy it"
                )
        if isinstance(value, dict):
            for key in value:
                if not _shareable(key):
                    raise TypeError(f"field {name!r}: a mutable key {type(key).__name__}")
        return type(value)(value)
    raise TypeError(
        f"field {name!r} holds a {type(value).__name__}: its part must say how to copy it"
    )


def _shareable(item: object) -> bool:
    return isinstance(item, _IMMUTABLE) or (type(item) is np.ndarray and not item.flags.writeable)
