"""Prometheus metrics of the SGLang guard (extra ``kvlifetime[prometheus]``)::

    from prometheus_client import REGISTRY
    from kvlifetime.integrations.sglang.metrics import SGLangGuardCollector
    REGISTRY.register(SGLangGuardCollector(guard, name="sglang-decode", clock=time.monotonic))

It takes the guard, not its ledger: ``install`` returns the guard before SGLang builds the queues
that size the ledger, so the ledger's metrics (``LedgerCollector``'s: pages per state,
quarantined pages per reason and the oldest one's age, refused evidence, pages reclaimed by
fences) appear from the first scrape after it is bound. Beside them, the guard's own:
``kvlifetime_sglang_lifecycles{phase}`` (live / held / releasable),
``kvlifetime_sglang_quarantined_lifecycles{reason}``, ``kvlifetime_sglang_quarantined_pages``,
and counters ``kvlifetime_sglang_completed``, ``_freed``, ``_duplicates`` and
``kvlifetime_sglang_refused{kind}`` (exposed_page_reused, ack_refused, ...).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from kvlifetime.integrations.sglang.guard import SGLangGuard
from kvlifetime.prometheus import LedgerCollector


class SGLangGuardCollector(LedgerCollector):
    """A ``prometheus_client`` custom collector for one ``SGLangGuard``."""

    def __init__(
        self,
        guard: SGLangGuard,
        *,
        name: str = "sglang",
        clock: Callable[[], float] | None = None,
    ) -> None:
        # The ledger is read at each scrape (it is bound after install); LedgerCollector's
        # own checks (prometheus_client installed) run here.
        super().__init__(guard.ledger if guard.bound else None, name=name, clock=clock)  # type: ignore[arg-type]
        self.guard = guard

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        if self.guard.bound:
            self.ledger = self.guard.ledger
            yield from super().collect()
        now = self.clock() if self.clock is not None else None
        st = self.guard.stats(now)
        lives = GaugeMetricFamily(
            "kvlifetime_sglang_lifecycles",
            "Uses of a room the guard holds, per phase",
            labels=["ledger", "phase"],
        )
        for phase, n in (("live", st.live), ("held", st.held), ("releasable", st.releasable)):
            lives.add_metric([self.name, phase], n)
        yield lives
        q = GaugeMetricFamily(
            "kvlifetime_sglang_quarantined_lifecycles",
            "Held lifecycles quarantined (never released until a late proof or a fence)",
            labels=["ledger", "reason"],
        )
        for reason, n in sorted(st.quarantine_reasons.items()):
            q.add_metric([self.name, reason], n)
        yield q
        pages = GaugeMetricFamily(
            "kvlifetime_sglang_quarantined_pages",
            "Pages of quarantined lifecycles",
            labels=["ledger"],
        )
        pages.add_metric([self.name], st.quarantined_pages)
        yield pages
        for metric, doc, value in (
            ("completed", "Lifecycles whose transfer completed (Success)", st.completed),
            ("freed", "Ended lifecycles SGLang freed after the ledger released them", st.freed),
            ("duplicates", "Repeated messages and calls (no-ops)", st.duplicates),
        ):
            c = CounterMetricFamily(f"kvlifetime_sglang_{metric}", doc, labels=["ledger"])
            c.add_metric([self.name], value)
            yield c
        refused = CounterMetricFamily(
            "kvlifetime_sglang_refused",
            "Messages and calls the guard refused (typed, logged), per kind",
            labels=["ledger", "kind"],
        )
        for kind, n in sorted(st.refused.items()):
            refused.add_metric([self.name, kind], n)
        yield refused
