"""``--log-json FILE``: what ``simulate`` and ``demo`` write is the log ``replay`` checks."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import structlog

from kvlifetime.cli import main
from kvlifetime.cli.eventlog import event_log, run_log_path
from kvlifetime.verify.replay import KNOWN_EVENTS

Capsys = pytest.CaptureFixture[str]


def test_simulate_log_json_round_trips_through_replay(capsys: Capsys, tmp_path: Path) -> None:
    before = structlog.get_config()
    log = tmp_path / "events.jsonl"
    argv = ["simulate", "--direction", "pull", "--policy", "timeout", "--requests", "60"]
    assert main([*argv, "--seed", "4", "--log-json", str(log)]) == 0
    assert structlog.get_config() == before  # the run's configuration is put back
    records = [json.loads(line) for line in log.read_text(encoding="utf-8").splitlines()]
    kinds = {r["event"] for r in records}
    assert {"request_admitted", "grant_opened", "request_transition", "request_released"} <= kinds
    capsys.readouterr()
    assert main(["replay", str(log)]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"replay (full): {len(records)} steps, every one legal")


@pytest.mark.parametrize(
    "argv",
    [
        ["--policy", "proof"],  # prefix-cache sharing (blocks_held), quarantine by deadline
        ["--policy", "naive"],
        ["--direction", "pull", "--policy", "proof"],
    ],
)
def test_push_and_pull_logs_replay_clean(capsys: Capsys, tmp_path: Path, argv: list[str]) -> None:
    log = tmp_path / "events.jsonl"
    assert (
        main(["simulate", *argv, "--requests", "150", "--seed", "5", "--log-json", str(log)]) == 0
    )
    capsys.readouterr()
    assert main(["replay", str(log)]) == 0, capsys.readouterr()
    assert "every one legal" in capsys.readouterr().out


def test_a_tampered_simulate_log_is_refused_by_replay(capsys: Capsys, tmp_path: Path) -> None:
    """The round trip can fail: the same log with one release moved earlier is illegal."""
    log = tmp_path / "events.jsonl"
    argv = ["simulate", "--direction", "pull", "--policy", "timeout", "--requests", "60"]
    assert main([*argv, "--seed", "4", "--log-json", str(log)]) == 0
    lines = log.read_text(encoding="utf-8").splitlines()
    first = next(i for i, line in enumerate(lines) if '"request_released"' in line)
    lines[first] = lines[first].replace('"blocks": [', '"blocks": [999999, ')
    log.write_text("\n".join(lines) + "\n", encoding="utf-8")
    capsys.readouterr()
    assert main(["replay", str(log)]) == 1
    assert f"ILLEGAL step at line {first + 1}" in capsys.readouterr().out


def _restart_log(tmp_path: Path, mode: str) -> list[str]:
    log = tmp_path / f"restart-{mode}.jsonl"
    argv = ["simulate", "--restart", mode, "--requests", "120", "--seed", "3"]
    assert main([*argv, "--log-json", str(log)]) == 0
    return log.read_text(encoding="utf-8").splitlines()


def _replay_lines(capsys: Capsys, tmp_path: Path, lines: list[str]) -> tuple[int, str]:
    log = tmp_path / "edited.jsonl"
    log.write_text("\n".join(lines) + "\n", encoding="utf-8")
    capsys.readouterr()
    code = main(["replay", str(log)])
    return code, capsys.readouterr().out


@pytest.mark.parametrize("mode", ["guarded", "naive"])
def test_a_decode_restart_log_replays_as_two_lives(
    capsys: Capsys, tmp_path: Path, mode: str
) -> None:
    """A restart's log holds two ledgers' lives, one after the other: replay starts a fresh
    ledger at the second ``ledger_started`` (and, guarded, rebuilds ``after_restart``)."""
    lines = _restart_log(tmp_path, mode)
    kinds = [json.loads(line)["event"] for line in lines]
    assert kinds.count("ledger_started") == 2
    assert kinds.count("ledger_restarted") == (1 if mode == "guarded" else 0)
    code, out = _replay_lines(capsys, tmp_path, lines)
    assert code == 0, out
    steps = sum(1 for k in kinds if k in KNOWN_EVENTS)  # the harness logs its own events too
    assert out.startswith(f"replay (full): {steps} steps, every one legal")


def test_a_tampered_restart_log_is_refused(capsys: Capsys, tmp_path: Path) -> None:
    """Each edit of the restart's part of the log is an illegal step, found where it is."""
    lines = _restart_log(tmp_path, "guarded")
    at = next(i for i, line in enumerate(lines) if '"ledger_restarted"' in line)
    rec = json.loads(lines[at])
    # the restart's own write grants, quarantining the arena: one dropped
    grant = next(i for i in range(at, len(lines)) if '"grant_opened"' in lines[i])
    code, out = _replay_lines(capsys, tmp_path, lines[:grant] + lines[grant + 1 :])
    assert code == 1 and "ILLEGAL" in out
    # a peer left out of the restart: the fresh ledger opens one grant fewer
    fewer = json.dumps({**rec, "peers": rec["peers"][:-1] or ["someone-else"]})
    code, out = _replay_lines(capsys, tmp_path, [*lines[:at], fewer, *lines[at + 1 :]])
    assert code == 1 and f"ILLEGAL step at line {at + 1}" not in out and "ILLEGAL" in out
    # a grant of the first life opened in the second one (its incarnation gives it away)
    first = json.loads(next(line for line in lines if '"grant_opened"' in line))
    old_incarnation = first["grant"].split("#")[0]
    later = next(
        i
        for i in range(grant + 1, len(lines))
        if '"grant_opened"' in lines[i] and json.loads(lines[i])["request"] != rec["request"]
    )
    forged = json.loads(lines[later])
    forged["grant"] = f"{old_incarnation}#{forged['grant'].split('#')[1]}9"
    code, out = _replay_lines(
        capsys, tmp_path, [*lines[:later], json.dumps(forged), *lines[later + 1 :]]
    )
    assert code == 1 and f"ILLEGAL step at line {later + 1}" in out
    assert "incarnation" in out


def test_event_log_puts_back_the_configuration_it_found(tmp_path: Path) -> None:
    structlog.configure(processors=[structlog.processors.KeyValueRenderer()])
    try:
        configured = structlog.get_config()
        with event_log(tmp_path / "a" / "e.jsonl"):
            structlog.get_logger("kvlifetime").info("request_admitted", request=1)
        assert structlog.get_config() == configured
    finally:
        structlog.reset_defaults()
    assert not structlog.is_configured()
    (line,) = (tmp_path / "a" / "e.jsonl").read_text(encoding="utf-8").splitlines()
    assert json.loads(line)["event"] == "request_admitted"


def test_an_unwritable_log_refuses_before_the_run(capsys: Capsys, tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    status = main(["simulate", "--requests", "5", "--log-json", str(blocker / "e.jsonl")])
    out, err = capsys.readouterr()
    assert (status, out) == (1, "")
    assert err == f"kvlifetime simulate: error: {blocker}: file exists\n"


def test_demo_log_json_names_one_file_per_run() -> None:
    assert run_log_path(Path("out/events.jsonl"), 3) == Path("out/events-03.jsonl")
    assert run_log_path(Path("ev"), 10) == Path("ev-10.jsonl")
