"""``kvlifetime replay``: recorded logs checked against the tables and the evidence rules."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Any

import pytest
from structlog.testing import capture_logs

from kvlifetime.cli import main
from kvlifetime.evidence import (
    CancelReceived,
    LeaseExpired,
    SchedulingStopped,
    TransferQuiesced,
)
from kvlifetime.ledger import BlockLedger
from kvlifetime.testing import to_jsonl
from kvlifetime.verify.replay import read_log, replay


def _session() -> list[dict[str, Any]]:
    """A real ledger's log: a rejected request proven over, a stale ack, a normal finish."""
    led = BlockLedger(4, incarnation="orig")
    with capture_logs() as logs:
        ids = led.allocate("a", 2)
        g = led.grant("a", "p1", ids)
        led.reject("a")
        led.apply(CancelReceived.of(g))
        led.apply(SchedulingStopped.of(g, 1))
        led.apply(TransferQuiesced.of(g, 1))
        led.collect_releasable()
        with contextlib.suppress(Exception):
            led.apply(TransferQuiesced.of(g, 1))
        ids2 = led.allocate("b", 1)
        led.grant("b", "p2", ids2)
        led.finish("b")
    return [dict(e) for e in logs]


def _records(logs: list[dict[str, Any]]) -> list[tuple[int, dict[str, Any]]]:
    return read_log(to_jsonl(logs).splitlines())


def test_a_real_log_replays_clean() -> None:
    rep = replay(_records(_session()))
    assert rep.ok and rep.mode == "full", rep.to_text()
    assert rep.steps > 10


def test_a_tampered_transition_is_the_first_illegal_step() -> None:
    logs = _session()
    # An engine that took "cancel received" for "transfer stopped": it logs scheduling_stopped
    # where only cancel_received was proven.
    i = next(
        i
        for i, e in enumerate(logs)
        if e["event"] == "request_transition" and e["transition"] == "cancel_received"
    )
    logs[i] = {**logs[i], "transition": "scheduling_stopped", "to_state": "scheduling_stopped"}
    rep = replay(_records(logs))
    assert not rep.ok and rep.illegal is not None
    assert rep.illegal.record["transition"] == "scheduling_stopped"
    assert len(rep.illegal.before) >= 3  # the steps before it are shown
    assert "illegal" in rep.to_text()


def test_a_refusal_that_the_rules_would_accept_is_illegal() -> None:
    logs = _session()
    i = next(i for i, e in enumerate(logs) if e["event"] == "evidence_refused")
    logs[i] = {**logs[i], "error": "contradictory_evidence"}
    rep = replay(_records(logs))
    assert not rep.ok and "stale_evidence" in rep.illegal.reason  # type: ignore[union-attr]


def _t(req: str, ev: str, src: str, dst: str, cause: str) -> dict[str, Any]:
    return {
        "event": "request_transition",
        "request": req,
        "transition": ev,
        "from_state": src,
        "to_state": dst,
        "cause": cause,
    }


def test_transition_only_log_legal_and_illegal() -> None:
    good = [
        _t("x", "rejected", "admitted", "rejected", "reject"),
        _t("x", "cancel_received", "rejected", "cancel_received", "CancelReceived"),
        _t("x", "quarantined", "cancel_received", "quarantined", "LeaseExpired"),
        _t("x", "transfer_quiesced", "quarantined", "transfer_quiesced", "AccessRevoked"),
        _t("x", "released", "transfer_quiesced", "released", "collect_releasable"),
    ]
    rep = replay(list(enumerate(good, 1)))
    assert rep.ok and rep.mode == "transitions"
    # A lease reaper "proving" the transfer over:
    bad = [*good[:3], _t("x", "transfer_quiesced", "quarantined", "transfer_quiesced", "expire")]
    rep = replay(list(enumerate(bad, 1)))
    assert not rep.ok and rep.illegal is not None and rep.illegal.line == 4
    # No such row: released straight from rejected.
    rep = replay(
        list(enumerate([good[0], _t("x", "released", "rejected", "released", "release")], 1))
    )
    assert not rep.ok and "no transition" in rep.illegal.reason  # type: ignore[union-attr]


def test_quarantine_by_lease_replays() -> None:
    led = BlockLedger(2, incarnation="o2")
    with capture_logs() as logs:
        ids = led.allocate("q", 1)
        g = led.grant("q", "p", ids)
        led.reject("q")
        led.apply(LeaseExpired.of(g))
    assert replay(_records([dict(e) for e in logs])).ok


def test_cli_replay(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    good = tmp_path / "good.jsonl"
    good.write_text(to_jsonl(_session()))
    assert main(["replay", str(good)]) == 0
    bad = tmp_path / "bad.jsonl"
    lines = [
        _t("x", "rejected", "admitted", "rejected", "reject"),
        _t("x", "released", "rejected", "released", "release"),
    ]
    bad.write_text("".join(json.dumps(x) + "\n" for x in lines))
    capsys.readouterr()
    assert main(["replay", str(bad), "--format", "json"]) == 1
    doc = json.loads(capsys.readouterr().out)
    assert doc["ok"] is False and doc["illegal"]["line"] == 2
    junk = tmp_path / "junk.jsonl"
    junk.write_text("not json\n")
    assert main(["replay", str(junk)]) == 2
