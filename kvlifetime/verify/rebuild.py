"""Rebuilding the verifier's frozen values fast, and pickling them small.

A step of the search makes several new environment values per state (``attrs.evolve`` on
frozen slotted classes); ``evolve`` here does the same through the class's own ``__init__``,
with the field names looked up once per class and passed by position. ``pickle_by_fields``
makes such a class pickle as its constructor and its field values (the parallel search sends
states between the processes it forked).

Proves: a value made by ``evolve`` is what ``attrs.evolve`` would make (the same ``__init__``
and its checks; a field ``attrs.evolve`` treats differently is refused). Does not prove:
anything about the values themselves (``verify.state`` says what they mean).
"""

from __future__ import annotations

from typing import Any, TypeVar

import attrs

_T = TypeVar("_T")

# Per attrs class, its fields' names in constructor order (``evolve``).
_FIELD_NAMES: dict[type, tuple[str, ...]] = {}


def _field_names(cls: type) -> tuple[str, ...]:
    fields = attrs.fields(cls)
    odd = [a.name for a in fields if not a.init or a.kw_only or a.alias != a.name]
    if odd:
        raise TypeError(f"evolve takes no field outside __init__, keyword-only or aliased: {odd}")
    names = _FIELD_NAMES[cls] = tuple(a.name for a in fields)
    return names


def evolve(inst: _T, **changes: Any) -> _T:
    """``attrs.evolve`` for the model's values (a step makes several per state): the same new
    instance through the class's own ``__init__`` (its checks run), with the field names
    looked up once per class and passed by position. Refuses what ``attrs.evolve`` would
    handle differently (a field that is not a plain positional ``__init__`` argument)."""
    cls = type(inst)
    names = _FIELD_NAMES.get(cls)
    if names is None:
        names = _field_names(cls)
    args = [changes.pop(n) if n in changes else getattr(inst, n) for n in names]
    if changes:
        raise TypeError(f"{cls.__name__} has no field {sorted(changes)}")
    return cls(*args)


def pickle_by_fields(cls: type) -> None:
    """Pickle ``cls`` (a frozen slotted attrs class) as its constructor and field values: the
    parallel search sends states between processes, and attrs' own slot-by-slot state costs
    about twice as much to load."""
    names = tuple(f.name for f in attrs.fields(cls))

    def reduce_ex(self: Any, _protocol: object) -> tuple[Any, ...]:
        return (cls, tuple([getattr(self, n) for n in names]))

    cls.__reduce_ex__ = reduce_ex  # type: ignore[assignment,method-assign]
