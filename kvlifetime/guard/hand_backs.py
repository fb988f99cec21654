"""HandBacks: the ids a guard owes its engine, each handed back once, on one channel.

Two queues, both filled by the core and emptied by the translator at the step's end: the ended
requests the ledger released (the engine frees their blocks: vLLM's ``finished_sending``), and
the live requests whose failed load a fence ended (their held receive: vLLM's
``finished_recving``). Taking an id fires the engine-side table's ``handed_back``, so the table
refuses a second hand-back of it on either channel.
"""

from __future__ import annotations

from typing import Any

from kvlifetime.guard.holds import Holds


class HandBacks:
    """What the engine is due and has not been handed yet (the engine's scheduler thread)."""

    def __init__(self, holds: Holds[Any]) -> None:
        self.holds = holds
        self._released: dict[str, None] = {}  # releasable: the engine frees each, once
        self._fenced: dict[str, None] = {}  # fenced: their held receive is due, once
        self.handed_back = 0  # ids handed back after the ledger released them

    def released(self, request: str) -> None:
        """``request`` became releasable: due to the engine."""
        self._released[request] = None

    def fenced(self, request: str) -> None:
        """A fence ended ``request``'s failed load: its held receive is due."""
        self._fenced[request] = None

    def is_fenced(self, request: str) -> bool:
        return request in self._fenced

    def drop_fenced(self, request: str) -> None:
        """``request``'s held receive is no longer due (a READ exposure superseded it)."""
        self._fenced.pop(request, None)

    def handed_at_once(self, request: str) -> None:
        """``request`` was released as it ended: the engine frees it now, not from the queue."""
        self._released.pop(request, None)
        self.holds.fire(request, "handed_back")  # (remembered: the guard released it)

    def take_released(self) -> set[str]:
        """The released requests not handed back yet, each once: the engine frees them now."""
        if not self._released:
            return set()
        out = set(self._released)
        self._released.clear()
        for request in out:
            self.holds.fire(request, "handed_back")
        self.handed_back += len(out)
        return out

    def take_fenced(self) -> set[str]:
        """The live requests whose held receive is due, each once."""
        if not self._fenced:
            return set()
        out = [r for r in self._fenced if self.holds.fire(r, "handed_back") is None]
        self._fenced.clear()
        return set(out)
