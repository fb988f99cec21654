"""The Grafana dashboard (grafana/kvlifetime.json): every metric it queries is one the real
collectors export (the ledger's, the vLLM guard's, the SGLang guard's), and every metric they
export is on it."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from kvlifetime.evidence import AccessRevoked, PeerLost
from kvlifetime.ledger import BlockLedger
from kvlifetime.prometheus import GuardCollector, LedgerCollector

DASHBOARD = Path(__file__).resolve().parent.parent / "grafana" / "kvlifetime.json"
_METRIC = re.compile(r"\bkvlifetime_[a-z_]+\b")


def _panels(dash: Mapping[str, Any]) -> Iterator[Mapping[str, Any]]:
    for p in dash["panels"]:
        yield p
        yield from p.get("panels", [])


def _queried(dash: Mapping[str, Any]) -> dict[str, set[str]]:
    """Metric name -> the titles of the panels that query it (and the variables)."""
    out: dict[str, set[str]] = {}
    for p in _panels(dash):
        for t in p.get("targets", []):
            for m in _METRIC.findall(t["expr"]):
                out.setdefault(m, set()).add(p["title"])
    for v in dash["templating"]["list"]:
        for m in _METRIC.findall(json.dumps(v.get("query", ""))):
            out.setdefault(m, set()).add(f"${v['name']}")
    return out


def _exported() -> set[str]:
    """Every metric the three collectors export, each after doing some work (counters as
    NAME_total, as Prometheus stores them)."""
    from prometheus_client import generate_latest

    from kvlifetime.integrations.sglang.guard import SGLangGuard
    from kvlifetime.integrations.sglang.metrics import SGLangGuardCollector
    from kvlifetime.integrations.vllm import ConnectorGuard

    ledger = BlockLedger(8)
    ids = ledger.allocate("a", 4)
    ledger.grant("a", "prefill-0", ids)
    ledger.reject("a")
    ledger.apply(PeerLost("prefill-0"))
    ledger.apply(AccessRevoked("prefill-0", fence="target_recreated"))
    ledger.collect_releasable()
    vllm = ConnectorGuard(8)
    vllm.admitted("p1")
    vllm.finished("p1", (1, 2), delay=True, aborted=False)
    vllm.output({"ghost"}, None)
    sglang = SGLangGuard(role="decode")
    sglang.bind(16)
    reg = CollectorRegistry()
    reg.register(LedgerCollector(ledger, name="d0", clock=lambda: 1.0))
    reg.register(GuardCollector(vllm, name="vllm0"))
    reg.register(SGLangGuardCollector(sglang, name="sglang0", clock=lambda: 1.0))
    text = generate_latest(reg).decode()
    names = set()
    for fam in text_string_to_metric_families(text):
        # a family with no sample yet (no evidence refused, say) is exported all the same
        names.add(f"{fam.name}_total" if fam.type == "counter" else fam.name)
        names.update(s.name for s in fam.samples)
    return names


def test_every_metric_the_dashboard_queries_is_exported_and_every_one_is_shown() -> None:
    dash = json.loads(DASHBOARD.read_text(encoding="utf-8"))
    queried = _queried(dash)
    exported = {n for n in _exported() if n.startswith("kvlifetime_")}
    missing = {m: sorted(where) for m, where in queried.items() if m not in exported}
    assert missing == {}, f"the dashboard queries metrics no collector exports: {missing}"
    unshown = exported - set(queried) - {n.removesuffix("_total") for n in queried}
    unshown -= {n for n in exported if n.endswith("_created")}  # prometheus_client's own
    assert unshown == set(), f"exported but on no panel: {sorted(unshown)}"


def test_the_dashboard_is_a_grafana_dashboard() -> None:
    dash = json.loads(DASHBOARD.read_text(encoding="utf-8"))
    assert dash["uid"] == "kvlifetime" and dash["schemaVersion"] >= 36
    panels = list(_panels(dash))
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids))
    names = {v["name"] for v in dash["templating"]["list"]}
    assert names == {"datasource", "ledger"}
    for p in panels:
        if p["type"] == "row":
            continue
        assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, p["title"]
        assert p["targets"] and p["description"], p["title"]
        for t in p["targets"]:
            assert 'ledger=~"$ledger"' in t["expr"], (p["title"], t["expr"])
        g = p["gridPos"]
        assert g["x"] >= 0 and g["x"] + g["w"] <= 24, p["title"]


def test_the_check_sees_a_metric_that_does_not_exist() -> None:
    dash = json.loads(DASHBOARD.read_text(encoding="utf-8"))
    dash["panels"][1]["targets"][0]["expr"] = "sum(kvlifetime_no_such_metric)"
    assert "kvlifetime_no_such_metric" not in _exported()
    assert "kvlifetime_no_such_metric" in _queried(dash)
