"""NIXL's transfer states, turned into evidence (the engine itself: ``adapters.nixl_engine``).

What each state and operation proves, for ``nixl`` 1.5.1 (PyPI, the lean install: ``pip
install --no-deps nixl==1.5.1 nixl-cu13==1.5.1``) with its UCX backend, DRAM segments, UCX over
TCP on loopback (``UCX_TLS=tcp``), is data: the table is ``PROFILE`` (a
``kvlifetime.profiles.EngineProfile``, at the end of this module); ``kvlifetime evidence
--engine nixl-ucx`` prints it and docs/engine-nixl-ucx.md is generated from it. Read in
ai-dynamo/nixl (``src/plugins/ucx/ucx_backend.cpp``, ``ucx_utils.cpp``,
``src/core/nixl_agent.cpp``, ``agent_data.h``); measured between two processes by
``tests/test_nixl_adapter.py`` and ``tests/test_nixl_fence.py`` (docs/fencing.md; the engine's
facts with their measurements: docs/engine-facts.md#nixl-over-ucx-dram). In short:

========================================  =====================================================
raw fact                                  evidence it yields
========================================  =====================================================
``check_xfer_state(h) == "DONE"`` (or     the transfer ENDED: every byte is in the target's
``transfer(h)`` returning ``"DONE"``)     memory and it touches memory no more (DONE needs
                                          every put and a flush, a remote completion). With
                                          every transfer 1..N done: ``TransferQuiesced``
                                          through N, or ``TransferCompleted(N)``.
a notification the target received       the data of that transfer landed before it (posted
(``get_new_notifs``)                      once the transfer succeeded) - a local observation
                                          of the memory owner. Its absence proves nothing.
``"PROC"``                                nothing: still in flight.
``release_xfer_handle(h)`` in flight      nothing: it returns at once and the transfer goes
                                          on, reading the source and writing the target.
target ``deregister_memory``              nothing (a local unmap; no peer is told): writes in
                                          flight land, later ones with the old metadata too.
                                          NOT ``AccessRevoked``.
an exception from ``transfer`` /          nothing (``Status.FAILED``): the connection failed;
``check_xfer_state``                      what was handed to the transport may or may not
(``nixlRemoteDisconnectError`` ...)       land. The grant stays open, the blocks quarantined.
``initialize_xfer`` raises (a descriptor  nothing (``Status.FAILED``): NIXL refused the whole
outside the remote registration)          request before posting it (no byte of it lands,
                                          measured), but the adapter claims no more than for
                                          any failure.
target agent destroyed, shared-memory     nothing: with CMA the initiator copies into the
transports allowed (``UCX_TLS`` unset)    target's memory itself (measured: GBs landed after
                                          the target's agent was gone).
``NixlTarget.fence()`` returned           ``AccessRevoked`` for every peer of the target: the
``"nixl_target_agent_recreated"``         serving agent (UCX over TCP only) was destroyed -
                                          its progress thread joined, its UCX worker and
                                          sockets closed, observed gone - and the arena
                                          registered with a new agent, new name, new ports.
initiator killed (and reaped)             nothing by itself (``PeerLost`` at most).
========================================  =====================================================

READ (the pull direction, vLLM's path: decode reads prefill's blocks) is the same table with
the roles of the memory turned round: DONE proves every byte read is in the initiator's memory
and the source is read no more; a notification the source's owner receives proves the read had
ended before it; releasing the handle of a read in flight proves nothing (the source goes on
being read, its later bytes reach the reader); the fence of the source's ``NixlTarget`` ends
every read (measured in ``tests/test_nixl_adapter.py``, the rows ``READ (pull): ...``).

Why the fence needs TCP: over TCP the bytes are copied into the arena by the *target's* UCX
worker (its progress thread reads the sockets), so ending that worker ends every write. With
the shared-memory transports (CMA, the default on one host) the *initiator's* process writes
into the target's memory itself; nothing the target does to its agent stops that.

``NixlTarget`` and ``NixlEngine`` (NIXL as a transfer engine: agents, registration, the fence)
are in ``kvlifetime.adapters.nixl_engine``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from kvlifetime.adapters.mooncake import GrantTransfers
from kvlifetime.adapters.transfer import Status
from kvlifetime.errors import UsageError
from kvlifetime.evidence import Claim
from kvlifetime.profiles import NOTHING, EngineProfile, StatusRow

__all__ = [
    "DONE",
    "FENCE_RECREATED",
    "PROFILE",
    "GrantTransfers",
    "UnsafeUcxTransport",
    "configure_ucx",
    "nixl_available",
    "status_of",
    "tcp_only",
    "xfer_ended",
]

DONE = "DONE"
IN_PROGRESS = "PROC"
TCP = "tcp"
FENCE_RECREATED = "nixl_target_agent_recreated"


class UnsafeUcxTransport(UsageError):
    """UCX set to transports no target-side fence can stop (shm, CMA).
    UCX is configured with transports through which the initiator writes into the target's
    memory itself (shared memory, CMA): no target-side operation could end its access, and
    transfers may complete inside ``transfer()``. Whose fault: the caller's configuration
    (``UCX_TLS``). Nothing was started."""

    kind = "unsafe_ucx_transport"


# =========================================================================== states -> evidence


def xfer_ended(state: str) -> bool:
    """Whether a raw ``check_xfer_state`` / ``transfer`` result proves the transfer landed and
    touches memory no more: only ``"DONE"``. ``"PROC"`` proves nothing; nor does ``"ERR"``
    (which the Python binding never returns in practice: errors are raised)."""
    return state == DONE


def status_of(state: str) -> Status:
    """The harness status for a raw NIXL state that ended the wait: COMPLETED for DONE,
    FAILED (which proves nothing) for anything else."""
    return Status.COMPLETED if xfer_ended(state) else Status.FAILED


# =========================================================================== UCX configuration


def ucx_transports(env: Mapping[str, str] | None = None) -> frozenset[str]:
    """The transports ``UCX_TLS`` allows (empty: unset, UCX picks every one it has)."""
    env = os.environ if env is None else env
    raw = env.get("UCX_TLS", "")
    return frozenset(t.strip().lower() for t in raw.split(",") if t.strip())


def tcp_only(transports: frozenset[str]) -> bool:
    """Whether only the TCP transport is allowed (the fence's precondition)."""
    return transports == frozenset({TCP})


def configure_ucx(tls: str | None = None) -> frozenset[str]:
    """Set this process's UCX transports before an agent is created: ``tls`` if given, else
    ``UCX_TLS=tcp`` unless the environment already says otherwise; NIXL's log quiet unless
    asked (``NIXL_LOG_LEVEL``). Returns the transports the next agent will use."""
    if tls is not None:
        os.environ["UCX_TLS"] = tls
    else:
        os.environ.setdefault("UCX_TLS", TCP)
    os.environ.setdefault("NIXL_LOG_LEVEL", "FATAL")
    return ucx_transports()


def require_tcp(env: Mapping[str, str] | None = None) -> None:
    """Refuse a UCX configuration other than TCP only (``UnsafeUcxTransport``)."""
    t = ucx_transports(env)
    if t and not tcp_only(t):
        raise UnsafeUcxTransport(
            f"UCX_TLS={','.join(sorted(t))}: NIXL runs here with UCX over TCP only "
            "(UCX_TLS=tcp). With shared-memory transports (CMA) the initiator writes into "
            "decode's memory itself, so no target-side fence exists; unset UCX_TLS or set tcp"
        )


def _api() -> Any:
    os.environ.setdefault("NIXL_LOG_LEVEL", "FATAL")
    from kvlifetime.extras import needs

    with needs("nixl", "the NIXL adapter (kvlifetime.adapters.nixl)"):
        import nixl._api

    return nixl._api


def nixl_available() -> bool:
    try:
        _api()
    except ImportError:
        return False
    return True


# ============================================================ what each state proves (data)

_ADAPTER = "tests/test_nixl_adapter.py"
_FENCE = "tests/test_nixl_fence.py"

PROFILE = EngineProfile(
    name="nixl-ucx",
    package="nixl (nixl-cu13, lean install: --no-deps)",
    version="1.5.1",
    transport="UCX over TCP (UCX_TLS=tcp), loopback, DRAM segments",
    source="read in ai-dynamo/nixl: src/plugins/ucx/ucx_backend.cpp, ucx_utils.cpp, "
    "src/core/nixl_agent.cpp, agent_data.h; measured between two processes on loopback "
    "(docs/fencing.md; tests/test_nixl_adapter.py, tests/test_nixl_fence.py)",
    rows=(
        StatusRow(
            '`check_xfer_state(h) == "DONE"` (or `transfer(h)` returning `"DONE"`)',
            "TransferQuiesced or TransferCompleted",
            {Claim.TRANSFERS_ENDED},
            "anything about the grant's other transfers: only with every transfer 1..N done "
            "does the adapter emit TransferQuiesced through N, or TransferCompleted(N) at the "
            "normal end; RDMA and VRAM visibility were not testable here",
            "code and measured",
            f"{_ADAPTER}::test_done_means_every_byte_landed",
            proves="every byte of the transfer is in the target's memory and the transfer "
            "touches memory no more (DONE needs every put and a flush, a remote completion)",
        ),
        StatusRow(
            "a notification received by the target (`get_new_notifs()`)",
            "TransferQuiesced or TransferCompleted",
            {Claim.TRANSFERS_ENDED},
            "anything when it never comes: over TCP the initiator sends it only when it polls "
            "its transfer, so a quiet initiator means a missing notification, not a missing "
            "transfer",
            "code and measured",
            f"{_ADAPTER}::test_a_notification_follows_the_data",
            proves="the data of that transfer landed before it (it is posted once the "
            "transfer's status is success) - observed by the memory owner itself",
        ),
        StatusRow(
            '`check_xfer_state(h) == "PROC"`',
            NOTHING,
            frozenset(),
            "anything but that the transfer may still be running",
            "code and measured",
            f"{_ADAPTER}::test_done_means_every_byte_landed",
        ),
        StatusRow(
            "`release_xfer_handle(h)` while in flight",
            NOTHING,
            frozenset(),
            "that the transfer stopped, that the source may be reused, or that the target "
            "will not be written: it returns at once and the transfer goes on, still reading "
            "the source (bytes written to the source after the release reach the target); "
            "its notification is never delivered",
            "code and measured",
            f"{_ADAPTER}::test_releasing_a_handle_in_flight_stops_nothing",
        ),
        StatusRow(
            'READ (pull): `check_xfer_state(h) == "DONE"`',
            "TransferQuiesced or TransferCompleted",
            {Claim.TRANSFERS_ENDED},
            "anything about the grant's other reads: as for a WRITE, only with every transfer "
            "1..N done does the reader emit TransferQuiesced through N or TransferCompleted(N)",
            "code and measured",
            f"{_ADAPTER}::test_read_done_means_every_byte_was_read",
            proves="every byte read is in the initiator's memory and the transfer reads the "
            "source no more (measured: the source rewritten after DONE changes nothing read)",
        ),
        StatusRow(
            "READ (pull): a notification received by the source's owner (`get_new_notifs()`; "
            "vLLM's prefill frees its blocks on it)",
            "TransferQuiesced or TransferCompleted",
            {Claim.TRANSFERS_ENDED},
            "anything when it never comes (sent when the reader polls its transfer); the "
            "harness relays DONE from the reader instead",
            "code and measured",
            f"{_ADAPTER}::test_a_read_notification_means_the_source_is_read_no_more",
            proves="the transfer had read every byte before it: the source rewritten at once "
            "after the notification changes nothing the reader got (measured, 64 MiB)",
        ),
        StatusRow(
            "READ (pull): `release_xfer_handle(h)` while in flight",
            NOTHING,
            frozenset(),
            "that the source is read no more: the read goes on after the release and "
            "completes, and bytes the owner writes into the source after the release reach "
            "the reader (measured); its notification is never delivered",
            "code and measured",
            f"{_ADAPTER}::test_releasing_a_read_in_flight_stops_nothing",
        ),
        StatusRow(
            "target `deregister_memory` (`NixlTarget.unregister()`)",
            NOTHING,
            frozenset(),
            "revocation: a purely local unmap, no peer is told; the write in flight lands in "
            "full and a later transfer with the old metadata lands too. It is NOT "
            "AccessRevoked",
            "code and measured",
            f"{_ADAPTER}::test_deregister_is_not_revocation",
        ),
        StatusRow(
            "an exception from `transfer()` / `check_xfer_state()` "
            "(`nixlRemoteDisconnectError` and others)",
            NOTHING,
            frozenset(),
            "that nothing more lands, or what had been handed to the transport: part of the "
            "transfer may be in the target's memory already (measured). Status.FAILED; the "
            "grant stays open, the blocks are quarantined",
            "code and measured",
            f"{_ADAPTER}::test_a_disconnect_error_proves_nothing_about_what_landed",
            proves="the connection to that peer failed",
        ),
        StatusRow(
            "`initialize_xfer` raises (a descriptor outside the target's registration: "
            "`nixlNotFoundError`)",
            NOTHING,
            frozenset(),
            "more than any failure: NIXL checks every descriptor before it posts anything "
            "(measured: no byte of the request's valid descriptors lands), but the harness "
            "reports FAILED and the adapter claims nothing from it",
            "code and measured",
            f"{_ADAPTER}::test_a_descriptor_outside_the_arena_fails_the_whole_request",
        ),
        StatusRow(
            "target agent destroyed while shared-memory transports are allowed "
            "(`UCX_TLS` unset: CMA)",
            NOTHING,
            frozenset(),
            "that the initiator's writes stopped: with CMA the initiator's process copies "
            "into the target's memory itself (measured: GBs landed after the agent was "
            "destroyed, and the initiator saw DONE). `NixlTarget.fence()` refuses",
            "code and measured",
            f"{_FENCE}::test_with_cma_destroying_the_target_agent_stops_nothing",
        ),
        StatusRow(
            f'`NixlTarget.fence()` returned `"{FENCE_RECREATED}"` (UCX over TCP only)',
            "AccessRevoked",
            {Claim.ACCESS_REVOKED},
            "anything about a peer handed the new `descriptor()` afterwards (it may write "
            "again, by design), nor about transports other than TCP; it cuts every peer of "
            "the agent at once, whichever grant it served",
            "code and measured",
            f"{_FENCE}::test_fence_ends_writes_in_flight_every_run",
            proves="no peer of the old agent can write into the arena any more: the serving "
            "agent was destroyed (its progress thread joined - over TCP the only thread that "
            "copies received bytes into the arena - its UCX worker, listeners and "
            "connections closed, observed gone) and the arena registered with a new agent, "
            "new name, new ports (measured: 0 bytes landed after it returned). In the pull "
            "direction the same fence of the source ends every READ: over TCP that progress "
            "thread sends the bytes read (measured: nothing written into the source after it "
            f"returned reached the reader, {_ADAPTER}::test_the_fence_ends_reads_in_flight)",
        ),
        StatusRow(
            "initiator process killed (and reaped)",
            "PeerLost",
            {Claim.HEARTBEAT_FAILED},
            "that its writes stopped: over TCP the target's progress thread applies what it "
            "has received (measured: up to 9 MB landed after SIGKILL, before the reap; none "
            "after the reap in 8 runs, which no code guarantees); only the fence ends it",
            "code and measured",
            f"{_FENCE}::test_fence_after_the_initiator_was_killed",
        ),
    ),
    fence=FENCE_RECREATED,
    fence_note="`NixlTarget.fence()`, with UCX over TCP only: a new agent (new name) serves "
    "the arena on ports no agent of this target ever used; the old agent is destroyed (its "
    "UCX engine joins the progress thread, then destroys the worker, closing its listeners "
    "and connections) and observed gone (no socket of this process left on its ports). About "
    "0.1 s; it cuts every peer of the agent. It raises FenceUnavailable (nothing fenced) "
    "where UCX may use shared memory (CMA: the initiator writes itself) or where the end "
    "cannot be observed. `deregister_memory`, `release_xfer_handle` and "
    "`remove_remote_agent` are not fences. See docs/fencing.md.",
    peer_word="In the harness, DONE is read by the initiator's agent, in prefill, and relayed "
    "over the wire: cancel_received, scheduling_stopped and transfers_ended "
    "(SchedulingStopped, TransferQuiesced, TransferCompleted) rest on the peer's word. A "
    "notification is the one local observation of landing decode could use instead "
    "(`NixlTarget.notifications()`); the harness does not yet. access_revoked never rests on "
    "the peer: only decode's own fence makes it.",
    notes=(
        "Over TCP (UCX_TLS=tcp) transfers are asynchronous: transfer() returns PROC within "
        "milliseconds and the target's progress thread writes the arena. With CMA (the "
        "default on one host) transfer() may copy everything synchronously.",
        "There is no abort of an in-flight transfer (ai-dynamo/nixl#2067); both the source "
        "blocks (read) and the destination blocks (written) stay held until DONE.",
    ),
)
"""What every NIXL (UCX over TCP) state and operation proves (``kvlifetime evidence --engine
nixl-ucx``). Importable without NIXL installed."""
