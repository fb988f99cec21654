"""A fake engine over ``GuardCore``, beside the real ones (as SGLang's ``fake/`` backend sits
beside its transfer backends): a pool of blocks, requests that hold some, an output of ids on
two channels, and the engine's own asserts (an id it frees must be a finished request it still
holds; a block it frees must be free of every open grant). It pins the core's promises in
seconds, with no vLLM or SGLang installed."""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from kvlifetime.guard import GuardCore, RefusalKind
from kvlifetime.ledger import StepLedger


class FakeEngine:
    def __init__(self, num_blocks: int = 16) -> None:
        self.core = GuardCore(StepLedger(num_blocks), peer="p", engine="fake")
        self.free = list(range(num_blocks))
        self.blocks: dict[str, list[int]] = {}
        self.finished: set[str] = set()
        self.freed: list[str] = []

    def admit(self, request: str, n: int) -> list[int]:
        ids, self.free = self.free[:n], self.free[n:]
        self.blocks[request] = ids
        self.core.holds.admit(request)
        return ids

    def end(self, request: str, *, remote_read: bool, aborted: bool = False) -> None:
        self.finished.add(request)
        ids = self.blocks[request] if remote_read else []
        state = self.core.end(request, ids, aborted=aborted)
        if state in ("ended", "handed_back") and not remote_read:
            if state == "ended":
                self.core.engine_freed(request)
            self._free(request)

    def step_end(self) -> list[str]:
        """The step's end: the journal into the ledger; returns the requests whose block ids
        must not leave (their READ grant was refused)."""
        self.core.end_step()
        return self.core.take_refused_reads()

    def step_begin(self) -> None:
        self.core.begin_step()
        for request in self.core.take_released():
            self._free(request)

    def sends(self, requests: Iterable[str]) -> None:
        """The transfer engine reports reads done for ``requests``."""
        for request in requests:
            hold = self.core.holds.get(request)
            if hold is not None and hold.state == "ended":
                if self.core.reports.reads_done(request) is None:
                    self._free(request)  # nothing exposed: the engine's own id
            elif hold is not None:
                self.core.reports.reads_done(request)
            else:
                handed = self.core.holds.handed_back(request)
                kind = RefusalKind.DUPLICATE_ID if handed else RefusalKind.UNKNOWN_ID
                self.core.refusals.refuse(kind, request)
        self.core.settle()
        for request in self.core.take_released():
            self._free(request)

    def _free(self, request: str) -> None:
        assert request in self.finished and request in self.blocks, request
        ids = self.blocks.pop(request)
        if ids:
            open_ = self.core.ledger.open_access(np.array(ids, dtype=np.int64))
            assert not open_.any(), f"{request}: freed {ids} under an open grant"
        self.free.extend(ids)
        self.freed.append(request)
