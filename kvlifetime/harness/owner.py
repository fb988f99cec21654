"""The memory owner's side of quarantine and fences, whichever way the bytes go (decode
owning the arena prefill writes, or prefill owning the blocks decode reads).

What is shared: when the proof policy fences (quarantine pressure, or a quiet system with only
quarantined requests left), and what a completed fence does to the ledger (a local
``AccessRevoked`` for the peer, then the releases it made possible, which are told apart from
releases by a late proof). Each harness says what a fence does to its own requests.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import numpy as np
import numpy.typing as npt

from kvlifetime.evidence import AccessRevoked
from kvlifetime.grant import RequestKey
from kvlifetime.harness.series import StateSeries
from kvlifetime.ledger import BlockLedger
from kvlifetime.ledger_values import LedgerStats
from kvlifetime.spec.vocabulary import BlockState

if TYPE_CHECKING:
    from kvlifetime.harness.oracle import TransportOracle


class _FenceSettings(Protocol):
    @property
    def policy(self) -> str: ...
    @property
    def fence(self) -> bool: ...
    @property
    def fence_quarantined_blocks(self) -> int: ...


class FencingOwner:
    """Mixed into a harness's owner worker, which sets ``cfg``, ``ledger`` and ``count`` and
    implements ``_release`` and ``idle``."""

    cfg: _FenceSettings
    ledger: BlockLedger
    count: dict[str, int]
    fences: dict[str, int]  # fence name -> times performed
    _fencing: bool  # True while releasing what a fence made releasable (not a late proof)
    oracle: TransportOracle
    retired: list[LedgerStats]  # the stats of ledgers replaced by a restart (if any)
    series: StateSeries  # blocks by state over the run, for the report's plots

    def _init_fencing(self) -> None:
        self.fences = {}
        self._fencing = False
        self.retired = []
        self.series = StateSeries()

    def _release(self, key: RequestKey, ids: npt.NDArray[np.int64]) -> None:
        raise NotImplementedError

    def idle(self) -> bool:
        raise NotImplementedError

    def _revoked(self, peer: str, fence: str) -> None:
        """``fence`` ended ``peer``'s access for real (observed complete by this process): the
        local ``AccessRevoked`` closes every grant to it, and what that made releasable goes."""
        self.ledger.apply(AccessRevoked(peer, fence=fence))
        self.fences[fence] = self.fences.get(fence, 0) + 1
        self._fencing = True
        try:
            for rkey, ids in self.ledger.collect_releasable().items():
                self._release(rkey, ids)
        finally:
            self._fencing = False

    def quarantined_blocks(self) -> int:
        q = self.ledger.stats().blocks_by_state.get(BlockState.QUARANTINED.label, 0)
        self.count["peak_quarantined_blocks"] = max(self.count["peak_quarantined_blocks"], q)
        return q

    def _sample(self, tick: int) -> LedgerStats:
        """One reading of the ledger, kept in the series (the report's plots)."""
        st = self.ledger.stats()
        old = self.retired
        o = self.oracle
        self.series.sample(
            tick,
            st,
            reclaimed=sum(st.reclaimed_blocks.values())
            + sum(sum(s.reclaimed_blocks.values()) for s in old),
            unsafe_releases=st.unsafe_releases + sum(s.unsafe_releases for s in old),
            late_writes=o.late_into_owned + o.late_into_free,
            stale_reads=o.stale_reads,
        )
        return st

    def wants_fence(self, n: int, *, quiet: bool) -> bool:
        """The proof policy fences on quarantine pressure (checked every 8 ticks), and once
        the system is ``quiet`` with only quarantined requests left (so that it ends with
        nothing lost). The peak of quarantine is sampled whatever the policy, every 8 ticks
        (the series may read the ledger more often; those readings leave the peak alone)."""
        cfg = self.cfg
        checks = not n % 8 or quiet
        if not checks:
            if self.series.due(n):
                self._sample(n)
            return False
        st = self._sample(n)
        q = st.blocks_by_state.get(BlockState.QUARANTINED.label, 0)
        self.count["peak_quarantined_blocks"] = max(self.count["peak_quarantined_blocks"], q)
        if cfg.policy != "proof" or not cfg.fence:
            return False
        return q > 0 and (quiet or 0 < cfg.fence_quarantined_blocks <= q)
