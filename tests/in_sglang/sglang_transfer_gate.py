"""A gate on the prefill's transfer engine (test instrumentation, the same alone and guarded).

It wraps ``batch_transfer_sync`` of SGLang's ``MooncakeTransferEngine``: one call per batch of
page indices (``SGLANG_MOONCAKE_MAX_TRANSFER_BATCH_INDICES``), or per layer when the prefill
sends a head slice to a decode of another TP width. It lets a given number of batches start,
then holds the next ones inside the transfer worker (the chunk is in flight: counted by SGLang
as outstanding, some of its bytes landed, the rest waiting) until released. With ``poison``, a
held batch returns -1 at once and runs when released, as Mooncake's sync call does on its
timeout ("returns -1 ... with the batch still running").
"""

from __future__ import annotations

import threading
import time
from typing import Any


class TransferGate:
    def __init__(self, engine: Any) -> None:
        self._cond = threading.Condition()
        self._allowed: int | None = None  # batches that may still start (None: no gate)
        self._poison = False
        self._reached = threading.Event()
        self._late: list[threading.Thread] = []
        self.log: list[tuple[float, int | None, int]] = []  # (when, allowed, slices)
        self._real = engine.batch_transfer_sync
        engine.batch_transfer_sync = self._gated

    def _may_start(self) -> bool:
        return self._allowed is None or self._allowed > 0

    def _admit(self) -> None:
        if self._allowed is not None:
            self._allowed -= 1

    def _gated(self, session_id: str, *batch: Any) -> int:
        if not batch[-1]:  # no lengths: nothing to move
            return int(self._real(session_id, *batch))
        self.log.append((time.monotonic(), self._allowed, len(batch[-1])))
        with self._cond:
            held = not self._may_start()
            if held:
                self._reached.set()
                poison = self._poison
            else:
                self._admit()
        if held and poison:

            def late() -> None:
                with self._cond:
                    self._cond.wait_for(self._may_start)
                    self._admit()
                self._real(session_id, *batch)

            t = threading.Thread(target=late, daemon=True)
            t.start()
            self._late.append(t)
            return -1
        if held:
            with self._cond:
                self._cond.wait_for(self._may_start)
                self._admit()
        return int(self._real(session_id, *batch))

    def hold(self, after_batches: int, poison: bool = False) -> None:
        """From now on, let ``after_batches`` batches start, then hold the next ones."""
        with self._cond:
            self._allowed = after_batches
            self._poison = poison
            self._reached.clear()

    def wait_held(self, seconds: float) -> bool:
        return self._reached.wait(seconds)

    def release(self, then_hold_after: int | None = None) -> None:
        """Let the held batches go (and, with ``then_hold_after``, hold again after that many
        more)."""
        with self._cond:
            self._allowed = then_hold_after
            self._reached.clear()
            self._cond.notify_all()

    def wait_late_writes(self, timeout: float) -> None:
        for t in self._late:
            t.join(timeout)
        self._late = []
