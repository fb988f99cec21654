"""FenceLog: fences recorded from any thread, applied at a scheduler step's start.

A fence (an operation on the memory owner's side that ends a peer's access, observed complete:
docs/fencing.md) may be reported by an operator's thread in the middle of a step. It covers
only the exposures whose ids had left the process when it was recorded, so the log keeps, with
each fence, the step in progress then; ``revocations`` names the grants it revokes
(``AccessRevoked``): every open grant of an earlier step, and no other. A fence thus never
releases blocks whose ids leave in the output of the step it arrived in.
"""

from __future__ import annotations

import threading

from kvlifetime import inputs
from kvlifetime.errors import InvalidField
from kvlifetime.guard.holds import Holds


class FenceLog:
    """Fences not applied yet: name -> the step in progress when recorded, in order."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._fences: dict[str, int] = {}

    def record(self, name: object, step: int) -> str:
        """From any thread. A name recorded twice keeps its latest step. A name that is not a
        non-empty str of at most 128 characters is ``InvalidField`` (the caller's fault)."""
        plain = inputs.peer_id(name, "fence")
        if len(plain) > 128:
            raise InvalidField(f"fence must be a non-empty str of at most 128 chars, got {plain!r}")
        with self._lock:
            self._fences.pop(plain, None)
            self._fences[plain] = step
        return plain

    def take(self) -> dict[str, int]:
        """Every fence recorded since the last call, in the order of recording."""
        if not self._fences:
            return {}
        with self._lock:
            out, self._fences = self._fences, {}
        return out

    def __len__(self) -> int:
        with self._lock:
            return len(self._fences)


def revocations(holds: Holds[int], step: int) -> tuple[list[int], list[str]]:
    """The grants a fence recorded at ``step`` revokes: every open grant of a hold made in an
    earlier step (their handles), and the request of each."""
    handles: list[int] = []
    requests: list[str] = []
    for request, hold in holds:
        if hold.read is not None and hold.read_step < step:
            handles.append(hold.read)
            requests.append(request)
        if hold.write is not None and hold.write_step < step:
            handles.append(hold.write)
            requests.append(request)
    return handles, requests
