"""Hooks as data: where an integration sits in an engine, as rows, and the one wrapper that
puts a translator's handler there.

A ``Hook`` row names an engine class (or module) and attribute, when the handler runs around
the engine's own code, the guard-core event it leads to, and the translator method that handles
it. ``Patches.apply`` replaces each attribute with the generic wrapper over the engine's
original and remembers the original; ``restore`` puts every one back. The rows of a version
live in that version's engine-facts module (``sglang/facts_v0_5_23.py``), beside the other
private details the handlers rely on, and are checked there at install (each target exists).

The wrapper, for a row ``when``, called as ``(first, *rest, **kwargs)`` (``first``: the
engine's ``self``, ``cls`` for a classmethod, a function's first argument):

- ``"before"``: ``handler(first, *rest, **kwargs)`` runs first; it returns ``PROCEED`` (the
  engine's code then runs, its result returned) or the value the call returns instead;
- ``"after"``: ``handler(first, result, *rest, **kwargs)`` gets the engine's result and returns
  the call's result;
- ``"around"``: ``handler(first, original, *rest, **kwargs)`` calls the engine's code
  (``original(first, *rest, **kwargs)``) itself, or not.

So a handler may be a bound method of a translator object (SGLang's) or a method of the class
that the wrapper is put on (vLLM's connector: ``first`` is then the handler's ``self``). Imports
no engine.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any, Final, Literal, NamedTuple

from kvlifetime.integrations.engine_facts import DEFINED, Fact, resolve

When = Literal["before", "after", "around"]


class _Proceed:
    __slots__ = ()

    def __repr__(self) -> str:
        return "PROCEED"


PROCEED: Final = _Proceed()
"""What a ``"before"`` handler returns to let the engine's own code run."""


class Hook(NamedTuple):
    """One place an integration sits in an engine."""

    where: str
    """``module:Class`` (``module:Outer.Inner``), or ``module`` for a module-level function."""
    name: str
    """The attribute replaced."""
    when: When
    event: str
    """What it leads to in the guard core (the engine-side event, or the call it answers)."""
    handler: str
    """The translator's method that handles it."""
    kind: Literal["method", "classmethod", "function"] = "method"

    @property
    def fact(self) -> Fact:
        """The engine fact the row relies on: its target is the class's own (or the module's)."""
        return Fact(self.where, self.name, DEFINED, f"hooked: {self.handler} ({self.event})")


def wrapper(when: When, original: Callable[..., Any], handler: Callable[..., Any]) -> Any:
    """The one generic wrapper: ``handler`` around ``original`` as ``when`` says."""
    if when == "before":

        def before(first: Any, *rest: Any, **kwargs: Any) -> Any:
            out = handler(first, *rest, **kwargs)
            return original(first, *rest, **kwargs) if out is PROCEED else out

        return before
    if when == "after":

        def after(first: Any, *rest: Any, **kwargs: Any) -> Any:
            return handler(first, original(first, *rest, **kwargs), *rest, **kwargs)

        return after

    def around(first: Any, *rest: Any, **kwargs: Any) -> Any:
        return handler(first, original, *rest, **kwargs)

    return around


class Patches:
    """The originals one installation replaced, to restore them exactly."""

    def __init__(self) -> None:
        self._saved: list[tuple[Hook, Any, Any]] = []
        self._originals: dict[tuple[str, str], Any] = {}  # (where, name) -> the engine's own

    def apply(self, rows: Iterable[Hook], handlers: object) -> None:
        """Put ``getattr(handlers, row.handler)`` at each row's target (all or, on an error,
        none: what was applied is restored and the error raised)."""
        try:
            for row in rows:
                self._apply(row, getattr(handlers, row.handler))
        except BaseException:
            self.restore()
            raise

    def _apply(self, row: Hook, handler: Callable[..., Any]) -> None:
        owner = resolve(row.where)
        if isinstance(owner, type) and row.name not in owner.__dict__:
            # (inherited, or gone: a row names the class that defines the attribute)
            raise AttributeError(f"{row.where} defines no {row.name!r}")
        saved = owner.__dict__[row.name] if isinstance(owner, type) else getattr(owner, row.name)
        if row.kind == "classmethod":
            patched: Any = classmethod(wrapper(row.when, saved.__func__, handler))
        else:
            patched = wrapper(row.when, saved, handler)
        self._saved.append((row, owner, saved))
        self._originals[row.where, row.name] = (
            saved.__func__ if row.kind == "classmethod" else saved
        )
        setattr(owner, row.name, patched)

    def original(self, where: str, name: str) -> Any:
        """The engine's own function a row at (``where``, ``name``) replaced."""
        original = self._originals.get((where, name))
        if original is None:
            raise LookupError(f"{where}.{name} is not hooked")
        return original

    def restore(self) -> None:
        for row, owner, saved in reversed(self._saved):
            setattr(owner, row.name, saved)
        self._saved.clear()
        self._originals.clear()

    def points(self) -> Iterator[tuple[Any, str]]:
        """Every (class or module, attribute) replaced."""
        for row, owner, _ in self._saved:
            yield owner, row.name


__all__ = ["PROCEED", "Hook", "Patches", "When", "wrapper"]
