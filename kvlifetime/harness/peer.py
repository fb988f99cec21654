"""A peer process in lock-step with the memory owner, both ends of it.

The owner's side (``PeerProcess``): one process per peer incarnation and a ZeroMQ socket
dedicated to it, so that the socket *is* the peer's identity (evidence coming in on it is
stamped ``Source.peer(name)``, whatever it says inside); every exit path reaps the process;
``fence_peer`` ends its access to the owner's memory for real. The peer's side (``serve``):
the process loop around a worker, the same for a prefill writer (push) and a decode reader
(pull): ticks, a deliberate crash, a clean stop, and an orphan that exits on its own.
"""

from __future__ import annotations

import multiprocessing
import os
import sys
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from kvlifetime.adapters.inproc import InprocTarget
from kvlifetime.adapters.transfer import TargetMemory
from kvlifetime.errors import EnvironmentFault
from kvlifetime.harness.faults import crash_tick
from kvlifetime.harness.wire import (
    MalformedMessage,
    Message,
    Stats,
    Stop,
    Tick,
    TickDone,
    decode,
    encode,
)

if TYPE_CHECKING:
    from kvlifetime.adapters.transfer import ReadEngine
    from kvlifetime.harness.settings import RunSettings

CRASH_EXIT = 70  # exit status of a deliberate crash


class PeerFailed(EnvironmentFault):
    """A peer process could not be started or answered nothing.
    Whose fault: the environment (engine missing, process killed). The run stopped; every
    process was reaped."""

    kind = "peer_failed"


def peer_config(
    cfg: RunSettings, memory: TargetMemory, incarnation: int, *, crashed: int, start: int
) -> dict[str, Any]:
    """The configuration every peer process takes (plain data: it crosses a spawn): ``memory``
    is the owner's, which the peer reaches through its descriptor."""
    expected = cfg.expected_ticks
    return {
        "seed": cfg.seed,
        "faults": cfg.faults.to_dict(),
        "block_bytes": cfg.block_bytes,
        "staging_bytes": cfg.staging_blocks * cfg.block_bytes,
        "crash_tick": crash_tick(cfg.seed, crashed, expected, cfg.faults, start),
        "link_salt": 1000 + incarnation,
        "memory": memory.descriptor(),
    }


def _start_with_sigint_blocked(proc: Any) -> None:
    """Start ``proc`` (a spawn ``Process``) with SIGINT blocked in it from its first
    instruction: a Ctrl-C reaches the whole process group, and a peer still importing would
    print a traceback; once it serves it ignores SIGINT (``serve``), and its owner stops it.
    The signal mask is inherited across the spawn. SIGINT is blocked in this thread only while
    the child starts, so a Ctrl-C that comes meanwhile is delivered here right after."""
    import signal
    from multiprocessing import resource_tracker

    # Starting the resource tracker unblocks SIGINT in this thread: have it started first.
    resource_tracker.ensure_running()
    before = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        proc.start()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, before)


class PeerProcess:
    """One peer process and the socket dedicated to it. Every exit path reaps the process."""

    # its hand-over region in the in-process target's table (``land_after_crash``), if any
    region: int | None = None

    def __init__(
        self,
        ctx: Any,
        name: str,
        incarnation: int,
        main: Callable[[dict[str, Any]], None],
        config: dict[str, Any],
    ) -> None:
        import zmq

        self.peer = name
        self.incarnation = incarnation
        self.stats: dict[str, int] = {}
        self.sock = ctx.socket(zmq.DEALER)
        self.proc: Any = None  # a spawn Process once made
        try:  # whatever stops the start (a Ctrl-C included) closes what was started
            self.sock.setsockopt(zmq.LINGER, 0)
            self.sock.bind("tcp://127.0.0.1:*")
            endpoint = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)
            full = {**config, "endpoint": endpoint, "peer": name, "parent_pid": os.getpid()}
            mp = multiprocessing.get_context("spawn")
            self.proc = mp.Process(target=main, args=(full,), name=name, daemon=True)
            _start_with_sigint_blocked(self.proc)
            frames = self.until_tick_done(-1, 120.0)
        except BaseException:
            self.close()
            raise
        if frames is None:
            self.close()
            raise PeerFailed(f"{self.peer} did not start (exit code {self.proc.exitcode})")

    def send(self, frame: bytes) -> None:
        self.sock.send(frame)

    def until_tick_done(self, n: int, timeout_s: float) -> list[bytes] | None:
        """Frames up to ``TickDone(n)``; None when the peer died or hung (it is then reaped)."""
        out: list[bytes] = []
        deadline = time.monotonic() + timeout_s
        while True:
            if self.sock.poll(100):
                frame = self.sock.recv()
                try:
                    msg = decode(frame, sender=self.peer)
                except MalformedMessage:
                    out.append(frame)  # refused (and counted) by the caller
                    continue
                if isinstance(msg, TickDone) and msg.n == n:
                    return out
                out.append(frame)
                continue
            if not self.proc.is_alive() or time.monotonic() > deadline:
                self.kill()
                return None

    def stop(self) -> None:
        """Ask for the counters and a clean exit; force it if it does not come."""
        try:
            if self.proc.is_alive():
                self.sock.send(encode(Stop()))
                end = time.monotonic() + 10
                while time.monotonic() < end and self.sock.poll(100):
                    try:
                        msg = decode(self.sock.recv(), sender=self.peer)
                    except MalformedMessage:
                        continue
                    if isinstance(msg, Stats):
                        self.stats = dict(msg.counters)
                        break
                self.proc.join(10)
        finally:
            self.close()

    def kill(self) -> None:
        if self.proc is None or self.proc.pid is None:  # never started
            return
        if self.proc.is_alive():
            self.proc.terminate()
            self.proc.join(5)
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join(5)

    def close(self) -> None:
        self.kill()
        self.sock.close(0)

    def reaped(self) -> bool:
        """Whether the process is gone and its exit status collected (no thread of it runs)."""
        return not self.proc.is_alive() and self.proc.exitcode is not None


def fence_peer(peer: PeerProcess, target: TargetMemory) -> str:
    """End ``peer``'s access to the owner's memory for real; return the fence's name once its
    completion is observed. Raises ``PeerFailed`` if it cannot be.

    - in-process engine: the copies (writes or reads) run on a thread of the peer's process,
      which mapped the arena itself, so reaping that process (kill, then wait for its exit
      status) ends every copy it could still make;
    - Mooncake TCP, NIXL over UCX/TCP: the peer is reaped too, but the owner's serving side may
      still apply what it had received, so it is re-created (``target.fence()``: the old one's
      sessions closed and threads joined, observed; the memory served on a new endpoint).
    """
    peer.close()
    if not peer.reaped():
        raise PeerFailed(f"{peer.peer} could not be reaped: no fence")
    if isinstance(target, InprocTarget):
        return "inproc_initiator_reaped"
    return target.fence()


class PeerGroup:
    """One incarnation of the peer: its rank processes (tensor parallel; one in most runs),
    each with its own socket (its identity: evidence from rank r is stamped with rank r's name)
    and its own grant per request. Ticks go to the ranks one after the other (each rank's copies
    have ended when its ``TickDone`` comes), so the landing order stays the seed's and the
    landing log has one writer at a time. The ranks crash together (a group dies with any
    rank)."""

    def __init__(self, incarnation: int, ranks: int, start: Callable[[int], PeerProcess]) -> None:
        """Start ``ranks`` processes, ``start(rank)`` each; whatever stops that closes them."""
        self.incarnation = incarnation
        self.ranks: list[PeerProcess] = []
        try:
            for rank in range(ranks):
                self.ranks.append(start(rank))
        except BaseException:
            self.close()
            raise

    @property
    def peers(self) -> list[str]:
        return [p.peer for p in self.ranks]

    def tick(
        self, n: int, frames: Sequence[list[bytes]], timeout_s: float
    ) -> list[tuple[str, list[bytes]]] | None:
        """Send each rank its frames (ending with ``Tick(n)``) and collect its answer; None
        when any rank died or hung (every rank is then reaped)."""
        out: list[tuple[str, list[bytes]]] = []
        dead = False
        for p, fs in zip(self.ranks, frames, strict=True):
            for f in fs:
                p.send(f)
            got = p.until_tick_done(n, timeout_s)
            if got is None:
                dead = True
            else:
                out.append((p.peer, got))
        if dead:
            self.close()
            return None
        return out

    def stop(self) -> dict[str, int]:
        """Every rank's counters, summed, once each has exited (or been made to)."""
        stats: dict[str, int] = {}
        for p in self.ranks:
            p.stop()
            for k, v in p.stats.items():
                stats[k] = stats.get(k, 0) + v
        return stats

    def close(self) -> None:
        for p in self.ranks:
            p.close()


# =========================================================================== the peer's side


class Worker(Protocol):
    """What ``serve`` drives: a sans-IO worker that takes messages and ticks, returns frames."""

    def handle(self, msg: Message) -> None: ...
    def tick(self, n: int) -> list[bytes]: ...
    def stats(self) -> dict[str, int]: ...
    def refuse(self, error: Exception, frame: bytes) -> None: ...


class Closable(Protocol):
    def close(self) -> None: ...


def serve(cfg: dict[str, Any], start: Callable[[], tuple[Worker, Closable]]) -> None:
    """The peer process's loop: connect, build the worker (``start`` returns it and the engine
    to close on the way out), then answer ticks until stopped. A malformed frame is refused
    and counted by the worker; a crash is ``os._exit`` at the planned tick, no goodbye; an
    orphan (owner gone or silent for ``idle_exit_s``) exits instead of lingering."""
    import signal

    import zmq

    # Ctrl-C reaches the whole process group; the owner process handles it and stops its peers,
    # so a peer ignores it (no traceback per process, no peer dying before its owner knows).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    engine: Closable | None = None
    crash_at = cfg.get("crash_tick")
    try:
        sock.connect(cfg["endpoint"])
        worker, engine = start()
        sock.send(encode(TickDone(-1)))  # ready
        idle_since = time.monotonic()
        while True:
            if not sock.poll(500):
                gone = os.getppid() != int(cfg["parent_pid"])
                if gone or time.monotonic() - idle_since > float(cfg.get("idle_exit_s", 60)):
                    return
                continue
            idle_since = time.monotonic()
            frame = sock.recv()
            try:
                msg = decode(frame)
            except MalformedMessage as e:
                worker.refuse(e, frame)
                continue
            if isinstance(msg, Tick):
                if crash_at is not None and msg.n >= int(crash_at):
                    sys.stdout.flush()
                    os._exit(CRASH_EXIT)  # a crash: no cleanup, no goodbye
                for out in worker.tick(msg.n):
                    sock.send(out)
            elif isinstance(msg, Stop):
                sock.send(encode(Stats(worker.stats())))
                # Give the frame a moment to leave before the socket closes with linger 0.
                sock.poll(200)
                return
            else:
                worker.handle(msg)
    finally:
        if engine is not None:
            engine.close()
        sock.close(0)
        ctx.term()


def serve_initiator(
    cfg: dict[str, Any], worker: Callable[[ReadEngine, dict[str, Any]], Worker]
) -> None:
    """``serve`` an initiator: the transfer engine reaching the owner's memory (``cfg["memory"]``)
    and the worker around it, ``worker(engine, common)`` with ``common`` the keyword arguments
    every initiator's worker takes (peer, seed, faults, block_bytes, link_salt)."""
    from kvlifetime.adapters.engines import open_initiator
    from kvlifetime.harness.faults import FaultConfig

    faults = FaultConfig.from_dict(cfg["faults"])

    def start() -> tuple[Worker, Closable]:
        region = cfg.get("handover_region")
        engine = open_initiator(
            cfg["memory"],
            int(cfg["staging_bytes"]),
            straggle_ticks=faults.straggle_ticks,
            handover_region=int(region) if region is not None and faults.land_after_crash else None,
        )
        common = {
            "peer": cfg["peer"],
            "seed": int(cfg["seed"]),
            "faults": faults,
            "block_bytes": int(cfg["block_bytes"]),
            "link_salt": int(cfg.get("link_salt", 1)),
        }
        return worker(engine, common), engine

    serve(cfg, start)
