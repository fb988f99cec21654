"""One installation of the guard in an SGLang process: the guard, the originals its rows
replaced (``Patches``), and what every handler does with a value it reads from SGLang.

``DecodeHooks`` and ``PrefillHooks`` (one per role) are the handlers of the rows in
``facts_v0_5_23``; this base is what both share: the lifecycle key the installation tags on
SGLang's receiver and sender objects, the room read through the guard's one entry check, and the
error policy inside SGLang's loop (a guard refusal is typed, counted and logged by the guard;
SGLang keeps running).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from kvlifetime.errors import KVLifetimeError
from kvlifetime.guard import Refusal
from kvlifetime.integrations.hooks import Hook, Patches
from kvlifetime.integrations.sglang.guard import SGLangGuard
from kvlifetime.integrations.sglang.lifecycles import room_id

# The lifecycle key, set on SGLang's receiver / sender objects with the installation that set it:
# a guard's keys start again at "#1", so a key an earlier installation left on an object that
# outlived it would name another lifecycle of the current guard.
_KEY = "_kvl_key"

T = TypeVar("T")


class Installation:
    """What one ``install`` put in SGLang, to restore it exactly."""

    ROWS: tuple[Hook, ...] = ()

    def __init__(self, guard: SGLangGuard) -> None:
        self.guard = guard
        self.patches = Patches()

    def apply(self) -> None:
        """Put every handler of ``ROWS`` in SGLang (all, or none on an error)."""
        self.patches.apply(self.ROWS, self)

    def restore(self) -> None:
        self.patches.restore()

    def key_of(self, obj: Any) -> str | None:
        """The lifecycle key this installation set on ``obj`` (None: none, or another's)."""
        tag = getattr(obj, _KEY, None)
        if type(tag) is tuple and len(tag) == 2 and tag[0] is self and type(tag[1]) is str:
            return tag[1]
        return None

    def set_key(self, obj: Any, key: str) -> None:
        setattr(obj, _KEY, (self, key))

    def room(self, obj: Any, at: str) -> int | None:
        """``obj.bootstrap_room`` through the guard's one entry check (``engine_room``): the
        plain int, or None when it is malformed (refused there: typed, counted, logged)."""
        room = self.guard.engine_room(getattr(obj, "bootstrap_room", None), at=at)
        return None if isinstance(room, Refusal) else room

    def quiet(self, call: Callable[[], T]) -> T | None:
        """A guard call from inside SGLang: what it answers (a refusal is data: typed, counted
        and logged by the guard); a misuse the guard raises (a call before it is bound,
        ``GuardNotBound``) is typed too, and SGLang keeps running (None)."""
        try:
            return call()
        except KVLifetimeError:
            return None

    def accepted(self, call: Callable[[], T | Refusal]) -> T | None:
        """``quiet``, with a refusal as None (the handler goes on as if nothing was said)."""
        out = self.quiet(call)
        return None if isinstance(out, Refusal) else out


def plain_room(value: Any) -> int | None:
    """A room SGLang passes back to a hook for a lookup: the plain int, or None (never a
    refusal: the room was checked where it entered)."""
    try:
        return room_id(value)
    except KVLifetimeError:
        return None


__all__ = ["Installation", "plain_room"]
