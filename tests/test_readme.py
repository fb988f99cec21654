"""The README's promises, checked: its example runs, its diagram is the generated one, and it
gives exactly the two set-up commands."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from kvlifetime.diagrams import render

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()


def _blocks(lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", README, flags=re.S)


def test_the_20_line_example_runs_and_prints_what_it_says() -> None:
    (example,) = [b for b in _blocks("python") if "BlockLedger(num_blocks=1024)" in b]
    assert len(example.strip().splitlines()) <= 20
    proc = subprocess.run(
        [sys.executable, "-c", example], capture_output=True, text=True, timeout=60, check=False
    )
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert "'cancel_received', 'scheduling_stopped', 'transfers_ended" in lines[0]
    assert lines[1] == "['scheduling_stopped', 'transfer_quiesced']"
    assert lines[2] == "[0, 1, 2, 3, 4, 5, 6, 7] [1, 1, 1, 1, 1, 1, 1, 1]"


def test_the_quick_start_runs_and_prints_what_it_says() -> None:
    (example,) = [b for b in _blocks("python") if "your scheduler's loop" in b]
    proc = subprocess.run(
        [sys.executable, "-c", example], capture_output=True, text=True, timeout=60, check=False
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == [
        f"req-{i} [0, 1, 2, 3] generation [{i + 1}, {i + 1}, {i + 1}, {i + 1}]" for i in range(3)
    ]
    said = "Prints `req-0 [0, 1, 2, 3] generation [1, 1, 1, 1]`"
    assert said in README


def test_every_code_block_is_run_by_a_test() -> None:
    """Each block is run here, or (needing an engine's venv) in tests/in_sglang/test_hooks.py
    and tests/in_vllm/test_vllm_readme_config.py; a new block must join one of them."""
    runs_here = ("your scheduler's loop", "BlockLedger(num_blocks=1024)", "test_abort_waits")
    runs_in_engine_venv = ("kv_sglang.install", "vllm serve")
    checked_by_shape = ("make demo", "pip install -e .")  # the set-up commands; install lines
    for lang in ("python", "sh"):
        for block in _blocks(lang):
            assert any(m in block for m in runs_here + runs_in_engine_venv + checked_by_shape), (
                block
            )
    assert len(_blocks("python")) == 4 and len(_blocks("sh")) == 3


def test_the_install_lines_and_the_extras_named_are_the_packages_own() -> None:
    import tomllib

    extras = set(
        tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    )
    (install,) = [b for b in _blocks("sh") if "pip install -e ." in b]
    used = {e for line in install.splitlines() for e in re.findall(r"\.\[([a-z,]+)\]", line)}
    named = {e for group in used for e in group.split(",")}
    sentence = README.split("Extras:", 1)[1].split("\n\n", 1)[0]
    named |= set(re.findall(r"`([a-z]+)`\s+\(", sentence))
    assert named and named <= extras, named - extras
    assert extras - {"docs"} <= named, extras - named  # every extra is said


def test_the_readme_is_short() -> None:
    assert len(README.splitlines()) <= 250


def test_readme_shows_the_generated_request_diagram() -> None:
    (diagram,) = _blocks("mermaid")
    assert diagram == render("request", "mermaid")


def test_readme_gives_the_two_setup_commands() -> None:
    (setup,) = [b for b in _blocks("sh") if b.startswith("make demo")]
    commands = [ln.split("#")[0].strip() for ln in setup.strip().splitlines()]
    assert commands == ["make demo", "make test"]


def test_every_kvlifetime_name_the_readme_uses_bare_is_exported() -> None:
    """A name in backticks that one of the core modules defines must import from ``kvlifetime``
    itself, as the README's examples use it."""
    import importlib

    import kvlifetime

    core = [
        importlib.import_module(f"kvlifetime.{m}")
        for m in (
            "errors",
            "evidence",
            "extras",
            "grant",
            "ledger",
            "spec.lifecycles",
            "spec.vocabulary",
            "source",
        )
    ]
    named = set(re.findall(r"`([A-Z][A-Za-z]+)`", README))
    for block in _blocks("python"):
        named |= set(re.findall(r"\b([A-Z][A-Za-z]+)\b", block))
    public = {n for n in named if any(hasattr(m, n) for m in core)}
    assert public, "the README names no kvlifetime class at all?"
    assert sorted(public - set(kvlifetime.__all__)) == []


def test_the_readme_never_calls_checked_ledger_a_plain_fixture() -> None:
    # It is the plugin's factory fixture: `def test(checked_ledger): led = checked_ledger(64)`.
    assert "a `checked_ledger` fixture," not in README


def test_the_plugin_example_passes_under_pytest_with_no_conftest(tmp_path: Path) -> None:
    """The README's plugin example is a test file: run it as an engine's suite would (the
    fixtures come from the installed ``pytest11`` entry point, not from a conftest)."""
    (example,) = [b for b in _blocks("python") if "def test_abort_waits_for_proof" in b]
    (tmp_path / "test_engine.py").write_text(example, encoding="utf-8")
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "test_engine.py"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "1 passed" in proc.stdout
