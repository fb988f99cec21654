"""The command line as a new user meets it: --version, help, bad numbers, -v, --json, progress,
Ctrl-C and missing extras."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import tomllib
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest
from harness_helpers import group_processes, live_processes

import kvlifetime
from kvlifetime import cli
from kvlifetime.cli import EXIT_INTERRUPTED, build_parser, main

ROOT = Path(__file__).resolve().parent.parent
Capsys = pytest.CaptureFixture[str]


def run(capsys: Capsys, *argv: str) -> tuple[int, str, str]:
    status = main(list(argv))
    out, err = capsys.readouterr()
    return status, out, err


def _subparsers() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    (sub,) = (a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)


# --------------------------------------------------------------------------- version and help


def test_version_is_the_package_version(capsys: Capsys) -> None:
    with pytest.raises(SystemExit) as info:
        build_parser().parse_args(["--version"])
    assert info.value.code == 0
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert capsys.readouterr().out == f"kvlifetime {declared}\n"
    assert kvlifetime.__version__ == declared
    assert main(["--version"]) == 0


def test_every_option_of_every_command_has_help_and_shows_its_default() -> None:
    missing = []
    for name, p in _subparsers().items():
        text = p.format_help()
        for action in p._actions:
            if isinstance(action, argparse._HelpAction):
                continue
            label = f"{name} {'/'.join(action.option_strings) or action.dest}"
            if not action.help:
                missing.append(f"{label}: no help")
            elif (
                action.option_strings
                and action.default not in (None, argparse.SUPPRESS)
                and not isinstance(action.default, bool)
                and f"default: {action.default}" not in " ".join(text.split())
                and "default" not in action.help
            ):
                missing.append(f"{label}: default {action.default!r} not shown")
    assert missing == []


def test_every_help_ends_with_the_exit_statuses() -> None:
    helps = {name: p.format_help() for name, p in _subparsers().items()}
    for name, text in helps.items():
        assert "exit status:" in text, name
        assert f"{EXIT_INTERRUPTED}  interrupted" in text, name
    assert "  3  the log holds no kvlifetime event" in helps["replay"]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["simulate", "--requests", "-5"], "argument --requests: must be >= 1, got -5"),
        (["simulate", "--requests", "ten"], "argument --requests: not an integer: 'ten'"),
        (["simulate", "--p-redeliver", "1.5"], "argument --p-redeliver: must be a probability"),
        (["simulate", "--p-redeliver", "nan"], "argument --p-redeliver: must be a probability"),
        (["simulate", "--tp-ranks", "0"], "argument --tp-ranks: must be in [1, 16], got 0"),
        (["demo", "--requests", "0"], "argument --requests: must be >= 1, got 0"),
        (["replay", "x.jsonl", "--context", "-1"], "argument --context: must be >= 0"),
    ],
)
def test_a_bad_number_names_the_option_that_was_passed(
    capsys: Capsys, argv: list[str], message: str
) -> None:
    status, out, err = run(capsys, *argv)
    assert (status, out) == (2, "")
    assert message in err


# --------------------------------------------------------------------------- -v, --json, progress


def test_verbose_works_before_or_after_the_command(capsys: Capsys) -> None:
    for argv in (["-v", "table", "request"], ["table", "request", "-v"]):
        status, out, err = run(capsys, *argv)
        assert status == 0 and out.startswith("# request lifecycle")
        assert "stdout_written" in err, argv
    status, _, err = run(capsys, "table", "request")
    assert (status, err) == (0, "")


def test_simulate_verbose_logs_its_steps_and_json_is_one_document(capsys: Capsys) -> None:
    status, out, err = run(capsys, "simulate", "--requests", "60", "--json")
    assert status == 0
    doc = json.loads(out)  # the whole of stdout, nothing before or after
    assert doc["requests"] == 60 and doc["policy"] == "proof"
    assert "kvlifetime simulate: backend=inproc" in err  # the text report, on stderr
    assert "harness_event" not in err
    status, out, err = run(capsys, "-v", "simulate", "--requests", "60")
    assert status == 0 and "harness_event" in err and "fenced" in err
    assert out.startswith("kvlifetime simulate: backend=inproc")


def test_progress_bar_only_when_asked_or_on_a_terminal(capsys: Capsys) -> None:
    from kvlifetime.cli.output import progress

    for show, drawn in ((True, True), (False, False), (None, False)):  # None: stderr's a pipe
        with progress(10, "work", "items", show=show) as bar:
            bar.set(4)
            bar.advance()
            assert bar.n == 5  # counted whether shown or not
        out, err = capsys.readouterr()
        assert out == ""
        assert ("work:" in err and "items" in err) is drawn, show
    # The harness's bar counts requests admitted.
    _, _, err = run(capsys, "simulate", "--requests", "20", "--progress")
    assert "push proof:" in err and "/20" in err and "requests" in err


# --------------------------------------------------------------------------- Ctrl-C


def test_ctrl_c_in_demo_says_which_runs_finished(
    capsys: Capsys, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from kvlifetime.harness import simulate as sim

    real = sim.settings_for
    calls = []

    def interrupted_on_the_second_run(*a: object, **kw: object) -> object:
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(*a, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(sim, "settings_for", interrupted_on_the_second_run)
    status, _, err = run(capsys, "demo", "--out", str(tmp_path), "--requests", "20")
    assert status == EXIT_INTERRUPTED
    assert err.strip().splitlines()[-1] == (
        "kvlifetime demo: interrupted: 1 of 10 harness runs finished; "
        f"{tmp_path / 'report.*'} not written"
    )
    assert not (tmp_path / "report.json").exists()


def _ignores_sigint(pid: int) -> bool:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    ignored = int(status.split("SigIgn:")[1].split()[0], 16)
    return bool(ignored & (1 << (signal.SIGINT - 1)))


def _past_start_up(pgid: int) -> bool:
    """The run is going: a peer process (and multiprocessing's resource tracker) runs, and
    every process of the group but the command itself ignores SIGINT, which a peer does from
    the moment its serving loop begins."""
    others = [p for p in group_processes(pgid) if p != pgid]
    return len(others) >= 2 and all(_ignores_sigint(p) for p in others)


def _numpy_loaded(pid: int) -> bool:
    """numpy's core is mapped in ``pid``: its imports are under way."""
    try:
        return "_multiarray_umath" in Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return False


def _peer_importing(pgid: int) -> bool:
    """A peer process of the group is still starting, and importing: spawned, numpy's core
    already loaded in it, not yet serving."""
    return any(
        b"spawn_main" in cmd and not _ignores_sigint(pid) and _numpy_loaded(pid)
        for pid, _, group, cmd in live_processes()
        if group == pgid
    )


def _importing(pgid: int) -> bool:
    """The command itself is importing: numpy's core is loaded in it, no peer is started."""
    return _numpy_loaded(pgid) and group_processes(pgid) == [pgid]


def _sigint_default() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _ctrl_c_to_simulate(
    when: Callable[[int], bool], after_s: float, command: Sequence[str] | None = None
) -> tuple[str, str]:
    """Start ``kvlifetime simulate`` (or ``command`` with its arguments) in its own process
    group, wait until ``when(pgid)`` (then ``after_s``), send SIGINT to the whole group as a
    terminal does, and return its stdout and stderr once it has exited 130 and no process of
    the group is left."""
    exe = [str(Path(sys.executable).parent / "kvlifetime")] if command is None else command
    proc = subprocess.Popen(
        [*exe, "simulate", "--requests", "1000000"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        # As a terminal's command gets it: a job started in the background by a shell without
        # job control (a CI runner, ``nohup ... &``) inherits SIGINT ignored.
        preexec_fn=_sigint_default,
    )
    try:
        deadline = time.monotonic() + 120
        while not when(proc.pid):  # however slow the machine is
            assert proc.poll() is None and time.monotonic() < deadline, "never got there"
            time.sleep(0.005)
        time.sleep(after_s)
        os.killpg(proc.pid, signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        with contextlib.suppress(ProcessLookupError):  # nothing of it outlives the test
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(30)
    assert proc.returncode == EXIT_INTERRUPTED, err
    deadline = time.monotonic() + 10
    while group_processes(proc.pid):  # the peers are reaped by the owner; give the kernel a moment
        assert time.monotonic() < deadline, "a process of the group outlived the command"
        time.sleep(0.1)
    return out, err


def test_ctrl_c_to_the_process_group_ends_simulate_cleanly() -> None:
    """What a terminal does on Ctrl-C: SIGINT to every process of the group (the harness's
    peer processes included). Exit 130, one line saying how far it got, no traceback from any
    process, and no process of the group left behind."""
    out, err = _ctrl_c_to_simulate(_past_start_up, 0.5)  # the owner ticks
    assert out == ""
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvlifetime simulate: interrupted: push proof:")
    assert lines[0].endswith(" of 1000000 requests")


def test_ctrl_c_while_a_peer_process_starts_is_as_clean() -> None:
    """The same Ctrl-C while the peer process is still importing (it starts with SIGINT
    blocked, so it cannot be interrupted before it serves and ignores it; without the block,
    its traceback was printed)."""
    out, err = _ctrl_c_to_simulate(_peer_importing, 0.0)
    assert out == ""
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvlifetime simulate: interrupted: push proof:")


def test_ctrl_c_while_the_command_imports_is_one_line() -> None:
    """A Ctrl-C in the first 0.2 s, while the command line is imported (numpy, structlog, the
    tables): exit 130 and one line, as later (it was a traceback and a death by SIGINT)."""
    out, err = _ctrl_c_to_simulate(_importing, 0.0)
    assert out == ""
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvlifetime"), err
    assert "interrupted: nothing had" in lines[0]


def test_the_entry_point_reports_a_ctrl_c_before_the_command_starts(
    monkeypatch: pytest.MonkeyPatch, capsys: Capsys
) -> None:
    import kvlifetime.__main__ as entry

    def interrupted(argv: object = None) -> int:
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "main", interrupted)
    assert entry.main(["--version"]) == EXIT_INTERRUPTED
    assert capsys.readouterr().err == "kvlifetime: interrupted: nothing had started\n"


def test_python_dash_m_kvlifetime_is_the_command() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "kvlifetime", "--version"], capture_output=True, text=True
    )
    assert done.returncode == 0 and done.stdout.strip() == f"kvlifetime {kvlifetime.__version__}"


# --------------------------------------------------------------------------- missing extras


@pytest.mark.parametrize(
    ("argv", "module", "extra"),
    [
        (["simulate", "--requests", "10"], "msgpack", "harness"),
        (["simulate", "--requests", "10"], "zmq", "harness"),
        (["demo", "--requests", "10"], "msgpack", "harness"),
        (["simulate", "--backend", "mooncake", "--requests", "10"], "mooncake", "mooncake"),
    ],
)
def test_a_missing_extra_is_one_line_naming_the_install_before_anything_runs(
    capsys: Capsys,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    argv: list[str],
    module: str,
    extra: str,
) -> None:
    monkeypatch.setitem(sys.modules, module, None)  # as if it were not installed
    if argv[0] == "demo":
        argv = [*argv, "--out", str(tmp_path)]
    status, out, err = run(capsys, *argv)
    assert (status, out) == (2, "")  # demo prints none of its contract first
    assert err.count("\n") == 1
    assert f"run pip install 'kvlifetime[{extra}]'" in err
    assert repr(module) in err
    assert list(tmp_path.iterdir()) == []


def test_the_vllm_integration_names_its_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    import kvlifetime.integrations.vllm as integration

    monkeypatch.setitem(sys.modules, "vllm", None)
    monkeypatch.delitem(sys.modules, "kvlifetime.integrations.vllm.connector", raising=False)
    with pytest.raises(kvlifetime.MissingExtra, match=r"pip install 'kvlifetime\[vllm\]'"):
        _ = integration.GuardedConnector
    # the sans-IO guard needs no vLLM
    assert integration.ConnectorGuard is not None


def test_commands_are_listed_once() -> None:
    names = [c.name for c in cli.COMMANDS]
    assert len(names) == len(set(names))


def _verbose_argv(tmp_path: Path) -> dict[str, list[str]]:
    from kvlifetime.testing import new_checked_ledger, to_jsonl

    log = tmp_path / "log.jsonl"
    from kvlifetime.testing import captured_logs

    with captured_logs() as logs:
        led = new_checked_ledger(4)
        led.allocate("r", 1)
        led.reject("r")
        led.release("r")
    log.write_text(to_jsonl(logs))
    return {
        "table": ["table", "request"],
        "diagram": ["diagram", "block"],
        "evidence": ["evidence"],
        "docs": ["docs", "--out", str(tmp_path / "docs")],
        "report": ["report", "--out", str(tmp_path / "report")],
        "verify": [
            "verify",
            "--requests",
            "1",
            "--peers",
            "1",
            "--blocks",
            "1",
            "--faults",
            "none",
        ],
        "replay": ["replay", str(log)],
        "simulate": ["simulate", "--requests", "20"],
        "promela": ["promela", "--shape", "1x1x1"],
    }


def test_verbose_logs_the_steps_of_every_command(capsys: Capsys, tmp_path: Path) -> None:
    """-v works for every command: each logs at least one event of its own to stderr."""
    argvs = _verbose_argv(tmp_path)
    # A new command must be listed here; demo's -v is checked in its Ctrl-C test (a full demo
    # takes ten harness runs).
    assert set(argvs) | {"demo"} == {c.name for c in cli.COMMANDS}
    own_event = {
        "table": "stdout_written",
        "diagram": "stdout_written",
        "evidence": "stdout_written",
        "docs": "file_written",
        "report": "report_step",
        "verify": "verify_progress",
        "replay": "replay_step",
        "simulate": "harness_event",
        "promela": "stdout_written",
    }
    for name, argv in argvs.items():
        status, _, err = run(capsys, "-v", *argv)
        assert status == 0, (name, err)
        assert own_event[name] in err, name
