"""``kvlifetime replay``: recorded logs checked against the tables and the evidence rules."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import attrs
import pytest
from structlog.testing import capture_logs

from kvlifetime.cli import main
from kvlifetime.errors import StaleEvidence
from kvlifetime.evidence import (
    CancelReceived,
    Evidence,
    LeaseExpired,
    SchedulingStopped,
    TransferQuiesced,
)
from kvlifetime.ledger import BlockLedger
from kvlifetime.testing import to_jsonl
from kvlifetime.verify.replay import read_log, replay


def _refused_as_stale(led: BlockLedger, evidence: Evidence, logs: list[Any]) -> None:
    """Evidence for a grant of a released request: ``StaleEvidence``, logged once as refused,
    counted, nothing else changed."""
    before, stats, seen = led.fingerprint(), led.stats(), len(logs)
    with pytest.raises(StaleEvidence) as info:
        led.apply(evidence)
    assert info.value.kind == "stale_evidence"
    assert [(e["event"], e["error"]) for e in logs[seen:]] == [
        ("evidence_refused", "stale_evidence")
    ]
    assert led.fingerprint() == before
    counted = dict(stats.refused_evidence)
    counted["stale_evidence"] = counted.get("stale_evidence", 0) + 1
    assert led.stats() == attrs.evolve(stats, refused_evidence=counted)


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
        _refused_as_stale(led, TransferQuiesced.of(g, 1), logs)
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
    capsys.readouterr()
    assert main(["replay", str(junk)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"kvlifetime replay: error: {junk}: line 1: not JSON")
    assert err.count("\n") == 1


# --------------------------------------------------------------------------- every field checked


def _rich_session() -> list[dict[str, Any]]:
    """A log with every event and field a full log carries: shared blocks, a peer lost, a
    fence, a refusal, a force release, a normal release."""
    from kvlifetime.evidence import AccessRevoked, PeerLost, TransferCompleted
    from kvlifetime.source import LOCAL

    with capture_logs() as logs:
        led = BlockLedger(8, incarnation="rich")
        a = led.allocate("a", 2)
        ga = led.grant("a", "p1", a)
        led.reject("a")
        led.apply(CancelReceived.of(ga))
        led.apply(CancelReceived.of(ga))  # a duplicate: changed=False
        led.apply(SchedulingStopped.of(ga, 2))
        led.apply(TransferQuiesced.of(ga, 2))
        led.collect_releasable()
        _refused_as_stale(led, TransferQuiesced.of(ga, 2), logs)  # stale now
        b = led.allocate("b", 2)
        gb = led.grant("b", "p2", b)
        led.finish("b")
        led.apply(PeerLost("p2", source=LOCAL))
        led.apply(AccessRevoked(peer="p2", grant_id=gb.id, request="b", source=LOCAL))
        led.collect_releasable()
        c = led.allocate("c", 1)
        led.grant("c", "p1", c)
        led.reject("c")
        led.force_release("c", "test")
        d = led.allocate("d", 1)
        gd = led.grant("d", "p3", d)
        led.finish("d")
        led.apply(TransferCompleted.of(gd, 1))
        led.release("d")
        # a restart: a second life over the same arena, its blocks quarantined until fenced
        led = BlockLedger.after_restart(8, peers=["p1", "p2"], exposed=[0, 1, 2], incarnation="r2")
        led.apply(AccessRevoked("p1", fence="f"))
        led.apply(AccessRevoked("p2", fence="f"))
        led.collect_releasable()
        e = led.allocate("e", 1)
        led.grant("e", "p1", e)
        led.reject("e")
        led.force_release("e", "test")
    return [dict(e) for e in logs]


_CAUSE_SWAP = {
    "CancelReceived": "LeaseExpired",
    "SchedulingStopped": "TransferQuiesced",
    "TransferQuiesced": "TransferCompleted",
    "TransferCompleted": "AccessRevoked",
    "AccessRevoked": "PeerLost",
    "PeerLost": "LeaseExpired",
    "reject": "finish",
    "finish": "reject",
    "collect_releasable": "release",
    "release": "force_release",
    "force_release": "release",
}


def _mutated(field: str, v: Any) -> Any:
    if field == "num_blocks":  # checked as a bound: every block the life names is below it
        return 1
    if field == "cause":
        return _CAUSE_SWAP.get(v, f"{v}-x")
    if field in ("from_state", "to_state", "transition"):
        return "finished" if v != "finished" else "rejected"
    if isinstance(v, bool):
        return not v
    if isinstance(v, int):
        return v + 1
    if v is None:
        return "x"
    if isinstance(v, str):
        return f"{v}-x"
    if isinstance(v, list):
        if not v:
            return [0]
        return [v[0] + 5 if isinstance(v[0], int) else f"{v[0]}-x", *v[1:]]
    if isinstance(v, dict):  # evidence: about another grant, or from another peer
        if v.get("grant_id"):
            return {**v, "grant_id": [v["grant_id"][0], v["grant_id"][1] + 100]}
        return {**v, "peer": f"{v.get('peer')}-x"}
    raise AssertionError(f"no mutation for {field}={v!r}")


def test_the_rich_log_carries_exactly_the_checked_fields() -> None:
    from kvlifetime.verify.replay import CHECKED_FIELDS, NOT_CHECKED

    logs = _rich_session()
    seen: dict[str, set[str]] = {}
    for e in logs:
        seen.setdefault(e["event"], set()).update(set(e) - NOT_CHECKED)
    assert seen == {k: set(v) for k, v in CHECKED_FIELDS.items()}
    assert replay(_records(logs)).ok


def test_every_field_of_a_full_log_is_checked() -> None:
    """For each (event, field), some record of the rich log, with that field changed, no
    longer replays: no field is carried and ignored."""
    from kvlifetime.verify.replay import CHECKED_FIELDS

    logs = _rich_session()
    unchecked = []
    for event, fields in CHECKED_FIELDS.items():
        for field in sorted(fields):
            caught = False
            for i, e in enumerate(logs):
                if e["event"] != event or field not in e:
                    continue
                tampered = [*logs[:i], {**e, field: _mutated(field, e[field])}, *logs[i + 1 :]]
                if not replay(_records(tampered)).ok:
                    caught = True
                    break
            if not caught:
                unchecked.append(f"{event}.{field}")
    assert unchecked == []


def test_a_cause_swapped_from_cancel_received_to_lease_expired_is_caught() -> None:
    logs = _session()
    hits = [
        i
        for i, e in enumerate(logs)
        if e["event"] == "request_transition" and e["cause"] == "CancelReceived"
    ]
    assert hits
    for i in hits:
        tampered = [*logs[:i], {**logs[i], "cause": "LeaseExpired"}, *logs[i + 1 :]]
        rep = replay(_records(tampered))
        assert not rep.ok and rep.illegal is not None
        assert rep.illegal.line == i + 1 and "cause='LeaseExpired'" in rep.illegal.reason


# --------------------------------------------------------------------------- refused input


@pytest.mark.parametrize("text", ["", "\n\n", '{"foo": 1}\n', '{"event": "hello"}\n'])
def test_a_log_with_no_kvlifetime_event_is_refused(
    text: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from kvlifetime.errors import UsageError
    from kvlifetime.verify.replay import NothingToCheck

    path = tmp_path / "log.jsonl"
    path.write_text(text)
    assert main(["replay", str(path)]) == 3
    out, err = capsys.readouterr()
    assert out == "" and "no kvlifetime event" in err and "legal" not in err
    assert err.count("\n") == 1 and "--log-json FILE" in err  # the refusal says how to make one
    with pytest.raises(NothingToCheck) as info:
        replay(read_log(text.splitlines()))
    assert isinstance(info.value, UsageError)


def test_a_huge_block_id_costs_one_slot() -> None:
    import tracemalloc

    logs = _session()
    big = 2_000_000_000
    for e in logs:
        if "blocks" in e:
            e["blocks"] = [big + b for b in e["blocks"]]
    tracemalloc.start()
    try:
        rep = replay(_records(logs))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert rep.ok, rep.to_text()
    assert peak < 64 << 20  # the dense map; a block array of 2e9 entries would be GiBs


def test_block_ids_that_are_not_non_negative_integers_are_illegal() -> None:
    for bad in ([-1], [1.5], [True], "0"):
        logs = _session()
        i = next(i for i, e in enumerate(logs) if e["event"] == "grant_opened")
        logs[i] = {**logs[i], "blocks": bad}
        rep = replay(_records(logs))
        assert not rep.ok and "non-negative integers" in rep.illegal.reason  # type: ignore[union-attr]


def test_a_line_over_the_limit_is_refused_without_reading_it_whole(tmp_path: Path) -> None:
    import io

    from kvlifetime.verify.replay import MAX_LINE_CHARS, read_log_file

    long = '{"event": "request_admitted", "request": "' + "x" * MAX_LINE_CHARS + '"}\n'
    with pytest.raises(ValueError, match="line 1: longer than"):
        read_log_file(io.StringIO(long))
    path = tmp_path / "long.jsonl"
    path.write_text(long)
    assert main(["replay", str(path)]) == 2
    deep = "[" * 100_000 + "]" * 100_000
    with pytest.raises(ValueError, match="line 1"):
        read_log([deep])


@pytest.mark.parametrize("event", [[], ["request_admitted"], {}, {"a": 1}, 7, None])
def test_an_event_that_is_not_a_string_is_unreadable(tmp_path: Path, event: object) -> None:
    """Found by fuzzing: an unhashable event was a TypeError from the replay (a crash)."""
    lines = to_jsonl(_session()).splitlines()
    bad = json.dumps({**json.loads(lines[2]), "event": event})
    with pytest.raises(ValueError, match="line 3: its event is not a string"):
        read_log([*lines[:2], bad, *lines[3:]])
    path = tmp_path / "bad.jsonl"
    path.write_text("\n".join([*lines[:2], bad, *lines[3:]]) + "\n")
    assert main(["replay", str(path)]) == 2


def test_replay_verbose_logs_each_step(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    good = tmp_path / "good.jsonl"
    good.write_text(to_jsonl(_session()))
    capsys.readouterr()
    assert main(["replay", str(good)]) == 0
    assert capsys.readouterr().err == ""
    assert main(["-v", "replay", str(good)]) == 0
    err = capsys.readouterr().err
    assert err.count("replay_step") == len(_session()) and "replay_checked" in err
