"""The harness end to end on NIXL (UCX over TCP): decode's arena served by a NIXL agent,
prefill writing into it from another process (``--backend nixl``)."""

from __future__ import annotations

import multiprocessing

import pytest
from nixl_helpers import need_nixl

from kvlifetime.adapters.engines import BACKENDS
from kvlifetime.errors import UsageError
from kvlifetime.harness.loop import run
from kvlifetime.harness.settings import PushSettings
from kvlifetime.harness.simulate import simulate

N = 1000
SEED = 11


def test_proof_has_no_contamination_and_no_leak_naive_does() -> None:
    need_nixl()
    proof = run(PushSettings(backend="nixl", policy="proof", requests=N, seed=SEED))
    assert proof.backend == "nixl" and proof.requests == N
    assert proof.contaminated_blocks == 0 and proof.contaminated_requests == 0
    assert proof.leaked_blocks == 0 and proof.quarantined_blocks == 0
    assert proof.unsafe_releases == 0
    assert proof.fences.get("nixl_target_agent_recreated", 0) >= 1  # the crash at least
    assert sum(proof.reclaimed_blocks.values()) > 0
    naive = run(PushSettings(backend="nixl", policy="naive", requests=N, seed=SEED))
    assert naive.contaminated_blocks > 0
    assert naive.unsafe_releases > 0
    assert multiprocessing.active_children() == []


def test_backend_nixl_is_offered_and_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    assert "nixl" in BACKENDS
    monkeypatch.setenv("UCX_TLS", "tcp,cma")
    with pytest.raises(UsageError, match="UCX_TLS=cma,tcp"):
        simulate("nixl", "proof", 10, 0)


def test_backend_nixl_without_nixl_is_a_usage_error(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvlifetime.adapters import nixl

    monkeypatch.setattr(nixl, "nixl_available", lambda: False)
    with pytest.raises(UsageError, match=r"pip install --no-deps nixl==1\.5\.1"):
        simulate("nixl", "proof", 10, 0)
