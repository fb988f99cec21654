"""The worked examples run as a user would run them, and end in the state they claim."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize(
    ("script", "expected"),
    [
        (
            "examples/vllm_style_allocator.py",
            ["A finished, transfer open: finished free: 4", "A released: 2", "all 8 blocks free"],
        ),
        (
            "examples/sglang_style_decode.py",
            [
                "release refused:",
                "SchedulingStopped: fired ['scheduling_stopped', 'transfer_quiesced']",
                "generations now: [1, 1, 1, 1]",
                "expire(5): [] expire(11): ['req-8']",
                "req-9 got 14 fresh pages, none of req-8's",
            ],
        ),
    ],
)
def test_example_runs(script: str, expected: list[str]) -> None:
    proc = subprocess.run(
        [sys.executable, str(ROOT / script)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    for line in expected:
        assert line in proc.stdout, proc.stdout
