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


def test_readme_shows_the_generated_request_diagram() -> None:
    (diagram,) = _blocks("mermaid")
    assert diagram == render("request", "mermaid")


def test_readme_gives_the_two_setup_commands() -> None:
    (setup,) = [b for b in _blocks("sh") if b.startswith("make demo")]
    commands = [ln.split("#")[0].strip() for ln in setup.strip().splitlines()]
    assert commands == ["make demo", "make test"]
