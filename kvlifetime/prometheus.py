"""An optional Prometheus collector for a ``BlockLedger`` (extra: ``kvlifetime[prometheus]``).

    from prometheus_client import REGISTRY
    from kvlifetime.prometheus import LedgerCollector
    REGISTRY.register(LedgerCollector(ledger, name="decode0", clock=time.monotonic))

Metrics (all labelled ``ledger``): blocks per block state, live requests per request state,
quarantined blocks per reason and the oldest quarantine's age, unsafe releases, refused
evidence (per error kind) and blocks reclaimed by fences (per fence) as counters.
``stats()`` is taken once per scrape, off the hot path. Without ``prometheus_client`` the
constructor raises ``kvlifetime.extras.MissingExtra`` (naming the install), not the first scrape.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from kvlifetime.extras import require

if TYPE_CHECKING:
    from kvlifetime.ledger import BlockLedger, StepLedger


class LedgerCollector:
    """A ``prometheus_client`` custom collector (``collect()`` yields metric families)."""

    def __init__(
        self,
        ledger: BlockLedger | StepLedger,
        *,
        name: str = "default",
        clock: Callable[[], float] | None = None,
    ) -> None:
        require("prometheus", type(self).__name__)
        self.ledger = ledger
        self.name = name
        self.clock = clock  # the same clock the caller passes to ledger.expire(now)

    def collect(self) -> Iterator[Any]:
        # Imported here: prometheus_client is an optional dependency.
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        now = self.clock() if self.clock is not None else None
        st = self.ledger.stats(now=now)
        blocks = GaugeMetricFamily(
            "kvlifetime_blocks", "KV blocks per block state", labels=["ledger", "state"]
        )
        for state, n in st.blocks_by_state.items():
            blocks.add_metric([self.name, state], n)
        yield blocks

        requests = GaugeMetricFamily(
            "kvlifetime_requests", "Live requests per request state", labels=["ledger", "state"]
        )
        for state, n in st.requests_by_state.items():
            requests.add_metric([self.name, state], n)
        yield requests

        by_reason: Counter[str] = Counter()
        oldest = 0.0
        for q in st.quarantined:
            by_reason[q.reason] += q.blocks
            if q.age is not None:
                oldest = max(oldest, q.age)
        quarantined = GaugeMetricFamily(
            "kvlifetime_quarantined_blocks",
            "Blocks held by quarantined requests, per reason (never silently freed)",
            labels=["ledger", "reason"],
        )
        for reason, n in sorted(by_reason.items()):
            quarantined.add_metric([self.name, reason], n)
        yield quarantined
        age = GaugeMetricFamily(
            "kvlifetime_quarantine_oldest_age_seconds",
            "Age of the oldest quarantine, on the ledger's clock",
            labels=["ledger"],
        )
        age.add_metric([self.name], oldest)
        yield age

        unsafe = CounterMetricFamily(
            "kvlifetime_unsafe_releases",
            "force_release calls that released a request with an open grant",
            labels=["ledger"],
        )
        unsafe.add_metric([self.name], st.unsafe_releases)
        yield unsafe

        refused = CounterMetricFamily(
            "kvlifetime_refused_evidence",
            "Evidence refused (stale, mismatched, contradictory, malformed), per kind",
            labels=["ledger", "kind"],
        )
        for kind, n in sorted(st.refused_evidence.items()):
            refused.add_metric([self.name, kind], n)
        yield refused

        reclaimed = CounterMetricFamily(
            "kvlifetime_reclaimed_blocks",
            "Blocks put back in the pool by releases a completed fence made possible, per fence",
            labels=["ledger", "fence"],
        )
        for fence, n in sorted(st.reclaimed_blocks.items()):
            reclaimed.add_metric([self.name, fence], n)
        yield reclaimed

        grants = GaugeMetricFamily("kvlifetime_open_grants", "Open grants", labels=["ledger"])
        grants.add_metric([self.name], st.open_grants)
        yield grants


class GuardCollector(LedgerCollector):
    """The vLLM guard's metrics (``kvlifetime.integrations.vllm``): its ledger's, plus what it
    kept from vLLM. ``REGISTRY.register(GuardCollector(scheduler.connector.guard))``.

    ``kvlifetime_vllm_withheld_requests``: ended requests vLLM keeps for the guard (waiting for
    proof, or quarantined); ``kvlifetime_vllm_failed_loads_held``: live requests whose failed
    load keeps their blocks, waiting for a fence; counters ``kvlifetime_vllm_handed_back``,
    ``_lease_reaped``, ``_load_failed`` and ``kvlifetime_vllm_dropped_ids`` per kind
    (duplicate_id, unknown_id, exposed_block_reused, ...)."""

    def __init__(self, guard: Any, *, name: str = "vllm") -> None:
        super().__init__(guard.ledger, name=name)
        self.guard = guard

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        yield from super().collect()
        st = self.guard.stats()
        withheld = GaugeMetricFamily(
            "kvlifetime_vllm_withheld_requests",
            "Ended requests vLLM keeps for the guard: waiting for proof, or quarantined",
            labels=["ledger"],
        )
        withheld.add_metric([self.name], st.withheld)
        yield withheld
        held = GaugeMetricFamily(
            "kvlifetime_vllm_failed_loads_held",
            "Live requests whose failed load keeps their blocks, waiting for a fence",
            labels=["ledger"],
        )
        held.add_metric([self.name], st.failed_loads_held)
        yield held
        for metric, doc in (
            ("handed_back", "Request ids handed to vLLM after the ledger released them"),
            ("lease_reaped", "Reaped send leases turned into LeaseExpired (quarantine)"),
            ("load_failed", "Failed loads turned into LeaseExpired on the WRITE grant"),
        ):
            c = CounterMetricFamily(f"kvlifetime_vllm_{metric}", doc, labels=["ledger"])
            c.add_metric([self.name], getattr(st, metric))
            yield c
        dropped = CounterMetricFamily(
            "kvlifetime_vllm_dropped_ids",
            "Ids kept from vLLM (duplicate, unknown) and reuses reported, per kind",
            labels=["ledger", "kind"],
        )
        for kind, n in sorted(st.dropped.items()):
            dropped.add_metric([self.name, kind], n)
        yield dropped
