"""NIXL as a transfer engine (``kvlifetime.adapters.transfer``): the target's arena served by a
NIXL agent (``NixlTarget``, with its fence) and the initiator (``NixlEngine``, WRITE and READ).

What NIXL's states and operations prove, and the UCX configuration the fence needs, are
``kvlifetime.adapters.nixl``; this module only moves bytes and reports raw states through
``nixl.status_of``. NIXL agents are not thread-safe in their default sync mode: ``NixlEngine``
makes every call on its agent under one lock (posts on the caller's thread, polls on its waiter
thread).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import secrets
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from kvlifetime.adapters.nixl import (
    FENCE_RECREATED,
    IN_PROGRESS,
    _api,
    configure_ucx,
    status_of,
    tcp_only,
)
from kvlifetime.adapters.sockets import fence_observable, listening_ports, wait_closed
from kvlifetime.adapters.transfer import Slice, Status
from kvlifetime.errors import FenceUnavailable

__all__ = ["NixlEngine", "NixlTarget"]

_FENCE_ATTEMPTS = 8  # agents started before one lands on ports this target never used
_POLL_S = 0.0005  # the waiter's pause between sweeps of the transfers in flight

_AGENT_LOCK = threading.Lock()  # agents start one at a time, so new ports are attributable


def _new_agent(name: str) -> tuple[Any, frozenset[int]]:
    """A NIXL agent with the UCX backend and its progress thread on, and the ports its UCX
    worker listens on (empty where unobservable or ambiguous)."""
    api = _api()
    with _AGENT_LOCK:
        observable = fence_observable()
        before = listening_ports() if observable else set()
        agent = api.nixl_agent(
            name, api.nixl_agent_config(enable_prog_thread=True, backends=["UCX"])
        )
        if "UCX" not in agent.backends:
            raise OSError("nixl: the UCX backend did not load")
        appeared = listening_ports() - before if observable else set()
    return agent, frozenset(appeared)


def _unique(prefix: str) -> str:
    return f"{prefix}-{os.getpid()}-{secrets.token_hex(4)}"


# =========================================================================== decode's side


class NixlTarget:
    """Decode's arena, registered (DRAM) with a NIXL agent whose UCX worker serves peers.

    ``fence()`` ends every peer's access for real by replacing the serving agent (over TCP
    only); the arena (a numpy array this object owns) outlives every agent that served it.
    """

    def __init__(
        self, nbytes: int, *, name: str = "kvlifetime-decode", tls: str | None = None
    ) -> None:
        self.transports = configure_ucx(tls)  # UCX_TLS=tcp unless told otherwise
        self._array = np.zeros(nbytes, dtype=np.uint8)
        self._ptr = int(self._array.ctypes.data)
        self.nbytes = nbytes
        self._prefix = _unique(name)
        self._incarnation = 0
        self._agent, self._ports, self._reg = self._serve(self._name())
        self._registered = True
        self._used_ports: set[int] = set(self._ports)
        self.fences = 0

    def _name(self) -> str:
        return f"{self._prefix}-{self._incarnation}"

    def _serve(self, name: str) -> tuple[Any, frozenset[int], Any]:
        agent, ports = _new_agent(name)
        reg = agent.register_memory([(self._ptr, self.nbytes, 0, "")], "DRAM")
        return agent, ports, reg

    @property
    def array(self) -> npt.NDArray[np.uint8]:
        return self._array

    @property
    def name(self) -> str:
        """The serving agent's name (it changes with every fence)."""
        return str(self._agent.name)

    @property
    def ports(self) -> frozenset[int]:
        """The ports the serving agent's UCX worker listens on; empty if unknown."""
        return self._ports

    def descriptor(self) -> dict[str, Any]:
        # The metadata carries the remote keys: taken after registration, fresh every time.
        return {
            "kind": "nixl",
            "agent": self.name,
            "metadata": bytes(self._agent.get_agent_metadata()),
            "base": self._ptr,
            "nbytes": self.nbytes,
            "ucx_tls": ",".join(sorted(self.transports)) or None,
        }

    def address(self, offset: int) -> int:
        return self._ptr + offset

    def notifications(self) -> dict[str, list[bytes]]:
        """Notifications received since the last call, by initiator agent name: each proves
        its transfer's data landed before it (a local observation)."""
        got = self._agent.get_new_notifs()
        return {str(k): [bytes(m) for m in v] for k, v in got.items()}

    def unregister(self) -> None:
        # Not revocation: a local unmap, no peer is told; writes in flight (and later ones
        # using the old metadata) still land.
        if self._registered:
            self._registered = False
            self._agent.deregister_memory(self._reg)

    def fence(self) -> str:
        """End every peer's access to the arena for real; return
        ``"nixl_target_agent_recreated"`` once that is observed.

        A new agent is started first (new name, on ports no agent of this target ever used)
        and the arena registered with it; then the serving agent is destroyed: its UCX
        engine's destructor stops and joins the progress thread - the only thread that reads
        the peers' bytes off the sockets into the arena over TCP - then destroys the UCX
        worker, closing its listeners and connections. The fence returns once no socket of
        this process is bound to the old agent's ports. Every peer is cut at once; those
        served afterwards need the new ``descriptor()``.

        Raises ``FenceUnavailable`` (nothing fenced, the old agent still serving, or fenced
        but unobserved) when UCX is not restricted to TCP (with CMA the initiator writes into
        the arena itself), when this platform cannot show the process's sockets, when the old
        agent's ports are unknown, or when its sockets stay open."""
        if not tcp_only(self.transports):
            raise FenceUnavailable(
                f"nixl: the target agent runs UCX with transports {sorted(self.transports)} "
                "(UCX_TLS); with shared memory (CMA) the initiator copies into the arena "
                "itself and destroying the target's agent stops nothing (measured). Only "
                "UCX_TLS=tcp has a target-side fence; nothing was fenced"
            )
        if not fence_observable():
            raise FenceUnavailable(
                "nixl: the fence is observed through /proc/self/net/tcp, which this platform "
                "lacks; nothing was fenced"
            )
        old_ports = self._ports
        if not old_ports:
            raise FenceUnavailable(
                "nixl: the serving agent's ports are unknown (other listeners opened while it "
                "started), so its end cannot be observed; nothing was fenced"
            )
        self._incarnation += 1
        new, new_ports, new_reg = self._fresh_agent()
        old, old_reg, was_registered = self._agent, self._reg, self._registered
        self._agent, self._ports, self._reg = new, new_ports, new_reg
        self._used_ports |= new_ports
        self._registered = True
        if was_registered:
            old.deregister_memory(old_reg)
        del old, old_reg  # the only references: the agent is destroyed here, synchronously
        wait_closed(old_ports, "nixl")
        self.fences += 1
        return FENCE_RECREATED

    def _fresh_agent(self) -> tuple[Any, frozenset[int], Any]:
        rejected: list[Any] = []  # never registered: a stale peer reaching one finds nothing
        try:
            for _ in range(_FENCE_ATTEMPTS):
                agent, ports = _new_agent(self._name())
                if ports and not ports & self._used_ports:
                    reg = agent.register_memory([(self._ptr, self.nbytes, 0, "")], "DRAM")
                    return agent, ports, reg
                rejected.append(agent)
                self._incarnation += 1
        finally:
            del rejected[:]
        raise OSError(
            f"nixl: {_FENCE_ATTEMPTS} agents started, none on observable ports this target "
            "never used; not fenced (the old agent still serves)"
        )

    def close(self) -> None:
        if getattr(self, "_agent", None) is None:
            return
        self.unregister()
        self._agent = None
        self._reg = None


# =========================================================================== prefill's side


class NixlEngine:
    """The initiator: each batch is one NIXL transfer between registered staging memory and a
    ``NixlTarget``: a WRITE into it (push: prefill writes decode's arena) or a READ out of it
    (pull, vLLM's NIXL path: decode reads prefill's source blocks); a waiter thread polls the
    transfers in flight until DONE or an exception."""

    def __init__(self, target: Mapping[str, Any], staging_bytes: int) -> None:
        tls = target.get("ucx_tls")
        configure_ucx(str(tls) if tls else None)
        self._agent, _ports = _new_agent(_unique("kvlifetime-prefill"))
        self._staging = np.zeros(staging_bytes, dtype=np.uint8)
        self._src = int(self._staging.ctypes.data)
        self._reg = self._agent.register_memory([(self._src, staging_bytes, 0, "")], "DRAM")
        self._lock = threading.Lock()  # every call on the agent (sync mode NONE)
        self._remote = self._agent.add_remote_agent(bytes(target["metadata"]))
        self._futures: dict[int, concurrent.futures.Future[Status]] = {}
        # handle -> (xfer handle, bytes, "WRITE" | "READ")
        self._inflight: dict[int, tuple[Any, int, str]] = {}
        self._failed: list[Any] = []  # xfer handles that raised: never released (no abort)
        self._next = 1
        self._wake = threading.Condition()
        self._stopping = False
        self._waiter = threading.Thread(target=self._poll_loop, name="nixl-status", daemon=True)
        self._waiter.start()
        self.bytes_written = 0
        self.bytes_read = 0

    @property
    def staging(self) -> npt.NDArray[np.uint8]:
        return self._staging

    def submit(self, slices: Sequence[Slice]) -> int:
        """Post one WRITE transfer (staging -> the target's memory)."""
        return self._post("WRITE", slices)

    def submit_read(self, slices: Sequence[Slice]) -> int:
        """Post one READ transfer (the target's memory -> staging): vLLM's NIXL path, where
        decode reads prefill's blocks. Exactly the WRITE's states: DONE (only) proves every
        byte is in staging and the source is read no more; a descriptor outside the remote
        registration is refused whole by ``initialize_xfer`` (FAILED, nothing read);
        an exception proves nothing about what was read."""
        return self._post("READ", slices)

    def _post(self, op: str, slices: Sequence[Slice]) -> int:
        fut: concurrent.futures.Future[Status] = concurrent.futures.Future()
        with self._wake:
            handle = self._next
            self._next += 1
            self._futures[handle] = fut
        nbytes = sum(s[2] for s in slices)
        with self._lock:
            try:
                local = self._agent.get_xfer_descs(
                    [(self._src + s[0], s[2], 0) for s in slices], "DRAM"
                )
                remote = self._agent.get_xfer_descs([(s[1], s[2], 0) for s in slices], "DRAM")
                # A descriptor outside the target's registration: refused here, nothing posted.
                xfer = self._agent.initialize_xfer(op, local, remote, self._remote)
            except Exception:
                fut.set_result(Status.FAILED)
                return handle
            try:
                state = self._agent.transfer(xfer)
            except Exception:
                self._failed.append(xfer)  # proves nothing: bytes may have been handed over
                fut.set_result(Status.FAILED)
                return handle
        if state == IN_PROGRESS:
            with self._wake:
                self._inflight[handle] = (xfer, nbytes, op)
                self._wake.notify()
        else:
            self._settle(fut, xfer, state, nbytes, op)
        return handle

    def _settle(
        self, fut: concurrent.futures.Future[Status], xfer: Any, state: str, nbytes: int, op: str
    ) -> None:
        status = status_of(state)
        if status is Status.COMPLETED:
            if op == "READ":
                self.bytes_read += nbytes
            else:
                self.bytes_written += nbytes
            with self._lock:
                self._agent.release_xfer_handle(xfer)  # done: releasing it is safe now
        else:
            self._failed.append(xfer)
        fut.set_result(status)

    def _poll_loop(self) -> None:
        while True:
            with self._wake:
                while not self._inflight and not self._stopping:
                    self._wake.wait()
                if self._stopping:
                    return
                batch = list(self._inflight.items())
            for handle, (xfer, nbytes, op) in batch:
                with self._lock:
                    try:
                        state = self._agent.check_xfer_state(xfer)
                    except Exception:
                        state = "ERR"  # nixlRemoteDisconnectError & co: proves nothing
                if state == IN_PROGRESS:
                    continue
                with self._wake:
                    self._inflight.pop(handle, None)
                    fut = self._futures.get(handle)
                if fut is not None:
                    self._settle(fut, xfer, state, nbytes, op)
            time.sleep(_POLL_S)

    def wait(self, handle: int, timeout: float) -> Status:
        with self._wake:
            fut = self._futures.get(handle)
        if fut is None:
            return Status.FAILED
        try:
            status = fut.result(timeout)
        except concurrent.futures.TimeoutError:
            return Status.FAILED  # proves nothing, as a FAILED does; the wait stays owed
        with self._wake:
            self._futures.pop(handle, None)
        return status

    def advance(self, tick: int) -> None:
        # Real time: UCX moves the bytes when it will.
        return None

    def close(self) -> None:
        """Stop the waiter, forget the peer, destroy the agent (which ends its transfers: the
        initiator's UCX worker goes with it). Idempotent."""
        if self._stopping:
            return
        with self._wake:
            self._stopping = True
            self._wake.notify_all()
        self._waiter.join(timeout=5)
        with self._lock:
            with contextlib.suppress(Exception):  # already gone (a disconnect)
                self._agent.remove_remote_agent(self._remote)
            self._inflight.clear()
            self._failed.clear()
            self._agent = None
