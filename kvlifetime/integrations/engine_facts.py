"""Engine facts: one private detail of an engine that an integration relies on, as a row, and
the probe that tells whether the installed engine still has it.

Each integration keeps its engine's facts in one module per supported engine version
(``vllm/facts_v0_33.py``, ``sglang/facts_v0_5_23.py``): a tuple of ``Fact`` rows, each naming
the engine code it mirrors and the integration code that uses it, checked on the installed
engine's classes when the guard is installed, so a release where one has moved is refused with a
typed error naming it rather than guarded wrongly. The probes read classes and bytecode; they
run no engine code. Imports no engine.
"""

from __future__ import annotations

import dis
import importlib
import inspect
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, NamedTuple

MEMBER = "member"
"""On the class itself (a method, an enum member, a class attribute) or the module."""
FIELD = "field"
"""On every instance: a dataclass field, or assigned to ``self`` in the class's ``__init__``
(or a base class's), or, when ``Fact.method`` is given, in that method (set up there)."""
CALLS = "calls"
"""Named in the body of ``Fact.method`` (a call the engine makes there, at that point)."""
DEFINED = "defined"
"""Defined by the class itself (in its own ``__dict__``, not inherited): what a hook replaces
and later puts back must be the class's own."""
UNPACKS = "unpacks"
"""``Fact.method`` unpacks the items of the attribute (or local) ``Fact.name`` into exactly the
names of ``Fact.layout``, in that order (``for decode_req, _, deadline, _, acks in
self.entries``): the layout of a tuple the engine builds and the integration reads or rewrites
by position."""


class Fact(NamedTuple):
    """One private detail of an engine an integration relies on."""

    where: str
    """``module:Class``, or ``module`` for a module-level name."""
    name: str
    how: str
    """``MEMBER``, ``DEFINED``, ``FIELD``, ``CALLS`` or ``UNPACKS``."""
    mirrors: str
    """The engine code it mirrors, and which function of the integration uses it."""
    method: str = ""
    """For ``CALLS`` and ``UNPACKS`` (and a ``FIELD`` set up outside ``__init__``): the method of
    ``where`` whose body is read."""
    layout: tuple[str, ...] = ()
    """For ``UNPACKS``: the names the items unpack into (``_`` for one the engine ignores)."""

    @property
    def label(self) -> str:
        owner = self.where.rpartition(":")[2] or self.where
        if self.how == CALLS:
            return f"{owner}.{self.method} calls {self.name}"
        if self.how == FIELD and self.method:
            return f"{owner}.{self.name} (set in {self.method})"
        if self.how == UNPACKS:
            return f"{owner}.{self.method} unpacks {self.name} as ({', '.join(self.layout)})"
        return f"{owner}.{self.name}"


def resolve(where: str) -> Any:
    """The module, or the class in it, that ``where`` (``module:Class`` or ``module``) names;
    the import's or the lookup's own error when it is not there."""
    module_name, _, owner_name = where.partition(":")
    owner: Any = importlib.import_module(module_name)
    for part in owner_name.split(".") if owner_name else ():
        owner = getattr(owner, part)
    return owner


def holds(fact: Fact) -> bool:
    """Whether the installed engine has ``fact`` (False when its module does not import)."""
    try:
        owner = resolve(fact.where)
        if fact.how == MEMBER:
            return hasattr(owner, fact.name)
        if fact.how == DEFINED:
            return (
                fact.name in vars(owner) if isinstance(owner, type) else hasattr(owner, fact.name)
            )
        if fact.how == FIELD and fact.method:
            return _stores(getattr(owner, fact.method), fact.name)
        if fact.how == FIELD:
            return _is_field(owner, fact.name)
        if fact.how == CALLS:
            return fact.name in _names_in(getattr(owner, fact.method))
        if fact.how == UNPACKS:
            return fact.layout in _unpacked_from(getattr(owner, fact.method), fact.name)
    except Exception:  # an import or a lookup that fails: the fact is not there
        return False
    return False


def missing(facts: Iterable[Fact]) -> list[str]:
    """The labels of the facts the installed engine does not have, in order."""
    return [fact.label for fact in facts if not holds(fact)]


def _is_field(cls: type[Any], name: str) -> bool:
    if name in getattr(cls, "__dataclass_fields__", {}):
        return True
    for klass in cls.__mro__:
        init = klass.__dict__.get("__init__")
        if init is not None and _stores(init, name):
            return True
    return False


def _stores(function: Any, name: str) -> bool:
    return any(ins.opname == "STORE_ATTR" and ins.argval == name for ins in _instructions(function))


def _names_in(function: Any) -> set[str]:
    return {ins.argval for ins in _instructions(function) if isinstance(ins.argval, str)}


def _unpacked_from(function: Any, attribute: str) -> set[tuple[str, ...]]:
    """Every ``UNPACK_SEQUENCE`` of ``function`` that follows a load of ``attribute`` (within
    the same loop header), as the names its items are stored into."""
    return unpacked(list(_instructions(function)), attribute)


def unpacked(code: Sequence[Any], attribute: str) -> set[tuple[str, ...]]:
    """``_unpacked_from`` over instructions (anything with ``opname``, ``arg``, ``argval``).
    The stores that follow an unpack are read as CPython writes them: one name each
    (``STORE_FAST``, ``STORE_NAME``), or two at once (3.13's ``STORE_FAST_STORE_FAST``)."""
    found: set[tuple[str, ...]] = set()
    for i, ins in enumerate(code):
        if ins.opname != "UNPACK_SEQUENCE":
            continue
        before = code[max(0, i - 4) : i]
        if not any(b.opname in _LOADS and b.argval == attribute for b in before):
            continue
        want = int(ins.arg or 0)
        names: list[str] = []
        for store in code[i + 1 : i + 1 + want]:
            if store.opname in ("STORE_FAST", "STORE_NAME"):
                names.append(str(store.argval))
            elif store.opname == "STORE_FAST_STORE_FAST":
                names.extend(str(n) for n in store.argval)
            else:
                break
            if len(names) >= want:
                break
        if len(names) == want:
            found.add(tuple(names))
    return found


# What an unpacked value is loaded by: an attribute (``self.entries``) or a local (``entry``).
_LOADS = frozenset({"LOAD_ATTR", "LOAD_METHOD", "LOAD_FAST", "LOAD_FAST_CHECK"})


def _instructions(function: Any) -> Iterator[dis.Instruction]:
    return dis.get_instructions(inspect.unwrap(getattr(function, "__func__", function)))


__all__ = [
    "CALLS",
    "DEFINED",
    "FIELD",
    "MEMBER",
    "UNPACKS",
    "Fact",
    "holds",
    "missing",
    "resolve",
    "unpacked",
]
