"""What counts as a fence on Mooncake's TCP transport, pinned by experiment (docs/fencing.md).

An initiator in another process streams writes into the target's arena; the target fences
while bytes are landing, then fills the arena with a known pattern and watches it: any byte
that changes afterwards landed after the fence returned. ``unregister_memory`` is the control
(the same measurement sees its late bytes). Tests run for real when ``mooncake.engine`` imports;
with ``KVLIFETIME_REQUIRE_MOONCAKE=1`` they fail instead of skipping.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from mooncake_helpers import need_mooncake

from kvlifetime.errors import FenceUnavailable

ARENA = 64 << 20
SLICES = 4
PAT, FILL = 0xAA, 0x55
# How long to watch for late bytes. A write the fence failed to end would, had nobody fenced,
# have finished landing within the time one whole-arena batch takes to land: that time is
# measured in each test, from the stream it fences (``drain_time``), on the machine as loaded
# as it is then. The watch lasts ten times that, so that a session the fence left alive but
# slowed (a loaded machine, a delayed thread) still has time to show its bytes; a fixed second
# can be shorter than a few batches on a loaded machine and let a leaking fence pass. On this
# 2-core machine a batch lands in about 0.25 s: the watch is about 2.5 s, six watches a file.
WATCH_FACTOR = 10
WATCH_MIN_S = 1.0
DRAIN_BATCHES = 3  # completed batches timed before a fence: the slowest sets the watch

# The initiator: posts batches covering the whole arena, one after another, to the endpoint it
# was given, until killed or stdin closes. Prints one status per batch, with the seconds from
# its post to its status (for status 0: until every byte of it landed).
STREAM = textwrap.dedent(
    """
    import os, sys, threading, time
    os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
    import numpy as np
    import mooncake.engine as me
    target, base, nbytes, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    te = me.TransferEngine()
    assert te.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
    staging = np.full(nbytes, int(sys.argv[5]), dtype=np.uint8)
    src = int(staging.ctypes.data)
    assert te.register_memory(src, nbytes) == 0
    step = nbytes // n
    def stream():
        while True:
            t0 = time.monotonic()
            bid = te.batch_transfer_async_write(
                target, [src + i * step for i in range(n)],
                [base + i * step for i in range(n)], [step] * n)
            if bid in (0, -1, (1 << 64) - 1):
                print("refused", flush=True)
                time.sleep(0.05)
                continue
            st = te.get_batch_transfer_status([bid])
            print("status", st, "%.6f" % (time.monotonic() - t0), flush=True)
    print("ready", flush=True)
    threading.Thread(target=stream, daemon=True).start()
    sys.stdin.read()
    os._exit(0)
    """
)


@pytest.fixture
def target() -> Iterator[Any]:
    need_mooncake()
    from kvlifetime.adapters.mooncake import MooncakeTarget

    t = MooncakeTarget(ARENA)
    yield t
    t.close()


def start_stream(desc: dict[str, Any]) -> subprocess.Popen[str]:
    args = [desc["target"], str(desc["base"]), str(ARENA), str(SLICES), str(FILL)]
    p = subprocess.Popen(
        [sys.executable, "-c", STREAM, *args],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    assert p.stdout is not None and p.stdout.readline().strip() == "ready"
    return p


def stop(p: subprocess.Popen[str]) -> str:
    if p.poll() is None:
        p.kill()
    out, _ = p.communicate(timeout=30)
    return out


def wait_landing(arena: np.ndarray[Any, Any]) -> None:
    """Reset the arena to the pattern, and return once the stream's bytes land again: a write
    is in flight now (the stream never stops posting)."""
    arena[:] = PAT
    starts = np.arange(SLICES) * (ARENA // SLICES)
    deadline = time.monotonic() + 30
    while not (arena[starts + 4096] == FILL).any():
        assert time.monotonic() < deadline, "the stream's writes never landed"
        time.sleep(0.001)


def drain_time(p: subprocess.Popen[str]) -> float:
    """The seconds the slowest of the stream's ``DRAIN_BATCHES`` completed batches after its
    first took to land, unfenced: each covers the whole arena, as the batch a fence cuts does."""
    assert p.stdout is not None
    times: list[float] = []
    deadline = time.monotonic() + 60
    while len(times) < DRAIN_BATCHES + 1:
        assert time.monotonic() < deadline, "the stream completed no batch"
        words = p.stdout.readline().split()
        assert words, "the stream ended"
        if words[:2] == ["status", "0"]:
            times.append(float(words[2]))
    return max(times[1:])  # the first batch also waited for the connection to be set up


def watch_for(drain_s: float) -> float:
    return max(WATCH_MIN_S, WATCH_FACTOR * drain_s)


def landed_after(arena: np.ndarray[Any, Any], watch_s: float) -> int:
    """Fill the arena with the pattern, watch it ``watch_s`` seconds, and count the bytes
    that changed."""
    arena[:] = PAT
    time.sleep(watch_s)
    return int(np.count_nonzero(arena != PAT))


def own_sockets_on(ports: frozenset[int]) -> list[tuple[str, int]]:
    from kvlifetime.adapters.sockets import own_tcp_sockets

    return [s for s in own_tcp_sockets() if s[1] in ports]


def test_unregister_is_not_a_fence_the_measurement_sees_late_bytes() -> None:
    # Control for the tests below: the same measurement, after unregister_memory. One run that
    # sees bytes land after it shows it is not a fence. A run can see none when no session was
    # past the header check at that moment (seen once, on a heavily loaded machine), so up to
    # three runs, each with a fresh target; the fence tests below require 0 in every run.
    need_mooncake()
    from kvlifetime.adapters.mooncake import MooncakeTarget

    seen: list[int] = []
    while len(seen) < 3 and not any(seen):
        t = MooncakeTarget(ARENA)
        p = start_stream(t.descriptor())
        try:
            watch_s = watch_for(drain_time(p))
            wait_landing(t.array)
            t.unregister()
            # sessions past the header check kept writing
            seen.append(landed_after(t.array, watch_s))
        finally:
            stop(p)
            t.close()
    assert max(seen) > 0, seen


def test_fence_ends_writes_in_flight_every_run(target: Any) -> None:
    names, late, times, watches = [], [], [], []
    for _ in range(3):
        old_desc, old_ports = target.descriptor(), target.ports
        assert len(old_ports) == 2 and int(old_desc["target"].rsplit(":", 1)[1]) in old_ports
        p = start_stream(old_desc)  # a new initiator is served by the (re-created) engine
        try:
            watches.append(watch_for(drain_time(p)))
            wait_landing(target.array)
            t0 = time.monotonic()
            names.append(target.fence())
            times.append(time.monotonic() - t0)
            # The stream keeps posting to the old endpoint all through the watch: refused.
            late.append(landed_after(target.array, watches[-1]))
            assert late[-1] == 0, (late, watches)  # what the fence is for, checked first
            assert own_sockets_on(old_ports) == []  # its listeners and sessions are closed
            assert target.descriptor()["target"] != old_desc["target"]
            assert not target.ports & old_ports
        finally:
            out = stop(p)
        assert "status -1" in out  # the batch in flight was cut, not completed
    assert late == [0, 0, 0], watches
    assert names == ["mooncake_target_recreated"] * 3
    assert max(times) < 10


def test_fence_after_the_initiator_was_killed(target: Any) -> None:
    # SIGKILL mid-transfer: the target may still apply what it received; the fence ends that.
    p = start_stream(target.descriptor())
    try:
        watch_s = watch_for(drain_time(p))
        wait_landing(target.array)
        p.kill()
        assert target.fence() == "mooncake_target_recreated"
        assert landed_after(target.array, watch_s) == 0
    finally:
        stop(p)


def test_old_endpoint_is_dead_and_new_initiators_are_served(target: Any) -> None:
    old = target.descriptor()
    p = start_stream(old)
    try:
        watch_s = watch_for(drain_time(p))  # what its batches take to land while served
    finally:
        stop(p)
    target.fence()
    # A fresh initiator that only knows the old endpoint: refused, nothing lands.
    p = start_stream(old)
    try:
        assert landed_after(target.array, watch_s) == 0
    finally:
        out = stop(p)
    assert "refused" in out and "status 0" not in out
    # The target keeps serving the arena on its new endpoint, fence after fence.
    target.fence()
    p = start_stream(target.descriptor())
    try:
        wait_landing(target.array)
    finally:
        stop(p)


def test_fence_without_known_ports_is_refused_and_changes_nothing(target: Any) -> None:
    desc = target.descriptor()
    target._ports = frozenset()  # as when other listeners opened while the engine started
    with pytest.raises(FenceUnavailable, match="ports are unknown"):
        target.fence()
    assert target.descriptor() == desc


def test_fence_never_reuses_a_port_of_an_earlier_engine() -> None:
    # Six ports for every engine of the process: the first engine takes two, the fence's new
    # engine must take two others (the old ones stay taken while it starts), and the next fence
    # cannot return to the first engine's ports: it refuses, the current engine still serving.
    need_mooncake()
    code = textwrap.dedent(
        """
        import os
        os.environ["MC_MIN_RPC_PORT"], os.environ["MC_MAX_RPC_PORT"] = "21300", "21305"
        from kvlifetime.adapters.mooncake import MooncakeTarget
        t = MooncakeTarget(1 << 20)
        first = t.ports
        assert t.fence() == "mooncake_target_recreated"
        second = t.ports
        assert len(first | second) == 4, (first, second)
        try:
            t.fence()
        except OSError as e:
            assert "not fenced" in str(e)
            assert t.ports == second
        else:
            assert not t.ports & (first | second), t.ports
        print("ok")
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False
    )
    assert out.stdout.strip().endswith("ok"), out.stderr[-2000:]
