"""What is really in decode's arena, in the push direction: the measurement beside the owner.

``push_owner.DecodeWorker`` acts: it admits, grants, consumes, ends and releases requests under
its policy. ``ArenaWatch`` only looks, in two ways that do not rely on the worker's own
bookkeeping being right:

- every landing the transport made, handed to the oracle at the transport
  (``oracle.TransportOracle``): read from the in-process engine's copy log, or diffed from the
  arena once per look (``oracle.ArenaDiff``) on a real engine, or on request
  (``PushSettings.oracle``);
- decode's own check of a request's blocks, as it consumes them and as it lets go: each block
  that does not hold the word its writer's peer was granted (``pattern``), a shared prefix's
  included, is a contaminated block.

The worker tells it every change of a block's holders (``granted``, ``released``,
``restarted``), and the oracle classifies each landing against those alone.
"""

from __future__ import annotations

import attrs
import numpy as np
import numpy.typing as npt

from kvlifetime.adapters.inproc import LOG_AFTER_DEATH, LOG_NBYTES, LOG_REDELIVERED, InprocTarget
from kvlifetime.adapters.transfer import TargetMemory
from kvlifetime.grant import Grant, RequestKey
from kvlifetime.harness import pattern
from kvlifetime.harness.oracle import ArenaDiff, TransportOracle
from kvlifetime.harness.settings import PushSettings


class ArenaWatch:
    """Decode's arena, watched: what landed in it and whether a request's blocks hold what
    they should.

    It promises to count, never to guess: every landing since the last ``observe`` reaches the
    oracle once, in the order it landed (the copy log) or as the words that appeared since the
    last look (the arena diff); ``contaminated`` compares every byte of every block it is asked
    about. It reads the arena and never writes it; it never touches the ledger or the worker's
    requests.
    """

    def __init__(self, cfg: PushSettings, target: TargetMemory) -> None:
        self.memory = target
        self.block_bytes = cfg.block_bytes
        # The oracle at the transport: the in-process engine's copy log, else an arena diff.
        arena_diff = cfg.oracle == "arena diff" or not isinstance(target, InprocTarget)
        self.oracle = TransportOracle(
            cfg.num_blocks, cfg.block_bytes, "arena diff" if arena_diff else "copy log"
        )
        self._diff = ArenaDiff(target.array, cfg.block_bytes) if arena_diff else None

    # ----------------------------------------------------------------- what landed

    def observe(self) -> None:
        """Hand the oracle every landing since the last look (before anything changes hands)."""
        if self._diff is not None:
            self.oracle.landed(*self._diff.landings())
            return
        assert isinstance(self.memory, InprocTarget)
        rows = self.memory.landings()
        if not len(rows):
            return
        bb = self.block_bytes
        off, tagged, words = rows[:, 0], rows[:, 1], rows[:, 2]
        nbytes = tagged & np.uint64(LOG_NBYTES)
        kinds = {
            "after_death": (tagged & np.uint64(LOG_AFTER_DEATH)) != 0,
            "redelivered": (tagged & np.uint64(LOG_REDELIVERED)) != 0,
        }
        per = np.maximum(nbytes // bb, 1).astype(np.int64)
        first = (off // bb).astype(np.int64)
        if (per == 1).all():
            self.oracle.landed(first, words, kinds)
        else:  # a slice over several blocks: one landing per block it covers
            blocks = np.concatenate([f + np.arange(k) for f, k in zip(first, per, strict=True)])
            rep = {k: np.repeat(v, per) for k, v in kinds.items()}
            self.oracle.landed(blocks, np.repeat(words, per), rep)

    # ----------------------------------------------------------------- changes of hands

    def granted(
        self,
        key: int,
        ids: npt.NDArray[np.int64],
        generations: npt.ArrayLike,
        shared: npt.NDArray[np.int64] | None = None,
    ) -> None:
        """``key`` acquired blocks ``ids`` (at ``generations``) and granted them: its peers
        write its words there. It holds ``shared`` (a prefix hit) besides."""
        self.oracle.granted(key, ids, pattern.words(key, ids, generations))
        if shared is not None:
            self.oracle.shared(key, shared)  # one more holder of the prefix's blocks

    def released(
        self, key: RequestKey, held: npt.NDArray[np.int64] | None, ids: npt.NDArray[np.int64]
    ) -> None:
        """The ledger released ``key``: it lets go of every block it ``held`` (shared prefix
        included; None when decode knows no such request), and ``ids`` are back in the pool."""
        if held is not None:
            # The oracle learns each holder that lets go, not only the blocks that go back to
            # the pool (a block its writer let go of while a sharer keeps it takes no write on
            # time any more).
            self.oracle.let_go(int(key), held)
        self.oracle.freed(ids)  # back in the pool: from here, any landing in them is late

    def restarted(self, naive: bool) -> None:
        """Decode restarted over this arena: every block is free (``naive``), or held by the
        previous incarnation until a fence (any word may land there)."""
        every = np.arange(self.oracle.num_blocks)
        if naive:
            self.oracle.freed(every)
        else:
            self.oracle.held_by_previous(every)

    # ----------------------------------------------------------------- decode's own check

    def contaminated(
        self,
        key: int,
        grant: Grant,
        shared: npt.NDArray[np.int64] | None = None,
        shared_words: npt.NDArray[np.uint64] | None = None,
    ) -> int:
        """How many of ``key``'s blocks do not hold what they should: ``grant``'s blocks the
        words its peers were granted, a shared prefix the words its first owner's peer wrote."""
        w = pattern.words(key, grant.blocks, grant.generations)
        bad = pattern.mismatched(self.memory.array, grant.blocks, w, self.block_bytes)
        if shared is not None and shared_words is not None:
            shared_bad = pattern.mismatched(
                self.memory.array, shared, shared_words, self.block_bytes
            )
            bad = np.concatenate([shared_bad, bad])
        return int(bad.sum())

    def figures(self) -> dict[str, int | str]:
        """The oracle's counts, for the result."""
        return dict(attrs.asdict(self.oracle.counts()))
