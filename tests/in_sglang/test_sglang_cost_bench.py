"""``bench.sglang_cost`` runs end to end at tiny sizes (a smoke test of the bench, not a timing:
nothing here asserts a figure). The bench itself exits non-zero when a round did different work
alone and guarded, or the guard did not see every request through cleanly."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_cost_bench_runs_both_sides_at_tiny_sizes(tmp_path: Path) -> None:
    out = tmp_path / "bench-sglang.json"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "bench.sglang_cost",
            "--requests",
            "3",
            "--tokens",
            "4",
            "--rounds",
            "1",
            "--inflight-polls",
            "1",
            "--out",
            str(out),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    report = json.loads(out.read_text(encoding="utf-8"))
    assert report["machine"]["sglang"] == "0.5.23"
    decode = report["sides"]["decode"]["sizes"]["3"]
    prefill = report["sides"]["prefill"]["sizes"]["3"]
    assert decode["work"]["transferred"] == 3
    assert decode["work"]["guard"]["completed"] == 3
    assert prefill["work"]["concluded"] == 3
    assert prefill["work"]["guard"]["freed"] == 3
    # The guard's own methods were timed in the extra round: every request went through them.
    assert decode["guard_time"]["calls"]["published"] == 3
    assert decode["guard_time"]["calls"]["transferred"] == 3
    assert prefill["guard_time"]["calls"]["sending"] == 3
    assert prefill["guard_time"]["calls"]["ended"] == 3
    assert "decode 3" in done.stdout and "prefill 3" in done.stdout
