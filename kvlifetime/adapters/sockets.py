"""What this process listens on: how a target-side fence is *observed* complete.

A fence that re-creates a serving engine (Mooncake's TCP transport, NIXL's UCX agent over TCP)
is complete once no socket of this process is bound to the old engine's ports any more: its
listeners and the sessions accepted on them are gone. Linux only (``/proc``); elsewhere
``fence_observable()`` is False and the fences refuse.
"""

from __future__ import annotations

import os
import time
from collections.abc import Collection

from kvlifetime.errors import FenceUnavailable

_TCP_TABLES = ("/proc/self/net/tcp", "/proc/self/net/tcp6")
_LISTEN = "0A"  # TCP_LISTEN in /proc/net/tcp
OBSERVE_S = 10.0  # how long an old engine's sockets may take to be seen gone


def _socket_inodes() -> set[str]:
    inodes: set[str] = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            link = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue  # closed meanwhile
        if link.startswith("socket:["):
            inodes.add(link[8:-1])
    return inodes


def own_tcp_sockets() -> list[tuple[str, int]]:
    """(state, local port) of every TCP socket this process holds open."""
    inodes = _socket_inodes()
    found: list[tuple[str, int]] = []
    for table in _TCP_TABLES:
        try:
            with open(table) as f:
                rows = f.read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            cols = row.split()
            if len(cols) > 9 and cols[9] in inodes:
                found.append((cols[3], int(cols[1].rsplit(":", 1)[1], 16)))
    return found


def listening_ports() -> set[int]:
    return {port for state, port in own_tcp_sockets() if state == _LISTEN}


def fence_observable() -> bool:
    """Whether this platform lets the adapter see its own sockets (Linux ``/proc``)."""
    return os.path.isdir("/proc/self/fd") and any(os.path.exists(t) for t in _TCP_TABLES)


def wait_closed(ports: Collection[int], what: str) -> None:
    """Return once no socket of this process is on ``ports``; raise ``FenceUnavailable`` (not
    fenced) if one still is after ``OBSERVE_S`` seconds: something else holds the engine."""
    deadline = time.monotonic() + OBSERVE_S
    while any(port in ports for _state, port in own_tcp_sockets()):
        if time.monotonic() > deadline:
            raise FenceUnavailable(
                f"{what}: the old engine's sockets are still open (ports {sorted(ports)}): "
                "something still holds it; not fenced"
            )
        time.sleep(0.01)
