"""The test's side of the two-process rig: starts a decode and a prefill process (each one of
``sglang_rig``'s sides), sends them commands over a pipe, freezes or kills the prefill.

Processes come from a fork server that imported SGLang once (about 10 s on 2 cores), so each
scenario starts from two fresh processes in well under a second.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import socket
import time
from collections.abc import Callable
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
# The fork server is a fresh interpreter: it finds sglang_rig through PYTHONPATH (Python 3.11's
# fork server ignores the parent's sys.path), and a preload it cannot import is dropped silently.
os.environ["PYTHONPATH"] = os.pathsep.join(
    [HERE, *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
)
_CTX = multiprocessing.get_context("forkserver")
_CTX.set_forkserver_preload(["sglang_rig"])


class SideFailed(RuntimeError):
    """A command raised in the child; the message is its traceback."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Proc:
    def __init__(self, role: str, options: dict[str, Any], wait: bool = True) -> None:
        import sglang_rig

        self.role = role
        self.conn, child = _CTX.Pipe()
        self.process = _CTX.Process(
            target=sglang_rig.serve, args=(role, child, options), name=f"sglang-{role}"
        )
        self.process.start()
        child.close()
        self.pid = 0
        self.frozen = False
        if wait:
            self.wait_started()

    def wait_started(self) -> None:
        self.pid = int(self._reply(60.0)["pid"])

    def _reply(self, timeout: float) -> Any:
        if not self.conn.poll(timeout):
            raise TimeoutError(f"{self.role}: no answer in {timeout} s")
        status, value = self.conn.recv()
        if status != "ok":
            raise SideFailed(f"{self.role}:\n{value}")
        return value

    def call(self, command: str, timeout: float = 30.0, **kwargs: Any) -> Any:
        self.send(command, kwargs)
        return self._reply(timeout)

    def send(self, command: str, kwargs: dict[str, Any]) -> None:
        assert not self.frozen, f"{self.role} is frozen (SIGSTOP); it cannot answer"
        self.conn.send((command, kwargs))

    def receive(self, timeout: float = 30.0) -> Any:
        return self._reply(timeout)

    def freeze(self) -> None:
        os.kill(self.pid, signal.SIGSTOP)
        self.frozen = True

    def thaw(self) -> None:
        os.kill(self.pid, signal.SIGCONT)
        self.frozen = False

    def kill(self) -> None:
        if self.process.is_alive():
            os.kill(self.pid, signal.SIGKILL)
        self.process.join(10)
        self.frozen = False

    def close(self) -> None:
        if self.process.is_alive():
            if self.frozen:
                self.thaw()
            try:
                self.conn.send(("close", {}))
                self.conn.poll(5.0)
            except (BrokenPipeError, OSError):
                pass
            self.process.join(5)
        if self.process.is_alive():
            self.kill()
        self.conn.close()


class Rig:
    """A decode and a prefill process of SGLang 0.5.23 over Mooncake TCP on loopback."""

    def __init__(
        self,
        *,
        guarded: bool,
        pool_tokens: int,
        env: dict[str, str] | None = None,
        prefill_pool_tokens: int | None = None,
        prefill_ranks: int = 1,
        guard_options: dict[str, dict[str, Any]] | None = None,
    ) -> None:
        self.guarded = guarded
        # What each guarded side's refusal counters must be when the scenario ends (the
        # ``rigs`` fixture checks): none, unless a scenario says which it provokes.
        self.expected_refusals: dict[str, dict[str, int]] = {}
        self.port = free_port()
        common = {"bootstrap_port": self.port, "guarded": guarded, "env": dict(env or {})}
        options = guard_options or {}
        prefill = {
            **common,
            "guard_options": dict(options.get("prefill", {})),
            "pool_tokens": prefill_pool_tokens or pool_tokens,
            "tp_size": prefill_ranks,
            "store_port": free_port(),
        }
        # The ranks of one prefill instance start together: they meet in one gloo group.
        self.prefills: list[Proc] = []
        self._decode: Proc | None = None
        try:
            starting = [
                Proc("prefill", {**prefill, "tp_rank": r}, wait=False) for r in range(prefill_ranks)
            ]
            self.prefills = starting
            for p in starting:
                p.wait_started()
            self._decode = Proc(
                "decode",
                {
                    **common,
                    "pool_tokens": pool_tokens,
                    "guard_options": dict(options.get("decode", {})),
                },
            )
        except BaseException:
            self.close()
            raise
        self.decode: Proc = self._decode
        self.prefill = self.prefills[0]
        self.ticks = 0

    def close(self) -> None:
        if self._decode is not None:
            self._decode.close()
        for p in self.prefills:
            p.close()

    def refusals(self) -> dict[str, dict[str, int]]:
        """Each guarded side's refusal counters ("decode", "prefill0", ...), read from every
        process still running (a killed one has none to give)."""
        out: dict[str, dict[str, int]] = {}
        sides = [("decode", self._decode)] + [
            (f"prefill{i}", p) for i, p in enumerate(self.prefills)
        ]
        for name, proc in sides:
            if proc is None or not proc.process.is_alive():
                continue
            if proc.frozen:
                proc.thaw()
            stats = proc.call("guard_stats")
            if stats is not None:
                out[name] = dict(stats["refused"])
        return out

    def prefill_all(self, command: str, **kwargs: Any) -> list[Any]:
        """The same command to every prefill rank at once (their queues all-reduce over the
        ranks' gloo group, so each blocks until all have called), then every answer."""
        for p in self.prefills:
            p.send(command, kwargs)
        return [p.receive() for p in self.prefills]

    # -- the steps a scenario is made of

    def start(self, rid: str, room: int, tokens: int, seed: int | None = None) -> None:
        """Both sides receive the request (as the router sends it to both); its prompt's token
        ids start at ``seed`` (default: the room)."""
        self.prefill_all("admit", rid=rid, room=room, tokens=tokens, seed=seed)
        self.decode.call("admit", rid=rid, room=room, tokens=tokens, seed=seed)

    def tick(self) -> dict[str, Any]:
        self.ticks += 1
        result: dict[str, Any] = self.decode.call("tick")
        return result

    def tick_until(
        self, rid: str, places: set[str], timeout: float = 10.0, pause: float = 0.005
    ) -> dict[str, Any]:
        """Tick the decode until ``rid`` is in one of ``places``."""
        deadline = time.monotonic() + timeout
        while True:
            state = self.tick()
            if state["places"].get(rid) in places:
                return state
            if time.monotonic() > deadline:
                raise TimeoutError(f"{rid} never reached {places}: {state}")
            time.sleep(pause)

    def bootstrap_prefill(self, rid: str, timeout: float = 10.0) -> None:
        """Tick the decode (which sends the destination pages) and poll the prefill's
        bootstrap queue until the prefill has the request ready for its forward."""
        deadline = time.monotonic() + timeout
        while not all(rid in ready for ready in self.prefill_all("bootstrap")):
            self.tick()
            if time.monotonic() > deadline:
                raise TimeoutError(f"prefill never bootstrapped {rid}")
            time.sleep(0.005)

    def until(self, check: Callable[[], bool], timeout: float = 10.0, what: str = "") -> float:
        start = time.monotonic()
        while not check():
            if time.monotonic() - start > timeout:
                raise TimeoutError(f"timed out waiting for {what}")
            time.sleep(0.01)
        return time.monotonic() - start
