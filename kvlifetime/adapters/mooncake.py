"""Mooncake's transfer statuses, turned into evidence; and Mooncake as a harness transfer engine.

What each status and operation proves, for ``mooncake-transfer-engine-non-cuda`` 0.3.13.post1
on the TCP transport, is data: the table is ``PROFILE`` (a ``kvlifetime.profiles.EngineProfile``,
at the end of this module); ``kvlifetime evidence --engine mooncake-tcp`` prints it and
docs/engine-mooncake-tcp.md is generated from it. Each row names the test that pins it, and
``tests/test_mooncake_adapter.py`` checks the status rows against ``batch_ended`` and
``GrantTransfers``. In short: only COMPLETED on protocol v2, for every batch of the grant,
proves the end of access; FAILED, ``unregister_memory`` and a dead initiator prove nothing
about memory; ``MooncakeTarget.fence()`` is the fence (docs/fencing.md). The engine's facts
behind each row, with their measurements:
docs/engine-facts.md#mooncake-transfer-engine-tcp-transport.

``get_batch_transfer_status`` blocks (until every batch completed, the first failure, or
``MC_TRANSFER_TIMEOUT``), and it frees the batch ids it reports on: call it exactly once per
batch, and never on a scheduler thread (``MooncakeEngine`` calls it on its own thread).
"""

from __future__ import annotations

import concurrent.futures
import os
import threading
from collections.abc import Mapping, Sequence
from typing import Any

import attrs
import numpy as np
import numpy.typing as npt

from kvlifetime.adapters.sockets import fence_observable, listening_ports, wait_closed
from kvlifetime.adapters.transfer import Slice, Status
from kvlifetime.errors import FenceUnavailable, UsageError
from kvlifetime.evidence import (
    Claim,
    Evidence,
    SchedulingStopped,
    TransferCompleted,
    TransferQuiesced,
)
from kvlifetime.grant import GrantId, PeerId, RequestKey
from kvlifetime.profiles import NOTHING, EngineProfile, StatusRow

LOOPBACK = "127.0.0.1"
METADATA = "P2PHANDSHAKE"
# batch_transfer_async_write returns 0 when submitTransfer fails, and -1 (as an unsigned
# 64-bit batch id) when the target segment cannot be opened: nothing to wait for.
_REFUSED_BATCH_IDS = frozenset({0, -1, (1 << 64) - 1})


class UnsafeTransport(UsageError):
    """An engine set up so its statuses prove nothing (Mooncake TCP v1).
    The transfer engine is configured so that its statuses cannot prove anything (Mooncake TCP
    protocol v1: COMPLETED before the bytes reach the target). Whose fault: the caller's
    configuration. Nothing was started."""

    kind = "unsafe_transport"


def tcp_protocol(env: Mapping[str, str] | None = None) -> int:
    """The Mooncake TCP protocol version the engine will speak (``MC_TCP_PROTO``; v2 default)."""
    env = os.environ if env is None else env
    return 1 if env.get("MC_TCP_PROTO", "").strip() == "1" else 2


def require_protocol_v2(env: Mapping[str, str] | None = None) -> None:
    if tcp_protocol(env) != 2:
        raise UnsafeTransport(
            "MC_TCP_PROTO=1: Mooncake's TCP protocol v1 reports COMPLETED when the bytes enter "
            "the sender's socket buffer, so no status would prove a transfer ended; unset it"
        )


def batch_ended(status: int, protocol: int = 2) -> bool:
    """Whether a raw ``get_batch_transfer_status`` result proves the batch will write no more.

    True only for 0 (COMPLETED) on protocol v2. -1 (FAILED / timeout) proves nothing; nor does
    any status on protocol v1."""
    return protocol == 2 and status == Status.COMPLETED


# =========================================================================== statuses -> evidence


@attrs.define(slots=True)
class GrantTransfers:
    """The transfers one peer posted for one grant, and the evidence their statuses add up to.

    Sans-IO: the caller numbers transfers with ``post``, reports each batch's raw status with
    ``on_status``, and says when it stops scheduling (``stop``: cancelled, rejected, failed) or
    has posted everything (``finish``). Each call returns the evidence that became true; the
    evidence already emitted is kept in ``sent`` so it can be sent again when lost.
    """

    grant_id: GrantId
    request: RequestKey
    peer: PeerId
    protocol: int = 2  # Mooncake TCP protocol; on v1 no status proves anything
    posted: int = 0  # transfers numbered 1..posted were handed to the engine
    ended_prefix: int = 0  # transfers 1..ended_prefix all proved ended (COMPLETED on v2)
    last_seq: int | None = None  # set once scheduling stopped (or everything was posted)
    normal: bool = False  # the normal end (every transfer the grant needed was posted)
    failed: bool = False  # some transfer reported FAILED: its bytes are unaccounted for
    sent: list[Evidence] = attrs.field(factory=list)
    _ended: set[int] = attrs.field(factory=set)

    def post(self) -> int:
        """Number the next transfer (from 1). Refused once scheduling stopped."""
        if self.last_seq is not None:
            raise UsageError(f"grant {self.grant_id}: scheduling stopped at {self.last_seq}")
        self.posted += 1
        return self.posted

    def on_status(self, seq: int, status: int) -> list[Evidence]:
        if not 1 <= seq <= self.posted:
            raise UsageError(f"grant {self.grant_id}: status for unposted transfer {seq}")
        if batch_ended(status, self.protocol):
            self._ended.add(seq)
            while self.ended_prefix + 1 in self._ended:
                self.ended_prefix += 1
                self._ended.discard(self.ended_prefix)
        else:
            self.failed = True
        return self._conclude()

    def stop(self) -> list[Evidence]:
        """Scheduling stopped early: nothing after the transfers already posted."""
        if self.last_seq is not None:
            return []
        self.last_seq = self.posted
        ev: Evidence = SchedulingStopped(self.grant_id, self.request, self.peer, self.posted)
        self.sent.append(ev)
        return [ev, *self._conclude()]

    def finish(self) -> list[Evidence]:
        """Everything the grant needed was posted: the normal end, once all of it ended."""
        if self.last_seq is not None:
            return []
        self.last_seq = self.posted
        self.normal = True
        return self._conclude()

    @property
    def concluded(self) -> bool:
        """Whether the grant's final evidence was emitted (or can never be: a failure)."""
        return self.last_seq is not None and (self.ended_prefix >= self.last_seq or self.failed)

    def _conclude(self) -> list[Evidence]:
        last = self.last_seq
        if last is None or self.ended_prefix < last or self._has_final():
            return []
        ev: Evidence
        if self.normal:
            ev = TransferCompleted(self.grant_id, self.request, self.peer, last)
        else:
            ev = TransferQuiesced(self.grant_id, self.request, self.peer, last)
        self.sent.append(ev)
        return [ev]

    def _has_final(self) -> bool:
        return any(isinstance(e, TransferCompleted | TransferQuiesced) for e in self.sent)


# =========================================================================== the real engine


def _engine_module() -> Any:
    # Mooncake logs every completed batch at INFO; keep its log to errors unless asked.
    os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
    from kvlifetime.extras import needs

    with needs("mooncake", "the Mooncake adapter (kvlifetime.adapters.mooncake)"):
        import mooncake.engine

    return mooncake.engine


def mooncake_available() -> bool:
    try:
        _engine_module()
    except ImportError:
        return False
    return True


def _new_engine() -> Any:
    return _new_engine_with_ports()[0]


# ---------------------------------------------------------------- the engine's ports
#
# A fence must be *observed* complete (``adapters.sockets``): the target's engine is gone once
# no socket of this process is bound to its ports any more. Mooncake's Python binding names the
# handshake (rpc) port only; the data port is found as the other listening port that appeared
# while the engine started.

_ENGINE_LOCK = threading.Lock()  # engines start one at a time, so new ports are attributable


def _new_engine_with_ports() -> tuple[Any, frozenset[int]]:
    """A started engine and the ports it listens on (rpc and data; empty where unobservable,
    or when other listeners appeared at the same time and the data port is ambiguous)."""
    require_protocol_v2()
    module = _engine_module()
    with _ENGINE_LOCK:
        observable = fence_observable()
        before = listening_ports() if observable else set()
        te = module.TransferEngine()
        rc = te.initialize(LOOPBACK, METADATA, "tcp", "")
        if rc != 0:
            raise OSError(f"mooncake TransferEngine.initialize returned {rc}")
        appeared = listening_ports() - before if observable else set()
    rpc = int(te.get_rpc_port())
    ports = frozenset(appeared) if rpc in appeared and len(appeared) == 2 else frozenset()
    return te, ports


FENCE_RECREATED = "mooncake_target_recreated"
_FENCE_ATTEMPTS = 8  # engines started before one lands on ports this target never used


class MooncakeTarget:
    """Decode's arena, registered with a Mooncake engine listening on loopback.

    ``fence()`` ends every peer's access for real by replacing the serving engine; the arena
    (a numpy array this object owns) outlives every engine that served it.
    """

    def __init__(self, nbytes: int) -> None:
        self._array = np.zeros(nbytes, dtype=np.uint8)
        self._ptr = int(self._array.ctypes.data)
        self.nbytes = nbytes
        self._engine, self._ports = self._serve()
        self._registered = True
        # Every port an engine of this target ever listened on: a later engine never reuses
        # one, so a peer holding an old endpoint (or still retrying it) cannot come back.
        self._used_ports: set[int] = set(self._ports)
        self.fences = 0

    def _serve(self) -> tuple[Any, frozenset[int]]:
        te, ports = _new_engine_with_ports()
        rc = te.register_memory(self._ptr, self.nbytes)
        if rc != 0:
            raise OSError(f"mooncake register_memory returned {rc}")
        return te, ports

    @property
    def array(self) -> npt.NDArray[np.uint8]:
        return self._array

    @property
    def ports(self) -> frozenset[int]:
        """The ports the serving engine listens on (handshake and data); empty if unknown."""
        return self._ports

    def descriptor(self) -> dict[str, Any]:
        return {
            "kind": "mooncake",
            "target": f"{LOOPBACK}:{self._engine.get_rpc_port()}",
            "base": self._ptr,
            "nbytes": self.nbytes,
        }

    def address(self, offset: int) -> int:
        return self._ptr + offset

    def unregister(self) -> None:
        # Not revocation on TCP: writes already past the header check still land.
        if self._registered:
            self._registered = False
            self._engine.unregister_memory(self._ptr)

    def fence(self) -> str:
        """End every peer's access to the arena for real; return ``"mooncake_target_recreated"``
        once that is observed.

        A new engine is started first (on ports no engine of this target ever used) and the
        arena registered with it; then the serving engine is destroyed: its C++ destructor
        stops the transport's io_context and joins the one thread that copies received bytes
        into memory, then frees the accepted sessions (closing their sockets) and stops the
        handshake listener. The fence returns once no socket of this process is bound to the
        old engine's ports. Every peer of the old engine is cut at once, whichever grant it
        served; ``descriptor()`` names the new endpoint, for peers served afterwards.

        Costs about 1 s (the handshake listener's accept timeout). Raises ``FenceUnavailable``
        (nothing fenced, the old engine still serving, or fenced but unobserved) when this
        platform cannot show the process's sockets, when the old engine's ports are unknown, or
        when its sockets stay open (something else still holds the engine object)."""
        if not fence_observable():
            raise FenceUnavailable(
                "mooncake TCP: the fence is observed through /proc/self/net/tcp, which this "
                "platform lacks; nothing was fenced"
            )
        old_ports = self._ports
        if not old_ports:
            raise FenceUnavailable(
                "mooncake TCP: the serving engine's ports are unknown (other listeners opened "
                "while it started), so its end cannot be observed; nothing was fenced"
            )
        new, new_ports = self._fresh_engine()
        old, was_registered = self._engine, self._registered
        self._engine, self._ports = new, new_ports
        self._used_ports |= new_ports
        self._registered = True
        if was_registered:
            # Refuse new requests at once while the engine goes; the destructor does the rest.
            old.unregister_memory(self._ptr)
        del old  # the only reference: the engine is destroyed here, synchronously
        wait_closed(old_ports, "mooncake TCP")
        self.fences += 1
        return FENCE_RECREATED

    def _fresh_engine(self) -> tuple[Any, frozenset[int]]:
        """An engine serving the arena on ports this target never used. The old engine is still
        up meanwhile, so its own ports are taken; rejected engines (the arena never registered
        with them) are kept until one fits, so the next try cannot land on theirs either."""
        rejected: list[Any] = []  # never registered: a stale peer reaching one finds nothing
        try:
            for _ in range(_FENCE_ATTEMPTS):
                try:
                    te, ports = _new_engine_with_ports()
                except OSError as e:
                    raise OSError(f"{e}; the old engine still serves: not fenced") from e
                if ports and not ports & self._used_ports:
                    rc = te.register_memory(self._ptr, self.nbytes)
                    if rc != 0:
                        raise OSError(f"mooncake register_memory returned {rc}; not fenced")
                    return te, ports
                rejected.append(te)
        finally:
            del rejected[:]  # destroyed here (each costs about 1 s)
        raise OSError(
            f"mooncake: {_FENCE_ATTEMPTS} engines started, none on observable ports this "
            "target never used (MC_MIN_RPC_PORT / MC_MAX_RPC_PORT too narrow?); not fenced"
        )

    def close(self) -> None:
        self.unregister()


class MooncakeEngine:
    """Prefill's side: batched asynchronous writes over Mooncake TCP into a ``MooncakeTarget``.

    Statuses are read on one waiter thread, once per batch (the call blocks and frees the
    batch id), so the scheduler never blocks inside Mooncake.
    """

    def __init__(self, target: Mapping[str, Any], staging_bytes: int) -> None:
        self._engine = _new_engine()
        self._target = str(target["target"])
        self._staging = np.zeros(staging_bytes, dtype=np.uint8)
        self._src = int(self._staging.ctypes.data)
        rc = self._engine.register_memory(self._src, staging_bytes)
        if rc != 0:
            raise OSError(f"mooncake register_memory returned {rc}")
        self._waiter = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="mc-status")
        self._futures: dict[int, concurrent.futures.Future[int]] = {}
        self._next = 1
        self._lock = threading.Lock()
        self.bytes_written = 0

    @property
    def staging(self) -> npt.NDArray[np.uint8]:
        return self._staging

    def submit(self, slices: Sequence[Slice]) -> int:
        """Post one batch of WRITEs (staging -> the target's memory)."""
        return self._post(self._engine.batch_transfer_async_write, slices)

    def submit_read(self, slices: Sequence[Slice]) -> int:
        """Post one batch of READs (the target's memory -> staging) with
        ``batch_transfer_async_read``: the target checks each slice's range when it reads the
        request (outside its registered memory: refused, the batch FAILs), then sends the
        bytes; statuses are read on the waiter thread exactly as for writes."""
        return self._post(self._engine.batch_transfer_async_read, slices)

    def _post(self, transfer: Any, slices: Sequence[Slice]) -> int:
        bid = transfer(
            self._target,
            [self._src + s[0] for s in slices],
            [s[1] for s in slices],
            [s[2] for s in slices],
        )
        with self._lock:
            handle = self._next
            self._next += 1
        fut: concurrent.futures.Future[int]
        if bid is None or int(bid) in _REFUSED_BATCH_IDS:
            fut = concurrent.futures.Future()
            fut.set_result(int(Status.FAILED))
        else:
            nbytes = sum(s[2] for s in slices)
            fut = self._waiter.submit(self._status, int(bid), nbytes)
        self._futures[handle] = fut
        return handle

    def _status(self, bid: int, nbytes: int) -> int:
        rc = int(self._engine.get_batch_transfer_status([bid]))
        if rc == Status.COMPLETED:
            self.bytes_written += nbytes
        return rc

    def wait(self, handle: int, timeout: float) -> Status:
        fut = self._futures.get(handle)
        if fut is None:
            return Status.FAILED
        try:
            rc = fut.result(timeout)
        except concurrent.futures.TimeoutError:
            return Status.FAILED  # proves nothing, as a FAILED does; the wait stays owed
        del self._futures[handle]
        return Status.COMPLETED if rc == Status.COMPLETED else Status.FAILED

    def advance(self, tick: int) -> None:
        # Real time: Mooncake moves the bytes when it will.
        return None

    def close(self) -> None:
        self._waiter.shutdown(wait=True, cancel_futures=True)
        self._engine.unregister_memory(self._src)


# ============================================================ what each status proves (data)

_ADAPTER = "tests/test_mooncake_adapter.py"
_FENCE = "tests/test_mooncake_fence.py"

PROFILE = EngineProfile(
    name="mooncake-tcp",
    package="mooncake-transfer-engine-non-cuda",
    version="0.3.13.post1",
    transport="TCP (protocol v2), loopback",
    source="read in kvcache-ai/Mooncake: mooncake-integration/transfer_engine/"
    "transfer_engine_py.cpp and transport/tcp_transport; measured on loopback "
    "(docs/fencing.md)",
    rows=(
        StatusRow(
            "`get_batch_transfer_status == 0` (COMPLETED, protocol v2)",
            "TransferQuiesced or TransferCompleted",
            {Claim.TRANSFERS_ENDED},
            "anything about the grant's other batches: only with every batch 1..N completed "
            "does the adapter emit TransferQuiesced through N, or TransferCompleted(N) at the "
            "normal end; on its own a batch never closes a grant",
            "code and measured",
            f"{_ADAPTER}::test_real_engine_completed_means_landed",
            proves="the batch ENDED: the target wrote every byte and answered OK; no slice of "
            "it writes again",
        ),
        StatusRow(
            "`get_batch_transfer_status == 0` on protocol v1 (`MC_TCP_PROTO=1`)",
            NOTHING,
            frozenset(),
            "that the bytes reached the target: they only entered the initiator's socket "
            'buffer (measured by hand: "success" with 0 bytes written). The harness refuses '
            "to run on v1 (UnsafeTransport)",
            "code and measured",
            f"{_ADAPTER}::test_protocol_v1_completed_proves_nothing",
        ),
        StatusRow(
            "`get_batch_transfer_status == -1` (FAILED, or `MC_TRANSFER_TIMEOUT`)",
            NOTHING,
            frozenset(),
            "that the batch stopped: the wait returns at the FIRST failed task while the "
            "batch's other slices keep running, and a failed slice may still be copied from "
            "the target's receive buffer (measured: a FAILED batch's good slice lands after "
            "the status). The TCP transport never resubmits a slice, but nothing says the "
            "bytes stopped: the grant stays open, the blocks are quarantined",
            "code and measured",
            f"{_ADAPTER}::test_real_engine_completed_means_landed",
        ),
        StatusRow(
            "`transfer_check_status` (1 / 0 / -1 / -2)",
            NOTHING,
            frozenset(),
            "anything about the batch: it looks at task 0 only. The adapter never calls it",
            "code",
            "tests/test_profiles.py::test_mooncake_adapter_never_calls_transfer_check_status",
        ),
        StatusRow(
            "submit refused (`batch_transfer_async_write` returns batch id 0 or -1)",
            NOTHING,
            frozenset(),
            "whether a part of the batch was handed to the transport: it is not reported. "
            "Treated as FAILED",
            "code",
            f"{_ADAPTER}::test_profile_rows_match_the_adapter",
        ),
        StatusRow(
            "`unregister_memory` on TCP",
            NOTHING,
            frozenset(),
            "that access ended: the range is checked once per request, when the target reads "
            "its header; writes past that point keep landing (measured: ~27.6 MiB after it "
            "returned). It is NOT AccessRevoked",
            "code and measured",
            f"{_FENCE}::test_unregister_is_not_a_fence_the_measurement_sees_late_bytes",
        ),
        StatusRow(
            f'`MooncakeTarget.fence()` returned `"{FENCE_RECREATED}"`',
            "AccessRevoked",
            {Claim.ACCESS_REVOKED},
            "anything about a peer handed the new `descriptor()` afterwards (it may write "
            "again, by design), nor about another process that later binds an old port; it "
            "cuts every peer of the engine at once, whichever grant it served",
            "code and measured",
            f"{_FENCE}::test_fence_ends_writes_in_flight_every_run",
            proves="no peer of the old engine can write into the arena any more: the serving "
            "engine was destroyed (its io thread joined, its sessions and listeners closed, "
            "observed gone) and the arena re-registered on a new engine, on new ports "
            "(measured: 0 bytes landed after it returned, with a write in flight)",
        ),
        StatusRow(
            "initiator process killed, or its heartbeat failed",
            "PeerLost",
            {Claim.HEARTBEAT_FAILED},
            "that its writes stopped: the target applies what it had received (measured by "
            "hand: 13.7-18.1 MB landed after SIGKILL, up to 1.9 MB after the process was "
            "reaped); only the fence ends that",
            "code and measured",
            f"{_FENCE}::test_fence_after_the_initiator_was_killed",
        ),
    ),
    fence=FENCE_RECREATED,
    fence_note="`MooncakeTarget.fence()`: a new engine serves the arena on ports no engine of "
    "this target ever used; the old engine is destroyed (its C++ destructor joins the io "
    "thread and closes the sessions and listeners) and observed gone (no socket of this "
    "process left on its ports). About 1 s; it cuts every peer of the engine. It raises "
    "FenceUnavailable (nothing fenced) where it cannot be observed. `unregister_memory` is "
    "not a fence. See docs/fencing.md.",
    peer_word="Statuses are read by the initiator's engine, in prefill, and relayed over the "
    "wire: cancel_received, scheduling_stopped and transfers_ended (SchedulingStopped, "
    "TransferQuiesced, TransferCompleted) rest on the peer's word; nothing on decode's side "
    "observes completion. access_revoked never does: only decode's own fence makes it.",
    notes=(
        "A FAILED slice on the TCP transport is final in one narrow sense only - it is never "
        "retried - and that is not enough to free memory: the batch's other slices, and the "
        "failed slice's bytes already received, may land after the status was read. The only "
        "statuses that prove the end of access are COMPLETED statuses on protocol v2, for "
        "every batch of the grant.",
    ),
)
"""What every Mooncake TCP status and operation proves (``kvlifetime evidence --engine
mooncake-tcp``). Importable without Mooncake installed."""
