"""What an inner connector's failed load proves (``inner_connectors``), on vLLM's real classes,
and the guard over and under a ``MultiConnector`` (issue 33).

An in-process connector that reports a failed load only once its own job is over (vLLM 0.34's
``OffloadingConnector``) ends the load at once: vLLM recovers (recompute) or ends the request,
and its blocks move on. A connector whose peers reach the KV cache (NIXL) keeps the failed load
held until a fence. Runs in both venvs (0.33 has no ``kv_cache_access``: the class alone).
"""

from __future__ import annotations

import copy
import importlib
from typing import Any

import pytest
import vllm
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import (
    MultiKVConnectorWorkerMetadata,
)
from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import (
    OffloadingConnector,
)
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.request import Request, RequestStatus
from vllm.v1.structured_output import StructuredOutputManager

from kvlifetime.errors import InvalidField
from kvlifetime.integrations.vllm import facts, testing
from kvlifetime.integrations.vllm.connector import (
    GuardedConnector,
    GuardWorkerMeta,
    guarded_class,
    inner_evidence,
    inner_transfer_config,
)
from kvlifetime.integrations.vllm.inner_connectors import PROFILES, evidence_of
from kvlifetime.integrations.vllm.testing import (
    advance,
    blocks_of,
    free_in_pool,
    moved_on,
    output,
    request,
    step,
)

V034 = facts.series(vllm.__version__) == "0.34"
# (A MultiConnector's child entries are whole transfer configs: each names its kv_role.)
OFFLOAD = {
    "kv_connector": "OffloadingConnector",
    "kv_role": "kv_both",
    "kv_connector_extra_config": {"cpu_bytes_to_use": 1 << 20},
}
NIXL = {"kv_connector": "NixlConnector", "kv_role": "kv_both"}


def _scheduler(ktc_extra: dict[str, Any], *, inner: str, policy: str) -> Scheduler:
    cfg = testing.config(guarded=True, inner=inner, kv_load_failure_policy=policy)
    cfg.kv_transfer_config.kv_connector_extra_config["inner"].update(ktc_extra)
    return Scheduler(
        vllm_config=cfg,
        kv_cache_config=testing.kv_cache_config(64),
        log_stats=True,
        structured_output_manager=StructuredOutputManager(cfg),
        block_size=testing.BLOCK,
    )


def _guarded(s: Scheduler) -> Any:
    c = s.connector
    assert isinstance(c, GuardedConnector) and c.guard is not None
    return c


def _loads_once(c: Any) -> None:
    """The connector's lookup finds two blocks to load asynchronously, once per request (a
    failed load is not tried again, as the offloading manager does)."""
    tried: set[str] = set()

    def lookup(req: Request, n: int) -> tuple[int, bool]:
        if req.request_id in tried:
            return 0, False
        tried.add(req.request_id)
        return 2 * testing.BLOCK, True

    c.get_num_new_matched_tokens = lookup


def _offloading_load(policy: str) -> tuple[Scheduler, Request, list[int]]:
    """vLLM's scheduler with the real OffloadingConnector, guarded, and one request whose prompt
    it loads asynchronously (its lookup says two blocks are offloaded; what the offloading
    manager does with the load is not the point: it is told nothing)."""
    s = _scheduler(OFFLOAD, inner="OffloadingConnector", policy=policy)
    c = _guarded(s)
    _loads_once(c)
    c.connector_scheduler.update_state_after_alloc = lambda *a, **k: None
    r = request(tokens=3 * testing.BLOCK)
    s.add_request(r)
    step(s)
    assert r.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    ids = blocks_of(s, r)
    assert c.guard.request(r.request_id).state == "loading"
    return s, r, ids


def test_an_offloading_load_failure_ends_at_once() -> None:
    s, r, ids = _offloading_load("recompute")
    c = _guarded(s)
    assert c.inner_evidence.rows == ("offloading",)
    if not V034:
        # vLLM 0.33 has no kv_cache_access to read (and its offloading worker asserts every
        # job succeeded): a failed load is held, as for any connector.
        assert c.inner_evidence.access is None and not c.guard.failed_load_is_over
        return
    assert c.inner_evidence.access == 0
    assert c.inner_evidence.failed_load_is_over and c.guard.failed_load_is_over
    # vLLM 0.34's offloading worker reports a failed job in both sets when it has ended.
    step(s, output(failed_recving={r.request_id}, finished_recving={r.request_id}))
    advance(s, r)  # vLLM acts on the receive: the request recomputes its prompt, now
    assert r.status == RequestStatus.RUNNING
    stats = c.guard.stats()
    assert stats.failed_loads_held == 0 and stats.load_failed == 0
    assert c.guard.request(r.request_id).state == "load_received"
    assert not c.guard.stats().ledger.quarantined
    assert moved_on(s, ids) == ids


@pytest.mark.skipif(not V034, reason="0.33 holds it (test_an_offloading_load_failure_ends_at_once)")
def test_an_offloading_load_failure_under_the_fail_policy_frees_at_once() -> None:
    s, r, ids = _offloading_load("fail")
    step(s, output(failed_recving={r.request_id}, finished_recving={r.request_id}))
    step(s)
    assert r.status == RequestStatus.FINISHED_ERROR
    assert r.request_id not in s.requests
    assert free_in_pool(s, ids) == ids
    assert not _guarded(s).guard.stats().ledger.quarantined


def _offloading_ktc(**extra: Any) -> Any:
    ktc = testing.config(guarded=True, inner="OffloadingConnector").kv_transfer_config
    ktc.kv_connector_extra_config["inner"]["kv_connector_extra_config"] = extra
    return ktc


def test_an_offloading_backend_the_row_was_not_read_for_proves_nothing() -> None:
    # The backend does the copies: only the built-in CPU one was read. Tiering has a
    # peer-to-peer tier; a backend loaded from spec_module_path is anyone's code.
    default = inner_evidence(GuardedConnector, _offloading_ktc(cpu_bytes_to_use=1 << 20))
    assert default.rows == ("offloading",) and default.failed_load_is_over == V034
    named = inner_evidence(GuardedConnector, _offloading_ktc(spec_name="CPUOffloadingSpec"))
    assert named.failed_load_is_over == V034
    for extra in (
        {"spec_name": "TieringOffloadingSpec"},
        {"spec_name": "MySpec", "spec_module_path": "my.module"},
        {"spec_name": "CPUOffloadingSpec", "spec_module_path": "vllm.v1.kv_offload.cpu.spec"},
    ):
        got = inner_evidence(GuardedConnector, _offloading_ktc(**extra))
        assert got.rows == ("offloading",) and not got.failed_load_is_over, extra
        assert "not read" in got.why


def test_a_guarded_class_subclassed_by_hand_gets_no_row() -> None:
    # Only a class guarded_class built stands for its inner class; a subclass may report
    # differently (and must not crash the resolution).
    by_hand = type("MyGuarded", (GuardedConnector, OffloadingConnector), {})
    sub = type("MySub", (guarded_class(OffloadingConnector),), {})
    for cls in (by_hand, sub):
        got = inner_evidence(cls, _offloading_ktc())
        assert got.rows == (None,) and not got.failed_load_is_over, cls


_MALFORMED: list[Any] = [
    None,
    "NixlConnector",
    {"kv_connector": "NixlConnector"},
    [NIXL, 5],
    [NIXL, {"kv_role": "kv_both"}],
]


@pytest.mark.parametrize("connectors", _MALFORMED)
def test_a_malformed_multiconnector_config_is_refused(connectors: Any) -> None:
    # (An empty list is vLLM's own: a MultiConnector of no child, whose failures prove
    # nothing; test_an_empty_multiconnector_proves_nothing.)
    ktc = testing.config(guarded=True, inner="MultiConnector").kv_transfer_config
    ktc.kv_connector_extra_config["inner"]["kv_connector_extra_config"] = {"connectors": connectors}
    with pytest.raises(InvalidField, match="MultiConnector"):
        inner_evidence(GuardedConnector, ktc)


def test_an_empty_multiconnector_proves_nothing() -> None:
    ktc = testing.config(guarded=True, inner="MultiConnector").kv_transfer_config
    ktc.kv_connector_extra_config["inner"]["kv_connector_extra_config"] = {"connectors": []}
    got = inner_evidence(GuardedConnector, ktc)
    assert got.rows == () and not got.failed_load_is_over


def test_a_nixl_load_failure_waits_for_proof_or_a_fence() -> None:
    s = testing.scheduler(guarded=True, kv_load_failure_policy="recompute")
    c = _guarded(s)
    assert c.inner_evidence.rows == ("nixl",)
    assert not c.inner_evidence.failed_load_is_over and not c.guard.failed_load_is_over
    r = request(remote_prefill=True)
    s.add_request(r)
    step(s)
    ids = blocks_of(s, r)
    step(s, output(failed_recving={r.request_id}, finished_recving={r.request_id}))
    advance(s, r)
    assert r.status == RequestStatus.WAITING_FOR_REMOTE_KVS  # held: a READ may still land
    assert c.guard.stats().failed_loads_held == 1
    assert not moved_on(s, ids)
    c.guard.revoke("nixl_agent_recreated")
    advance(s, r)
    advance(s, r)
    assert r.status == RequestStatus.RUNNING


def test_an_unprofiled_connectors_load_failure_is_held_until_a_fence() -> None:
    # A connector class with no row (a test's in-process mock, a third-party connector): its
    # failed load proves nothing about what still lands, whatever its flags. vLLM alone would
    # recover at its next step (vLLM's own test_failed_load_reservation_keeps_new_async_loads_out
    # and test_cached_reservations_admit_like_on_demand_sum expect that: the two intended
    # differences in vllm-tests/intended-differences.json); guarded, the receive waits for a
    # fence, then vLLM recovers as it would have.
    s = testing.scheduler(
        guarded=True,
        inner="InertConnector",
        inner_module="inert_connector",
        kv_load_failure_policy="recompute",
    )
    c = _guarded(s)
    assert c.inner_evidence.rows == (None,) and not c.guard.failed_load_is_over
    _loads_once(c)
    r = request(tokens=3 * testing.BLOCK)
    s.add_request(r)
    step(s)
    assert r.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    ids = blocks_of(s, r)
    step(s, output(failed_recving={r.request_id}, finished_recving={r.request_id}))
    advance(s, r)
    assert r.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    assert c.guard.stats().failed_loads_held == 1 and not moved_on(s, ids)
    c.guard.revoke("fenced")
    advance(s, r)
    advance(s, r)
    assert r.status == RequestStatus.RUNNING


def _class(dotted: str) -> type[Any]:
    module, _, name = dotted.rpartition(".")
    try:
        return getattr(importlib.import_module(module), name)  # type: ignore[no-any-return]
    except ImportError:
        # (LMCache's multi-process connector imports the lmcache package, not installed here:
        # its row is looked up by name, as for the real class.)
        return type(name, (), {"__module__": module, "__qualname__": name})


@pytest.mark.parametrize("row", PROFILES, ids=[p.name for p in PROFILES])
def test_every_profiled_class_is_resolved_by_its_own_row(row: Any) -> None:
    for dotted in sorted(row.classes):
        cls = _class(dotted)
        got = evidence_of(cls, None, access=lambda c, k: 0, children=lambda k: [])
        assert got.rows == (row.name,) and got.classes == (dotted,)
        assert got.failed_load_is_over == row.failure_means_over
        # No flags to read (vLLM 0.33): no failure is taken as over.
        unread = evidence_of(cls, None, access=lambda c, k: None, children=lambda k: [])
        assert not unread.failed_load_is_over
        # Flags that say a peer reaches the KV cache veto any row.
        vetoed = evidence_of(cls, None, access=lambda c, k: 1, children=lambda k: [])
        assert not vetoed.failed_load_is_over


def test_a_class_without_a_row_proves_nothing_by_a_failure() -> None:
    sub = type("MyOffloadingConnector", (OffloadingConnector,), {})  # may report differently
    example = testing.config(guarded=False, inner="ExampleConnector").kv_transfer_config
    for cls in (sub, KVConnectorFactory.get_connector_class(example)):
        got = evidence_of(cls, None, access=lambda c, k: 0, children=lambda k: [])
        assert got.rows == (None,) and not got.failed_load_is_over


def _multi(*children: dict[str, Any]) -> dict[str, Any]:
    return {
        "kv_connector": "MultiConnector",
        "kv_connector_extra_config": {"connectors": list(children)},
    }


def test_over_a_multiconnector_a_failure_is_over_only_if_every_childs_is() -> None:
    both = testing.config(guarded=True, inner="MultiConnector").kv_transfer_config
    both.kv_connector_extra_config["inner"] = _multi(OFFLOAD, NIXL)
    got = inner_evidence(GuardedConnector, both)
    assert got.rows == ("offloading", "nixl") and not got.failed_load_is_over
    alone = testing.config(guarded=True, inner="MultiConnector").kv_transfer_config
    alone.kv_connector_extra_config["inner"] = _multi(OFFLOAD)
    assert inner_evidence(GuardedConnector, alone).failed_load_is_over == V034
    if V034:  # the class-level query answered by the MultiConnector, from its children
        inner_cls, inner_ktc = inner_transfer_config(both)
        assert GuardedConnector.kv_cache_access(both) == inner_cls.kv_cache_access(inner_ktc)
        # (NIXL with a CPU kv_buffer_device answers IN_PROCESS: it registers host staging
        # buffers, and its row, not its flags, says a peer's READ may still land.)


def _remote_decode_run(s: Scheduler) -> tuple[Request, list[int]]:
    r = request(remote_decode=True)
    s.add_request(r)
    step(s, output([r]))
    assert r.status == RequestStatus.FINISHED_LENGTH_CAPPED
    return r, blocks_of(s, r)


def test_the_guard_over_a_multiconnector_guards_its_aggregate() -> None:
    s = _scheduler(_multi(NIXL, OFFLOAD), inner="MultiConnector", policy="fail")
    c = _guarded(s)
    assert type(c).__name__ == "GuardedMultiConnector"
    assert c._kvl_requests is s.requests  # bound to the scheduler: vLLM's table is the truth
    r, ids = _remote_decode_run(s)
    assert c.guard.request(r.request_id).state == "withheld"  # the NIXL child delayed it
    # A reaped lease: quarantined; a repeated send proves nothing; an unknown id is dropped.
    step(s, output(finished_sending={r.request_id}, lease_reaped={r.request_id}))
    step(s, output(finished_sending={r.request_id, "never-seen"}))
    assert r.request_id in s.requests and not free_in_pool(s, ids)
    assert c.guard.stats().dropped.get("unknown_id") == 1
    c.guard.revoke("fenced")
    step(s)
    assert r.request_id not in s.requests and free_in_pool(s, ids) == ids


def test_the_guard_under_a_multiconnector_guards_its_own_child() -> None:
    guarded_nixl = {
        "kv_connector": "GuardedConnector",
        "kv_connector_module_path": "kvlifetime.integrations.vllm",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"inner": NIXL},
    }
    cfg = testing.config(guarded=False, inner="MultiConnector")
    cfg.kv_transfer_config.kv_connector_extra_config = {"connectors": [guarded_nixl, OFFLOAD]}
    s = Scheduler(
        vllm_config=cfg,
        kv_cache_config=testing.kv_cache_config(64),
        log_stats=True,
        structured_output_manager=StructuredOutputManager(cfg),
        block_size=testing.BLOCK,
    )
    multi = s.connector
    assert type(multi).__name__ == "MultiConnector"
    child = multi._connectors[0]
    assert isinstance(child, GuardedConnector) and child.guard is not None
    assert child._kvl_requests is None  # not the scheduler's own connector: driven by hand
    assert child.inner_evidence is not None and child.inner_evidence.rows == ("nixl",)
    if V034:  # vLLM's MultiConnector asks the guarded child's class: NIXL's answer
        plain = cfg.kv_transfer_config
        unguarded = copy.copy(plain)
        unguarded.kv_connector_extra_config = {"connectors": [NIXL, OFFLOAD]}
        assert type(multi).kv_cache_access(plain) == type(multi).kv_cache_access(unguarded)
    r, ids = _remote_decode_run(s)
    view = child.guard.request(r.request_id)
    assert view is not None and view.state == "withheld"
    # The output all children share: the guarded child keeps the reaped id from vLLM.
    reaped = output(finished_sending={r.request_id})
    reaped.kv_connector_output.kv_connector_worker_meta = MultiKVConnectorWorkerMetadata(
        metadata=(GuardWorkerMeta(None, frozenset({r.request_id})), None)
    )
    step(s, reaped)
    assert r.request_id in s.requests and not free_in_pool(s, ids)
    child.guard.revoke("fenced")
    step(s)
    # Driven by hand (no scheduler of its own), the child frees nothing itself: the id rides
    # the next connector output through the MultiConnector to vLLM.
    step(s, output(finished_sending=set()))
    assert r.request_id not in s.requests and free_in_pool(s, ids) == ids


def test_a_guarded_class_answers_with_its_inner_class() -> None:
    got = inner_evidence(guarded_class(OffloadingConnector), None)
    assert got.rows == ("offloading",) and got.failed_load_is_over == V034
