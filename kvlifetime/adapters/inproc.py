"""The in-process transfer engine: the embedded default, beside the real ones (Mooncake, NIXL).

``InprocTarget`` / ``InprocEngine`` implement ``kvlifetime.adapters.transfer`` (the target's
memory, the initiator) with nothing installed: the arena is shared memory, copies run on a
thread of the initiator's process. They reproduce the real engine's hard semantics
(the table in ``kvlifetime.adapters.mooncake``), never kinder:

- the address range is checked once per slice, when it is posted (Mooncake checks it when the
  target reads the request header); ``unregister`` refuses *new* slices only, a slice already
  accepted keeps writing and reports COMPLETED;
- a batch is FAILED as soon as one slice fails, and its other slices still land afterwards:
  here, ``straggle_ticks`` ticks later, after the FAILED status was reported;
- there is no cancel.

A crash whose writes land after the initiator is gone (``FaultConfig.land_after_crash``): on
transports where data handed over keeps landing after the initiator process is gone (a NIC's
queue, a target engine that applies what it had received), the in-process engine can hand each
posted batch to the *target's* side at once (``InprocEngine.hand_over``, records in a region of
the shared mapping that belongs to that initiator), and retire the records when its own copy
thread lands them. When the initiator dies, the target takes over what it had not landed
(``InprocTarget.take_over``) and applies it at its due tick (``InprocTarget.advance``), logged
like every landing. Reaping the initiator no longer ends those writes: the target must discard
them (``InprocTarget.cut``), which is part of the in-process fence when the knob is on.

READ (the pull direction, vLLM's NIXL path): the initiator (decode) copies slices of the target's
memory (prefill's source arena) into its own staging with ``submit_read``. Same hard semantics:
the copies run on the initiator's thread, a FAILED batch's other slices still read the source
(and write the initiator's staging) ``straggle_ticks`` later, ``unregister`` refuses only new
slices, and there is no cancel. A read changes nothing in the target: it is not in the landing log.
"""

from __future__ import annotations

import mmap
import os
import queue
import tempfile
import threading
from collections.abc import Mapping, Sequence
from typing import Any

import attrs
import numpy as np
import numpy.typing as npt

from kvlifetime.adapters.transfer import Slice, Status
from kvlifetime.errors import FenceUnavailable

_HEADER = 64  # bytes before the arena in the shared segment; word 0: registered (1) or not (0),
# word 1: how many slices the copy thread has logged (only grows)
LOG_SLOTS = 1 << 16  # the landing log after the arena: a ring of (offset, nbytes, first word)
_LOG_BYTES = LOG_SLOTS * 3 * 8
# Tags in the high bits of a log row's nbytes: who made the landing, for the oracle's split.
LOG_AFTER_DEATH = 1 << 40  # applied by the target for an initiator that was gone
LOG_REDELIVERED = 1 << 41  # a copy of an old slice, applied again by the transport
LOG_NBYTES = LOG_AFTER_DEATH - 1
# After the log: one hand-over region per initiator (``land_after_crash``), each a table of
# (state, due tick, arena offset, nbytes, word): state 1 is handed over, not yet landed.
HANDOVER_REGIONS = 32
HANDOVER_SLOTS = 4096
_HANDOVER_BYTES = HANDOVER_REGIONS * HANDOVER_SLOTS * 5 * 8
_TAIL = _LOG_BYTES + _HANDOVER_BYTES


class OracleOverflow(RuntimeError):
    """The landing log was overwritten before it was read: the oracle would miss landings, so
    the run stops instead of under-counting. Whose fault: the harness's log is too small."""


class HandoverFull(RuntimeError):
    """An initiator has more slices handed over than its region holds: the harness's region
    is too small (the run stops rather than lose writes the target would have landed)."""


INPROC_BASE = 1 << 40  # addresses look like pointers, so an offset is never mistaken for one


def _shm_dir() -> str | None:
    # /dev/shm keeps the arena in memory; elsewhere a temporary file is as good, just slower.
    return "/dev/shm" if os.path.isdir("/dev/shm") else None


class InprocTarget:
    """The arena in a shared mapping, so that a prefill process can write into it.

    A plain file mapping rather than ``multiprocessing.shared_memory``: its resource tracker
    would unlink the segment when the first process that attached to it exits."""

    def __init__(self, nbytes: int) -> None:
        fd, self._path = tempfile.mkstemp(prefix="kvlifetime-arena-", dir=_shm_dir())
        try:
            os.ftruncate(fd, _HEADER + nbytes + _TAIL)
            self._map = mmap.mmap(fd, _HEADER + nbytes + _TAIL)
        finally:
            os.close(fd)
        self._flag = np.ndarray((2,), dtype=np.uint64, buffer=self._map)
        self._array = np.ndarray((nbytes,), dtype=np.uint8, buffer=self._map, offset=_HEADER)
        self._log = np.ndarray(
            (LOG_SLOTS, 3), dtype=np.uint64, buffer=self._map, offset=_HEADER + nbytes
        )
        self._handover = _handover_table(self._map, nbytes)
        # a dead initiator's slices, applied by this side: (due, region, offset, nbytes, word)
        self._orphans: list[tuple[int, int, int, int, int]] = []
        self.landed_after_death = 0  # slices this side applied for a dead initiator
        self.cut_by_fence = 0  # ... and those a fence discarded before they landed
        self._read = 0  # log entries already handed out by landings()
        self._flag[0] = 1
        self.nbytes = nbytes
        self._closed = False

    @property
    def array(self) -> npt.NDArray[np.uint8]:
        return self._array

    def descriptor(self) -> dict[str, Any]:
        return {"kind": "inproc", "path": self._path, "base": INPROC_BASE, "nbytes": self.nbytes}

    def address(self, offset: int) -> int:
        return INPROC_BASE + offset

    def unregister(self) -> None:
        self._flag[0] = 0

    def landings(self) -> npt.NDArray[np.uint64]:
        """Every slice the copy thread wrote since the last call, in order, as rows of
        (arena offset, nbytes, first word written). Raises ``OracleOverflow`` if the ring was
        lapped (landings would be missed). Read it when the initiator is between ticks."""
        count = int(self._flag[1])
        n = count - self._read
        if n > LOG_SLOTS:
            raise OracleOverflow(f"{n} landings since the last look, the log holds {LOG_SLOTS}")
        idx = np.arange(self._read, count) % LOG_SLOTS
        self._read = count
        return self._log[idx].copy()

    def take_over(self, region: int, now: int) -> int:
        """The initiator using hand-over ``region`` is dead (reaped): what it handed over and
        did not land is this side's now, applied at its due tick (at the earliest ``now + 1``).
        Returns how many slices were taken over; the region is free again."""
        t = self._handover[region]
        live = np.flatnonzero(t[:, 0] == 1)
        for i in live.tolist():
            _s, due, off, n, word = (int(x) for x in t[i])
            self._orphans.append((max(due, now + 1), region, off, n, word))
        t[:] = 0
        self._orphans.sort(key=lambda o: (o[0], o[1], o[2]))
        return len(live)

    def advance(self, tick: int) -> int:
        """Apply the taken-over slices due by ``tick``, in order, logged like every landing.
        Returns how many landed. Call it while no initiator is copying (between ticks)."""
        due = [o for o in self._orphans if o[0] <= tick]
        if not due:
            return 0
        self._orphans = [o for o in self._orphans if o[0] > tick]
        for _t, _r, off, n, word in due:
            self._array[off : off + n].view(np.uint64)[:] = np.uint64(word)
            i = int(self._flag[1])
            self._log[i % LOG_SLOTS] = (off, n | LOG_AFTER_DEATH, word)
            self._flag[1] = i + 1
        self.landed_after_death += len(due)
        return len(due)

    def pending_after_death(self) -> int:
        return len(self._orphans)

    def cut(self, region: int) -> int:
        """The target's half of the in-process fence when initiators hand over: discard what
        the (reaped) initiator of ``region`` had handed over and this side not yet applied.
        Synchronous, in this process: observed complete when it returns. Returns how many."""
        t = self._handover[region]
        n = int(np.count_nonzero(t[:, 0] == 1))
        t[:] = 0
        keep = [o for o in self._orphans if o[1] != region]
        n += len(self._orphans) - len(keep)
        self._orphans = keep
        self.cut_by_fence += n
        return n

    def fence(self) -> str:
        # The copies run on a thread of the initiator's process, which mapped the arena itself:
        # nothing on this side can take that mapping away. The fence is on the initiator:
        # kill and reap its process (``kvlifetime.harness.peer.fence_peer``).
        raise FenceUnavailable(
            "in-process engine: the copies run in the initiator's process, which maps the "
            "arena itself; the target cannot cut it. Fence by reaping the initiator process"
        )

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._flag[0] = 0
        # numpy views must go before the mapping can be closed.
        del self._flag, self._array, self._log, self._handover
        self._map.close()
        os.unlink(self._path)


def _handover_table(m: mmap.mmap, nbytes: int) -> npt.NDArray[np.uint64]:
    return np.ndarray(
        (HANDOVER_REGIONS, HANDOVER_SLOTS, 5),
        dtype=np.uint64,
        buffer=m,
        offset=_HEADER + nbytes + _LOG_BYTES,
    )


@attrs.define(slots=True)
class _Batch:
    done: threading.Event
    status: Status
    pending: int  # accepted slices not yet copied
    ticket: int = 0  # hand-over records to retire once every slice has landed (0: none)


class InprocEngine:
    """Initiator side of the in-process engine: copies on one thread, in submission order, so
    that a seed decides which write lands last. Writes (``submit``) and reads (``submit_read``)
    share the thread, the order and the failure semantics."""

    def __init__(
        self,
        target: Mapping[str, Any],
        staging_bytes: int,
        *,
        straggle_ticks: int = 4,
        handover_region: int | None = None,
    ) -> None:
        nbytes = int(target["nbytes"])
        with open(str(target["path"]), "r+b") as f:
            self._map = mmap.mmap(f.fileno(), _HEADER + nbytes + _TAIL)
        self._flag = np.ndarray((2,), dtype=np.uint64, buffer=self._map)
        self._arena = np.ndarray((nbytes,), dtype=np.uint8, buffer=self._map, offset=_HEADER)
        self._log = np.ndarray(
            (LOG_SLOTS, 3), dtype=np.uint64, buffer=self._map, offset=_HEADER + nbytes
        )
        self._base = int(target["base"])
        # land_after_crash: this initiator's hand-over region in the target's table
        self._region = (
            None if handover_region is None else _handover_table(self._map, nbytes)[handover_region]
        )
        self._free_records = list(range(HANDOVER_SLOTS - 1, -1, -1))
        self._records: dict[int, list[int]] = {}  # ticket -> record slots
        self._next_ticket = 1
        self._staging = np.zeros(staging_bytes, dtype=np.uint8)
        self._straggle = straggle_ticks
        self._batches: dict[int, _Batch] = {}
        self._tags: dict[int, int] = {}  # handle -> log tag (re-deliveries)
        self._next = 1
        self._tick = 0
        # (due tick, handle, slices, read)
        self._late: list[tuple[int, int, list[Slice], bool]] = []
        self._copies: queue.Queue[tuple[int, list[Slice], bool] | None] = queue.Queue()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._copy_loop, name="inproc-dma", daemon=True)
        self._thread.start()
        self.bytes_written = 0
        self.bytes_read = 0

    @property
    def staging(self) -> npt.NDArray[np.uint8]:
        return self._staging

    def _accepts(self, s: Slice) -> bool:
        # The "header check": once per slice, when it is posted, never again.
        src, dst, n = s
        off = dst - self._base
        local = src >= 0 and src + n <= len(self._staging)
        return bool(self._flag[0]) and off >= 0 and off + n <= len(self._arena) and local

    def submit(self, slices: Sequence[Slice], ticket: int = 0) -> int:
        """Post one batch of writes; ``ticket`` (from ``hand_over``): retire those records
        once every accepted slice of the batch has landed."""
        return self._submit(slices, read=False, ticket=ticket)

    def redeliver(self, slices: Sequence[Slice]) -> int:
        """The transport applies old slices again (``FaultConfig.p_redeliver``): a write batch
        like any other, tagged in the landing log so that the oracle can tell it apart."""
        handle = self._submit(slices, read=False, tag=LOG_REDELIVERED)
        return handle

    @property
    def hands_over(self) -> bool:
        return self._region is not None

    def hand_over(self, slices: Sequence[Slice], due: int) -> int:
        """Hand the accepted slices of a batch posted now to the target's side, to land at
        ``due`` if this process dies first; their bytes are those in staging now. Returns the
        ticket to pass to ``submit`` (0 when this engine does not hand over)."""
        region = self._region
        if region is None:
            return 0
        ok = [s for s in slices if self._accepts(s)]
        with self._lock:
            if len(ok) > len(self._free_records):
                raise HandoverFull(f"{len(ok)} slices, {len(self._free_records)} records free")
            ticket = self._next_ticket
            self._next_ticket += 1
            slots = []
            for src, dst, n in ok:
                i = self._free_records.pop()
                head = self._staging[src : src + 8]
                word = int(head.view(np.uint64)[0]) if len(head) == 8 else 0
                region[i, 1:] = (due, dst - self._base, n, word)
                region[i, 0] = 1  # the state last: the record is whole when it reads as live
                slots.append(i)
            self._records[ticket] = slots
        return ticket

    def _retire(self, ticket: int) -> None:
        # under self._lock
        slots = self._records.pop(ticket, None)
        if slots and self._region is not None:
            self._region[slots, 0] = 0
            self._free_records.extend(slots)

    def submit_read(self, slices: Sequence[Slice]) -> int:
        """Post a batch of reads from the target's arena into ``staging``."""
        return self._submit(slices, read=True)

    def _submit(self, slices: Sequence[Slice], *, read: bool, ticket: int = 0, tag: int = 0) -> int:
        ok = [s for s in slices if self._accepts(s)]
        failed = len(ok) != len(slices)
        with self._lock:
            handle = self._next
            self._next += 1
            status = Status.FAILED if failed else Status.COMPLETED
            b = _Batch(threading.Event(), status, len(ok), ticket if ok else 0)
            self._batches[handle] = b
            if tag:
                self._tags[handle] = tag
        if ticket and not ok:
            with self._lock:
                self._retire(ticket)
        if failed:
            # FAILED is reported now; the accepted slices land later, after the status was read.
            b.done.set()
            if ok:
                self._late.append((self._tick + self._straggle, handle, ok, read))
        elif ok:
            self._copies.put((handle, ok, read))
        else:
            b.done.set()
        return handle

    def wait(self, handle: int, timeout: float) -> Status:
        with self._lock:
            b = self._batches.get(handle)
        if b is None:
            return Status.FAILED
        if not b.done.wait(timeout):
            return Status.FAILED
        with self._lock:
            if b.pending == 0:
                self._batches.pop(handle, None)
        return b.status

    def advance(self, tick: int) -> None:
        self._tick = tick
        due = [x for x in self._late if x[0] <= tick]
        if due:
            self._late = [x for x in self._late if x[0] > tick]
            for _t, handle, ok, read in due:
                self._copies.put((handle, ok, read))
        # Every copy due by now has landed before the tick ends: landing order is the seed's.
        self._copies.join()

    def _copy_loop(self) -> None:
        while True:
            item = self._copies.get()
            try:
                if item is None:
                    return
                handle, slices, read = item
                with self._lock:
                    tag = self._tags.get(handle, 0)
                for src, dst, n in slices:
                    off = dst - self._base
                    if read:  # the source is read, nothing in it changes: not a landing
                        self._staging[src : src + n] = self._arena[off : off + n]
                        self.bytes_read += n
                        continue
                    self._arena[off : off + n] = self._staging[src : src + n]
                    self.bytes_written += n
                    # The oracle's log: what landed where, then the count (one writer).
                    i = int(self._flag[1])
                    head = self._staging[src : src + 8]
                    word = int(head.view(np.uint64)[0]) if len(head) == 8 else 0
                    self._log[i % LOG_SLOTS] = (off, n | tag, word)
                    self._flag[1] = i + 1
                with self._lock:
                    b = self._batches.get(handle)
                    if b is not None:
                        b.pending -= len(slices)
                        if b.pending == 0:
                            self._tags.pop(handle, None)
                        if b.pending == 0 and b.ticket:
                            self._retire(b.ticket)  # landed: nothing left for the target
                        if b.pending == 0:
                            if b.status is Status.COMPLETED:
                                b.done.set()
                            else:
                                self._batches.pop(handle, None)
            finally:
                self._copies.task_done()

    def close(self) -> None:
        """Stop copying: the copy thread is joined, slices still due later are dropped, the
        mapping is closed. Idempotent."""
        if self._map.closed:
            return
        if self._thread.is_alive():
            self._copies.put(None)
            self._thread.join(timeout=5)
        del self._flag, self._arena, self._log, self._region
        self._map.close()
