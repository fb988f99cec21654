"""The transfer-engine protocol every adapter implements: the target's memory and the initiator.

Two sides, as in Mooncake: the *target* (the memory owner: decode when prefill pushes, prefill
when decode pulls) registers the memory peers may reach; the *initiator* posts batches of
writes (or reads) against it and asks for their status. Statuses use Mooncake's Python codes
(``get_batch_transfer_status``: 0 completed, -1 failed), so one bookkeeping
(``kvlifetime.adapters.mooncake.GrantTransfers``) turns any engine's statuses into evidence.

Implemented by ``kvlifetime.adapters.inproc`` (the embedded default, in-process threads),
``kvlifetime.adapters.mooncake`` (Mooncake TCP) and ``kvlifetime.adapters.nixl_engine`` (NIXL
over UCX/TCP); ``kvlifetime.adapters.engines`` opens the one a backend names.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:  # light at import: the command line's parser reads the backends' names
    import numpy as np
    import numpy.typing as npt

Slice = tuple[int, int, int]
"""One write: (offset in the initiator's staging memory, address in the target, length). For a
read (``ReadEngine.submit_read``) the same triple, copied the other way: target -> staging."""


class Status(enum.IntEnum):
    """A batch's final status, with Mooncake's ``get_batch_transfer_status`` codes."""

    COMPLETED = 0
    FAILED = -1


class TargetMemory(Protocol):
    """Memory a peer may reach: the owner's KV arena (decode's when prefill writes into it,
    prefill's source blocks when decode reads them)."""

    @property
    def array(self) -> npt.NDArray[np.uint8]: ...

    def descriptor(self) -> dict[str, Any]:
        """Plain data that lets an initiator in another process reach this memory."""
        ...

    def address(self, offset: int) -> int:
        """The address a peer writes to for byte ``offset`` of ``array``."""
        ...

    def unregister(self) -> None:
        """Refuse new writes. Does NOT stop writes already accepted (not revocation)."""
        ...

    def fence(self) -> str:
        """End every peer's access to this memory for real, from the target's side; return
        the fence's name once its completion is observed (``descriptor()`` may change: peers
        served afterwards need the new one). Raises ``FenceUnavailable`` when the engine has
        no target-side fence."""
        ...

    def close(self) -> None: ...


class TransferEngine(Protocol):
    """The initiator side: posts batches of writes from ``staging`` into a target."""

    @property
    def staging(self) -> npt.NDArray[np.uint8]: ...

    def submit(self, slices: Sequence[Slice]) -> int:
        """Post one batch; returns its handle. Never blocks on the transfer itself."""
        ...

    def wait(self, handle: int, timeout: float) -> Status:
        """The batch's final status, blocking at most ``timeout`` seconds (FAILED on timeout:
        which proves nothing, exactly like a FAILED from the engine)."""
        ...

    def advance(self, tick: int) -> None:
        """Logical time ``tick`` has come (the harness runs in lock-step ticks)."""
        ...

    def close(self) -> None: ...


class ReadEngine(TransferEngine, Protocol):
    """An initiator that can also READ: copy slices of the target's memory into ``staging``."""

    def submit_read(self, slices: Sequence[Slice]) -> int:
        """Post one batch of reads (target address -> staging offset); its handle, for
        ``wait``. Never blocks on the transfer itself. COMPLETED: every byte is in staging."""
        ...
