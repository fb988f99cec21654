"""Issue 20 item 5 (b), vLLM #58222 ("NIXL lease reaper strands expired KV blocks behind a
heartbeated head entry"): the prefill worker keeps its send leases in one insertion-ordered map,
and entries meet the reaper out of expiry order, for two reasons: a heartbeat extends a lease in
place (the entry keeps its early position), and two TTLs share the map (NIXL's short send lease,
30 s by default, and the decode-cached blocks' 480 s). The reaper of that report stopped at the
first entry still live, so an expired lease behind a heartbeated head was never reaped (blocks
held for ever: a leak, not an unsafe free).

vLLM 0.33's reaper scans every entry (the fix). Driven here with vLLM's own reaper and heartbeat
handler (``reaping_connector.py``) on one map holding all three kinds, in the order of the
report: a heartbeated head, an expired lease behind it, a 480 s lease at the tail. The reaper
now reaches the expired lease, and reaping it frees it: a lease running out proves nothing
about a READ the decode side may still have in flight. Guarded, exactly the reaped request is
quarantined whatever its position in the map, the heartbeated one is handed back when its reader
says it is done, and the long-lived one stays exposed, visible in ``stats()``.

What the guard cannot do: reap. Under the old reaper the stranded request would stay exposed
(``stats().exposed``) until a report or a fence; it is counted, not freed.
"""

from __future__ import annotations

from typing import Any

from reaping_connector import report, worker
from vllm.v1.request import Request

from kvlifetime.integrations.vllm.connector import GuardedConnector
from kvlifetime.integrations.vllm.guard import ConnectorGuard
from kvlifetime.integrations.vllm.testing import (
    blocks_of,
    config,
    free_in_pool,
    kv_cache_config,
    output,
    request,
    scheduler,
    step,
)

INNER: dict[str, Any] = {"inner": "ReapingConnector", "inner_module": "reaping_connector"}


def _three_leases(guarded: bool) -> tuple[Any, Any, dict[str, Request], dict[str, list[int]]]:
    """Three prefill requests done, their blocks waiting for remote readers; the worker's lease
    map, in insertion order: the heartbeated head, the expired one, the 480 s one."""
    s = scheduler(guarded=guarded, **INNER)
    reqs = {name: request(remote_decode=True) for name in ("heartbeated", "expired", "long")}
    for r in reqs.values():
        s.add_request(r)
    step(s, output(reqs.values()))
    ids = {name: blocks_of(s, r) for name, r in reqs.items()}
    assert all(ids.values()) and not free_in_pool(s, [b for v in ids.values() for b in v])
    w = worker(guarded, config(guarded=guarded, **INNER), kv_cache_config())
    leases = w.connector_worker
    leases.lease(reqs["heartbeated"].request_id, -1.0)  # its 30 s ran out, but ...
    leases.lease(reqs["expired"].request_id, -1.0)  # its decode stopped heartbeating
    leases.lease(reqs["long"].request_id, 480.0)  # decoder_kv_blocks_ttl
    leases._handle_heartbeat(reqs["heartbeated"].request_id)  # ... its decode heartbeats
    order = list(leases._reqs_to_send)
    assert order == [r.request_id for r in reqs.values()]  # the head is live, then expired
    return s, w, reqs, ids


def _reap(guarded: bool) -> tuple[Any, Any, dict[str, Request], dict[str, list[int]]]:
    s, w, reqs, ids = _three_leases(guarded)
    out = report(w)
    # vLLM's reaper reached the entry behind the live head, and only that one.
    assert out.kv_connector_output.finished_sending == {reqs["expired"].request_id}
    step(s, out)
    return s, w, reqs, ids


def test_vllm_alone_frees_the_lease_reaped_behind_a_live_head() -> None:
    s, _w, _reqs, ids = _reap(False)
    assert free_in_pool(s, ids["expired"]) == ids["expired"]


def _guard(s: Any) -> ConnectorGuard:
    c = s.connector
    assert isinstance(c, GuardedConnector) and c.guard is not None
    return c.guard


def test_guard_quarantines_exactly_the_reaped_lease() -> None:
    s, w, reqs, ids = _reap(True)
    g = _guard(s)
    assert free_in_pool(s, [b for v in ids.values() for b in v]) == []
    st = g.stats()
    assert st.lease_reaped == 1 and st.withheld == 3 and st.exposed == 3
    assert [q.request for q in st.ledger.quarantined] == [reqs["expired"].request_id]
    # The heartbeated request's reader finishes: handed back, freed as vLLM does.
    w.notified.add(reqs["heartbeated"].request_id)
    step(s, report(w))
    assert free_in_pool(s, ids["heartbeated"]) == ids["heartbeated"]
    assert free_in_pool(s, ids["expired"] + ids["long"]) == []
    st = g.stats()
    assert st.handed_back == 1 and st.withheld == 2
    # The long-lived lease: still exposed, in the stats, until its reader or a fence.
    assert g.ledger.open_grants(reqs["long"].request_id)
