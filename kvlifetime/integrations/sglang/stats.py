"""What the SGLang guard reports (``SGLangGuard.stats()``; ``metrics.SGLangGuardCollector`` for
Prometheus): its lifecycles per phase, its quarantines with their reasons, and its counters,
beside the ledger's own ``LedgerStats``."""

from __future__ import annotations

import collections
from collections.abc import Iterable, Mapping
from typing import Any

import attrs

from kvlifetime.integrations.sglang.lifecycles import Lifecycle
from kvlifetime.ledger import LedgerStats


@attrs.frozen(slots=True)
class SGLangGuardStats:
    """What the guard holds and did, beside the ledger's own ``LedgerStats``."""

    role: str
    ledger: LedgerStats | None  # None until bound
    live: int  # lifecycles with open grants whose request SGLang still runs
    held: int  # ended, SGLang keeps the pages for the guard (waiting for proof or quarantined)
    quarantined: int  # of ``held``: past the deadline, peer lost, poisoned: until a fence
    quarantined_pages: int
    quarantine_reasons: dict[str, int]  # reason -> quarantined lifecycles
    releasable: int  # released by the ledger, not yet freed by SGLang
    completed: int  # lifecycles whose transfer completed (Success); only grows
    freed: int  # ended lifecycles SGLang freed after the ledger released them; only grows
    refused: dict[str, int]  # kind -> messages or calls refused (typed, logged); only grow
    duplicates: int  # repeated messages, no-ops; only grows


def summarize(
    role: str,
    ledger: LedgerStats | None,
    lifecycles: Iterable[Lifecycle[Any]],
    *,
    completed: int,
    freed: int,
    refused: Mapping[str, int],
    duplicates: int,
) -> SGLangGuardStats:
    """The stats of the lifecycles the guard holds (taken under its lock) and its counters."""
    lives = list(lifecycles)
    quarantined = [life for life in lives if life.phase == "held" and life.quarantine]
    reasons: collections.Counter[str] = collections.Counter(life.quarantine for life in quarantined)
    return SGLangGuardStats(
        role=role,
        ledger=ledger,
        live=sum(1 for life in lives if life.phase == "live"),
        held=sum(1 for life in lives if life.phase == "held"),
        quarantined=len(quarantined),
        quarantined_pages=sum(len(life.pages) for life in quarantined),
        quarantine_reasons=dict(reasons),
        releasable=sum(1 for life in lives if life.phase == "released"),
        completed=completed,
        freed=freed,
        refused=dict(refused),
        duplicates=duplicates,
    )
