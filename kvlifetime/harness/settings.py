"""The settings of one harness run: what both directions share, and what each adds on top.

``PushSettings``: prefill (the initiator, in other processes) writes each request's KV into
decode's blocks (SGLang, Mooncake). ``PullSettings``: decode (the initiator) reads it out of
prefill's source blocks (vLLM's NIXL path). Either way one process, the *owner*, holds the
blocks in a ``BlockLedger`` and decides by its policy when they go back to its pool:

- ``naive``: at once, when the request ends on the owner's side (``force_release``);
- ``timeout``: when a deadline passes (``timeout_ticks``), whatever the peer may still do (a
  lease reaper, as vLLM's send lease or SGLang's timeout);
- ``proof``: only once the evidence closes every grant; quarantine at a deadline
  (``proof_deadline_ticks``) and fence to get the quarantined blocks back.

Light at import: the command line builds its parser from the names here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

import attrs

from kvlifetime.adapters.engines import BACKENDS
from kvlifetime.errors import UsageError

if TYPE_CHECKING:
    from kvlifetime.harness.faults import FaultConfig

POLICIES: tuple[str, ...] = ("naive", "timeout", "proof")
DIRECTIONS: tuple[str, ...] = ("push", "pull")
RESTARTS: tuple[str, ...] = ("none", "naive", "guarded")
ORACLES: tuple[str, ...] = ("auto", "arena diff")


def _default_faults() -> FaultConfig:
    from kvlifetime.harness.faults import FaultConfig  # numpy and msgpack: not at import

    return FaultConfig()


@attrs.frozen(slots=True)
class RunSettings:
    """What a run of either direction is made of. Each field is the same concept both ways."""

    direction: ClassVar[str] = ""

    backend: str = "inproc"  # the transfer engine (``adapters.engines.BACKENDS``)
    policy: str = "proof"  # when the owner frees blocks (``POLICIES``)
    requests: int = 1000
    seed: int = 0  # decides every fault and every landing order
    block_bytes: int = 4096  # small blocks: the harness is about lifetimes, not bandwidth
    num_blocks: int = 2048  # the owner's pool
    staging_blocks: int = 1024  # the initiator's own registered memory, in blocks
    arrivals_per_tick: int = 8
    timeout_ticks: int = 8  # timeout policy: ticks after the owner's end before it frees anyway
    proof_deadline_ticks: int = 64  # proof policy: ticks after the end before it quarantines
    query_every: int = 12  # ticks between evidence queries for a grant still open
    max_queries: int = 8
    drain_ticks: int = 400  # at most this many ticks after the last admission
    tick_timeout_s: float = 30.0  # no TickDone for this long: the peer is hung, stop it
    max_restarts: int = 3  # peer crashes tolerated before the run gives up
    # proof policy: fence the peer (and reclaim) once this many blocks are quarantined;
    # 0: never fence on pressure (a crash is still fenced unless ``fence`` is False)
    fence_quarantined_blocks: int = 256
    fence: bool = True  # proof policy: fence after a crash and on quarantine pressure
    faults: FaultConfig = attrs.field(factory=_default_faults)

    def __attrs_post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise UsageError(f"unknown policy {self.policy!r} ({', '.join(POLICIES)})")
        if self.backend not in BACKENDS:
            raise UsageError(f"unknown backend {self.backend!r} ({', '.join(BACKENDS)})")
        if self.block_bytes % 8 or self.block_bytes <= 0 or self.requests < 0:
            raise UsageError("block_bytes must be a positive multiple of 8, requests >= 0")

    @property
    def expected_ticks(self) -> int:
        """About how long the admissions last: the scale of the seeded crash and restart ticks."""
        return max(1, self.requests // max(1, self.arrivals_per_tick))

    @property
    def restart_mode(self) -> str:
        """The owner's restart mid-run (``RESTARTS``); only the push harness restarts one."""
        return "none"

    @property
    def name(self) -> str:
        """What the run is called in its progress and its event lines: ``push proof``."""
        return f"{self.direction} {self.policy}"


@attrs.frozen(slots=True)
class PushSettings(RunSettings):
    """Prefill writes into decode's blocks; decode owns them (``harness.push_owner``)."""

    direction: ClassVar[str] = "push"

    overdue_ticks: int = 48  # an admitted request with no news for this long is queried
    restart: str = "none"  # decode restarts mid-run: none / naive / guarded (``RESTARTS``)
    # how the oracle sees landings: "auto" (the in-process engine's copy log, a real engine's
    # arena diff) or "arena diff" (also on the in-process engine, to compare the two)
    oracle: str = "auto"

    def __attrs_post_init__(self) -> None:
        RunSettings.__attrs_post_init__(self)
        tp = self.faults.tp_ranks
        if tp < 1 or tp > 16 or self.block_bytes % (8 * tp):
            raise UsageError("tp_ranks must be in 1..16 and split block_bytes into 8-byte parts")
        if self.restart not in RESTARTS:
            raise UsageError(f"unknown restart {self.restart!r} ({', '.join(RESTARTS)})")
        if self.oracle not in ORACLES:
            raise UsageError(f"unknown oracle {self.oracle!r} ({', '.join(ORACLES)})")

    @property
    def restart_mode(self) -> str:
        return self.restart

    @property
    def name(self) -> str:
        return f"push {self.policy}" + (
            f", restart {self.restart}" if self.restart != "none" else ""
        )


@attrs.frozen(slots=True)
class PullSettings(RunSettings):
    """Decode reads prefill's source blocks; prefill owns them (``harness.pull_owner``)."""

    direction: ClassVar[str] = "pull"

    # a test's knob: right after the grant of this request went out, prefill gives its first
    # block to another request (computes other KV into it): one stale read, planted
    plant_stale_read: int | None = None
