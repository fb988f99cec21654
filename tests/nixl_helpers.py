"""Shared by the tests that need NIXL: ``need_nixl`` and an initiator in another process."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import tempfile
import textwrap
from typing import Any

import pytest

from kvlifetime.adapters.nixl import nixl_available


def need_nixl() -> None:
    """Skip without NIXL, unless ``KVLIFETIME_REQUIRE_NIXL=1`` (set by .ci/run): then fail, so
    that a missing engine can never hide behind a skip."""
    if nixl_available():
        return
    if os.environ.get("KVLIFETIME_REQUIRE_NIXL") == "1":
        pytest.fail("KVLIFETIME_REQUIRE_NIXL=1 but nixl._api does not import")
    pytest.skip("nixl is not installed (pip install --no-deps nixl==1.5.1 nixl-cu13==1.5.1)")


# The initiator: a NIXL agent in its own process with a source buffer as large as the target's
# arena (offset i of the source goes to offset i of the arena). One command per stdin line,
# one answer per stdout line:
#   post ID OFF N K FILL [NOTIF]   fill source[OFF:OFF+N], post one WRITE of K descriptors
#                                  -> "posted ID STATE" | "raised ID ERROR"
#   bad ID OFF N BADOFF            one WRITE: a valid descriptor and one at arena + BADOFF
#   poll ID                        -> "final ID DONE" | "final ID raised ERROR"
#   release ID                     -> "released ID"
#   dirty VALUE                    source[::4096] = VALUE (a write to the source)
#   stream OFF N K                 post WRITEs back to back on a thread, forever
#   reload HEX                     forget the target agent, load this metadata -> "reloaded"
#   read ID OFF N K [NOTIF]        zero source[OFF:OFF+N], post one READ of K descriptors of
#                                  the arena into it -> "posted ID STATE" | "raised ID ERROR"
#   seen OFF N                     -> "seen ZEROS V1,V2,..." (source[OFF:OFF+N:4096]: how many
#                                  sampled bytes are still 0, and the distinct values)
INITIATOR = textwrap.dedent(
    """
    import os, sys, threading, time
    import numpy as np
    from nixl._api import nixl_agent, nixl_agent_config
    md, base, nbytes = bytes.fromhex(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    ag = nixl_agent("initiator-%d" % os.getpid(), nixl_agent_config(backends=["UCX"]))
    src = np.zeros(nbytes, dtype=np.uint8)
    ag.register_memory([(src.ctypes.data, nbytes, 0, "")], "DRAM")
    peer = [ag.add_remote_agent(md)]
    xfers = {}
    lock = threading.Lock()
    def say(*a):
        print(*a, flush=True)
    def descs(pairs):
        local = ag.get_xfer_descs([(src.ctypes.data + o, n, 0) for o, _d, n in pairs], "DRAM")
        remote = ag.get_xfer_descs([(base + d, n, 0) for _o, d, n in pairs], "DRAM")
        return local, remote
    def post(i, pairs, notif=b"", op="WRITE"):
        try:
            with lock:
                local, remote = descs(pairs)
                h = ag.initialize_xfer(op, local, remote, peer[0], notif)
                xfers[i] = h
                st = ag.transfer(h)
            say("posted", i, st)
        except Exception as e:
            say("raised", i, type(e).__name__)
    def stream(off, n, k):
        step = n // k
        pairs = [(off + j * step, off + j * step, step) for j in range(k)]
        while True:
            try:
                with lock:
                    local, remote = descs(pairs)
                    h = ag.initialize_xfer("WRITE", local, remote, peer[0])
                    st = ag.transfer(h)
                while st == "PROC":
                    with lock:
                        st = ag.check_xfer_state(h)
                    time.sleep(0.0005)
            except Exception:
                time.sleep(0.02)
    say("ready")
    for line in sys.stdin:
        w = line.split()
        if not w:
            continue
        c = w[0]
        if c == "post":
            i, off, n, k, fill = w[1], int(w[2]), int(w[3]), int(w[4]), int(w[5])
            src[off:off + n] = fill
            step = n // k
            post(i, [(off + j * step, off + j * step, step) for j in range(k)],
                 w[6].encode() if len(w) > 6 else b"")
        elif c == "read":
            i, off, n, k = w[1], int(w[2]), int(w[3]), int(w[4])
            src[off:off + n] = 0
            step = n // k
            post(i, [(off + j * step, off + j * step, step) for j in range(k)],
                 w[5].encode() if len(w) > 5 else b"", "READ")
        elif c == "seen":
            part = src[int(w[1]):int(w[1]) + int(w[2]):4096]
            vals = sorted(set(np.unique(part).tolist()) - {0})
            say("seen", int((part == 0).sum()), ",".join(map(str, vals)) or "-")
        elif c == "bad":
            i, off, n, bad = w[1], int(w[2]), int(w[3]), int(w[4])
            src[off:off + n] = 0x77
            post(i, [(off, off, n), (off, bad, n)])
        elif c == "poll":
            h = xfers[w[1]]
            try:
                while True:
                    with lock:
                        st = ag.check_xfer_state(h)
                    if st != "PROC":
                        break
                    time.sleep(0.0005)
                say("final", w[1], st)
            except Exception as e:
                say("final", w[1], "raised", type(e).__name__)
        elif c == "release":
            with lock:
                ag.release_xfer_handle(xfers.pop(w[1]))
            say("released", w[1])
        elif c == "dirty":
            src[::4096] = int(w[1])
            say("dirtied")
        elif c == "stream":
            args = (int(w[1]), int(w[2]), int(w[3]))
            threading.Thread(target=stream, args=args, daemon=True).start()
            say("streaming")
        elif c == "reload":
            with lock:
                try:
                    ag.remove_remote_agent(peer[0])
                except Exception:
                    pass
                try:
                    peer[0] = ag.add_remote_agent(bytes.fromhex(w[1]))
                except Exception as e:
                    say("reload raised", type(e).__name__)
                    continue
            say("reloaded")
    os._exit(0)
    """
)


class InitiatorDied(AssertionError):
    """The initiator process ended before it answered; ``returncode`` is its exit status
    (``-signal`` when a signal killed it)."""

    def __init__(self, message: str, returncode: int) -> None:
        super().__init__(message)
        self.returncode = returncode


class Initiator:
    """The initiator process, driven line by line."""

    def __init__(self, desc: dict[str, Any], *, tls: str = "tcp") -> None:
        env = dict(os.environ, UCX_TLS=tls, NIXL_LOG_LEVEL="FATAL", UCX_LOG_LEVEL="fatal")
        if tls == "":
            env.pop("UCX_TLS")
        args = [bytes(desc["metadata"]).hex(), str(desc["base"]), str(desc["nbytes"])]
        # Its stderr is kept, so that an initiator that dies says how (see ``read``).
        self.stderr = tempfile.TemporaryFile(mode="w+")  # noqa: SIM115 (closed in close())
        self.proc = subprocess.Popen(
            [sys.executable, "-X", "faulthandler", "-c", INITIATOR, *args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.stderr,
            text=True,
            env=env,
        )
        assert self.read() == "ready"

    def send(self, line: str) -> None:
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write(line + "\n")
            self.proc.stdin.flush()
        except BrokenPipeError:
            raise self._died("before it was asked") from None

    def read(self) -> str:
        """The next answer. End of file means the initiator died: that is an error of the
        experiment, never an answer, so it raises with the exit status and what it printed."""
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise self._died("without answering")
        return line.strip()

    def _died(self, when: str) -> InitiatorDied:
        rc = self.proc.wait(timeout=30)
        self.stderr.seek(0)
        tail = self.stderr.read()[-2000:]
        return InitiatorDied(f"the initiator exited ({rc}) {when}; stderr:\n{tail}", rc)

    def ask(self, line: str) -> str:
        self.send(line)
        return self.read()

    def kill(self) -> None:
        """SIGKILL, then reap."""
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=30)

    def close(self) -> None:
        self.kill()
        for f in (self.proc.stdin, self.proc.stdout):
            if f is not None:
                with contextlib.suppress(BrokenPipeError):  # it died with lines unread
                    f.close()
        self.stderr.close()
