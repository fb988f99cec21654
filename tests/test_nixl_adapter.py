"""NIXL (UCX over TCP): what each state and operation proves, pinned by experiment.

The target (``NixlTarget``) lives in this process; the initiator is another process
(``nixl_helpers.Initiator``), both with ``UCX_TLS=tcp`` so that transfers are asynchronous.
Each row of ``kvlifetime.adapters.nixl.PROFILE`` names the test here that pins it. Tests run
for real when ``nixl._api`` imports; with ``KVLIFETIME_REQUIRE_NIXL=1`` they fail instead of
skipping.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from nixl_helpers import Initiator, need_nixl

from kvlifetime.adapters import nixl
from kvlifetime.evidence import TransferCompleted
from kvlifetime.grant import GrantId
from kvlifetime.harness.transfer import Status
from kvlifetime.profiles import NOTHING

SMALL = 8 << 20
BIG = 256 << 20  # long enough over TCP on loopback to act while it is in flight


def _target(nbytes: int) -> Iterator[Any]:
    need_nixl()
    t = nixl.NixlTarget(nbytes)
    yield t
    t.close()


@pytest.fixture
def small() -> Iterator[Any]:
    yield from _target(SMALL)


@pytest.fixture
def big() -> Iterator[Any]:
    yield from _target(BIG)


@pytest.fixture
def initiator_of() -> Iterator[Any]:
    started: list[Initiator] = []

    def start(target: Any) -> Initiator:
        i = Initiator(target.descriptor())
        started.append(i)
        return i

    yield start
    for i in started:
        i.close()


def wait_until(cond: Any, what: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.0005)


def landing(arena: np.ndarray[Any, Any], fill: int) -> bool:
    return bool((arena[:: 1 << 16] == fill).any())


def notifs(target: Any) -> list[bytes]:
    return [m for v in target.notifications().values() for m in v]


# --------------------------------------------------------------------------- the table as data


def test_profile_rows_match_the_adapter() -> None:
    assert nixl.xfer_ended("DONE")
    assert not nixl.xfer_ended("PROC") and not nixl.xfer_ended("ERR")
    assert nixl.status_of("DONE") is Status.COMPLETED
    assert nixl.status_of("PROC") is Status.FAILED and nixl.status_of("ERR") is Status.FAILED
    rows = {r.status: r for r in nixl.PROFILE.rows}
    nothing = [s for s, r in rows.items() if r.evidence == NOTHING]
    for needle in ("release_xfer_handle", "deregister_memory", "exception", "initialize_xfer"):
        assert any(needle in s for s in nothing), needle
    assert any('"DONE"' in s and rows[s].evidence != NOTHING for s in rows)
    assert nixl.PROFILE.fence == nixl.FENCE_RECREATED
    # The harness feeds GrantTransfers with status_of(state): DONE closes the grant.
    g = nixl.GrantTransfers(GrantId("g", 1), 7, "prefill-0")
    g.post()
    g.finish()
    assert g.on_status(1, int(nixl.status_of("DONE"))) == [
        TransferCompleted(GrantId("g", 1), 7, "prefill-0", 1)
    ]
    f = nixl.GrantTransfers(GrantId("g", 2), 8, "prefill-0")
    f.post()
    f.finish()
    assert f.on_status(1, int(nixl.status_of("ERR"))) == [] and not f.sent


def test_ucx_configuration() -> None:
    assert nixl.ucx_transports({"UCX_TLS": "tcp"}) == {"tcp"}
    assert nixl.tcp_only(nixl.ucx_transports({"UCX_TLS": " TCP "}))
    assert not nixl.tcp_only(nixl.ucx_transports({"UCX_TLS": "tcp,cma"}))
    assert not nixl.tcp_only(nixl.ucx_transports({}))  # unset: UCX may use CMA
    nixl.require_tcp({"UCX_TLS": "tcp"})
    nixl.require_tcp({})  # unset: the adapter sets tcp before its agents start
    with pytest.raises(nixl.UnsafeUcxTransport, match="UCX_TLS=cma,tcp"):
        nixl.require_tcp({"UCX_TLS": "tcp,cma"})


# --------------------------------------------------------------------------- rows, by experiment


def test_done_means_every_byte_landed(small: Any, initiator_of: Any) -> None:
    ini = initiator_of(small)
    arena = small.array
    n = SMALL // 8
    states = []
    for i in range(8):
        fill = 0x10 + i
        ans = ini.ask(f"post t{i} {i * n} {n} {1 << (i % 4)} {fill}").split()
        assert ans[:2] == ["posted", f"t{i}"]
        states.append(ans[2])
        assert ini.ask(f"poll t{i}") == f"final t{i} DONE"
        # DONE read by the initiator: every byte is there, at once.
        assert (arena[i * n : (i + 1) * n] == fill).all()
    assert "PROC" in states  # over TCP transfer() returns before the bytes land


def test_a_notification_follows_the_data(small: Any, initiator_of: Any) -> None:
    ini = initiator_of(small)
    arena = small.array
    n = SMALL // 8
    got: list[bytes] = []
    for i in range(6):
        fill = 0x20 + i
        assert ini.ask(f"post n{i} {i * n} {n} 2 {fill} note-{i}").startswith(f"posted n{i}")
        ini.send(f"poll n{i}")  # over TCP the notification leaves when the initiator polls
        note = f"note-{i}".encode()
        deadline = time.monotonic() + 20
        while note not in got:
            assert time.monotonic() < deadline, "no notification"
            got += notifs(small)
            time.sleep(0.0005)
        # The notification is here: the data of that transfer is in place.
        assert (arena[i * n : (i + 1) * n] == fill).all()
        assert ini.read() == f"final n{i} DONE"


def test_releasing_a_handle_in_flight_stops_nothing(big: Any, initiator_of: Any) -> None:
    ini = initiator_of(big)
    arena = big.array
    fill, dirty = 0x31, 0x32
    assert ini.ask(f"post r 0 {BIG} 1 {fill} never") == "posted r PROC"
    t0 = time.monotonic()
    assert ini.ask("release r") == "released r"
    released = time.monotonic() - t0
    assert ini.ask(f"dirty {dirty}") == "dirtied"  # the source is written after the release
    # The transfer goes on and lands in full, bytes written to the source after the release
    # included: UCX still reads the source.
    wait_until(lambda: bool(arena[-1] != 0) and bool(arena.all()), "never landed in full", 30)
    assert set(np.unique(arena[:: 1 << 12]).tolist()) <= {fill, dirty}
    assert (arena[:: 1 << 12] == dirty).any()
    assert released < 1.0
    time.sleep(0.2)
    assert notifs(big) == []  # a released transfer's notification never comes


def test_deregister_is_not_revocation(big: Any, initiator_of: Any) -> None:
    ini = initiator_of(big)
    arena = big.array
    fill = 0x41
    assert ini.ask(f"post d 0 {BIG} 1 {fill}") == "posted d PROC"
    wait_until(lambda: landing(arena, fill), "never started landing")
    big.unregister()  # deregister_memory: local only
    assert ini.ask("poll d") == "final d DONE"
    assert (arena == fill).all()  # the write in flight landed in full
    # A later transfer with the old metadata (the only one the initiator has) lands too.
    assert ini.ask(f"post e 0 {1 << 20} 1 {fill + 1}").startswith("posted e")
    assert ini.ask("poll e") == "final e DONE"
    assert (arena[: 1 << 20] == fill + 1).all()


def test_a_disconnect_error_proves_nothing_about_what_landed(big: Any, initiator_of: Any) -> None:
    ini = initiator_of(big)
    arena = big.array
    fill = 0x51
    assert ini.ask(f"post x 0 {BIG} 1 {fill}") == "posted x PROC"
    wait_until(lambda: landing(arena, fill), "never started landing")
    big._agent = None  # the target's agent goes (its UCX worker closes the connections)
    assert ini.ask("poll x") == "final x raised nixlRemoteDisconnectError"
    landed = int(np.count_nonzero(arena == fill))
    # The exception came, and part of that very transfer is in the target's memory.
    assert 0 < landed < BIG


def test_a_descriptor_outside_the_arena_fails_the_whole_request(
    small: Any, initiator_of: Any
) -> None:
    ini = initiator_of(small)
    arena = small.array
    n = 1 << 20
    assert ini.ask(f"bad b 0 {n} {SMALL + (1 << 20)}") == "raised b nixlNotFoundError"
    time.sleep(0.3)
    assert not arena[:n].any()  # NIXL refused the request before posting: its valid part too
    # The harness's engine maps it to FAILED (which proves nothing), and goes on.
    engine = nixl.NixlEngine(small.descriptor(), 2 * n)
    try:
        engine.staging[:] = 0x61
        good = (0, small.address(0), n)
        h = engine.submit([good, (n, small.address(0) + SMALL + n, n)])
        assert engine.wait(h, 10) is Status.FAILED
        time.sleep(0.3)
        assert not arena[:n].any()
        h = engine.submit([good])
        assert engine.wait(h, 10) is Status.COMPLETED
        assert (arena[:n] == 0x61).all()
        assert engine.bytes_written == n
    finally:
        engine.close()
