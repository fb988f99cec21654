"""The optional Prometheus collector, scraped through a real prometheus_client registry."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from kvlifetime.errors import MismatchedEvidence
from kvlifetime.evidence import AccessRevoked, PeerLost, TransferQuiesced
from kvlifetime.ledger import BlockLedger
from kvlifetime.prometheus import LedgerCollector


def test_collector_exports_states_quarantine_and_counters() -> None:
    ledger = BlockLedger(16)
    ids = ledger.allocate("a", 4, deadline=5.0)
    g = ledger.grant("a", "prefill-0", ids)
    ledger.reject("a")
    ledger.allocate("b", 2)
    assert ledger.expire(6.0) == ["a"]
    with pytest.raises(MismatchedEvidence):
        ledger.apply(TransferQuiesced(g.id, "other", g.peer, 1))
    reg = CollectorRegistry()
    reg.register(LedgerCollector(ledger, name="d0", clock=lambda: 9.0))
    text = generate_latest(reg).decode()
    assert 'kvlifetime_blocks{ledger="d0",state="quarantined"} 4.0' in text
    assert 'kvlifetime_blocks{ledger="d0",state="owned"} 2.0' in text
    assert 'kvlifetime_blocks{ledger="d0",state="free"} 10.0' in text
    assert 'kvlifetime_requests{ledger="d0",state="quarantined"} 1.0' in text
    assert 'kvlifetime_quarantined_blocks{ledger="d0",reason="deadline"} 4.0' in text
    assert 'kvlifetime_quarantine_oldest_age_seconds{ledger="d0"} 3.0' in text
    assert 'kvlifetime_refused_evidence_total{kind="mismatched_evidence",ledger="d0"} 1.0' in text
    assert 'kvlifetime_unsafe_releases_total{ledger="d0"} 0.0' in text
    ledger.force_release("a", "operator")
    text = generate_latest(reg).decode()
    assert 'kvlifetime_unsafe_releases_total{ledger="d0"} 1.0' in text
    assert 'kvlifetime_blocks{ledger="d0",state="free"} 14.0' in text


def test_collector_counts_blocks_reclaimed_by_each_fence() -> None:
    ledger = BlockLedger(8)
    ids = ledger.allocate("a", 4)
    ledger.grant("a", "prefill-0", ids)
    ledger.reject("a")
    ledger.apply(PeerLost("prefill-0"))  # quarantined: a heartbeat failed
    reg = CollectorRegistry()
    reg.register(LedgerCollector(ledger, name="d0"))
    text = generate_latest(reg).decode()
    assert 'kvlifetime_quarantined_blocks{ledger="d0",reason="peer_lost"} 4.0' in text
    assert "kvlifetime_reclaimed_blocks_total{" not in text
    ledger.apply(AccessRevoked("prefill-0", fence="target_recreated"))
    ledger.collect_releasable()
    text = generate_latest(reg).decode()
    assert 'kvlifetime_reclaimed_blocks_total{fence="target_recreated",ledger="d0"} 4.0' in text
    assert 'kvlifetime_blocks{ledger="d0",state="free"} 8.0' in text


def test_guard_collector_exports_what_the_vllm_guard_kept_from_vllm() -> None:
    from kvlifetime.integrations.vllm import ConnectorGuard
    from kvlifetime.prometheus import GuardCollector

    g = ConnectorGuard(8)
    g.admitted("p1")
    assert g.finished("p1", (1, 2), delay=True, aborted=False)
    g.output({"p1"}, None, lease_reaped=frozenset({"p1"}))
    g.output({"ghost"}, None)
    reg = CollectorRegistry()
    reg.register(GuardCollector(g, name="prefill0"))
    text = generate_latest(reg).decode()
    assert 'kvlifetime_vllm_withheld_requests{ledger="prefill0"} 1.0' in text
    assert 'kvlifetime_vllm_lease_reaped_total{ledger="prefill0"} 1.0' in text
    assert 'kvlifetime_vllm_dropped_ids_total{kind="unknown_id",ledger="prefill0"} 1.0' in text
    assert 'kvlifetime_quarantined_blocks{ledger="prefill0",reason="lease_expired"} 2.0' in text


def test_guard_collector_exports_the_failed_loads_held() -> None:
    from kvlifetime.integrations.vllm import ConnectorGuard
    from kvlifetime.prometheus import GuardCollector

    g = ConnectorGuard(8)
    g.admitted("d1")
    g.allocated("d1", (1, 2), num_external_tokens=32, load_async=True)
    g.output(None, {"d1"}, failed_recving={"d1"})  # a live request: held until a fence
    reg = CollectorRegistry()
    reg.register(GuardCollector(g, name="decode0"))
    text = generate_latest(reg).decode()
    assert 'kvlifetime_vllm_failed_loads_held{ledger="decode0"} 1.0' in text
    assert 'kvlifetime_vllm_load_failed_total{ledger="decode0"} 1.0' in text
