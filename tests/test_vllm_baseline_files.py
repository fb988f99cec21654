"""The files ``make test-vllm`` compares against (vllm-tests/): one release, said once, and an
intended difference only with its reason and a test that exists.

``make test-vllm`` itself needs the vLLM venv and runs in CI; these check, in ``make test``,
that what it reads is consistent: the baseline was recorded on the release the Makefile builds,
every file the runner runs has test ids in it, and every listed difference is a real one (the
baseline's outcome differs), says why, and names a test function of this repository.
"""

from __future__ import annotations

import json
import re
import runpy
from pathlib import Path

from kvlifetime.integrations.vllm import facts

ROOT = Path(__file__).resolve().parent.parent
HERE = ROOT / "vllm-tests"


def _makefile_release() -> str:
    m = re.search(r"^VLLM_VERSION := (\S+)$", (ROOT / "Makefile").read_text(), re.M)
    assert m, "the Makefile names the release its baseline is for"
    return m[1]


def _expected() -> dict[str, object]:
    doc: dict[str, object] = json.loads((HERE / "expected-outcomes.json").read_text())
    return doc


def test_the_baseline_is_for_the_release_the_makefile_builds() -> None:
    release = _makefile_release()
    assert _expected()["vllm"] == release
    assert release in (HERE / "fetch-src.sh").read_text()  # its sdist and sha256 recorded
    assert f"default {release}" in (HERE / "setup-venv.sh").read_text()
    # A release the guard supports, and 0.33 still supported.
    assert facts.series(release) in facts.supported_versions()
    assert "0.33" in facts.supported_versions()


def test_every_file_the_runner_runs_has_ids_in_the_baseline() -> None:
    files = runpy.run_path(str(HERE / "run.py"))["FILES"]
    tests = _expected()["tests"]
    assert isinstance(tests, dict)
    have = {t.split("::", 1)[0] for t in tests}
    assert set(files) == have
    assert "tests/v1/kv_connector/unit/test_nixl_push_connector.py" in files


def test_every_intended_difference_is_real_explained_and_pinned() -> None:
    doc = json.loads((HERE / "intended-differences.json").read_text())
    assert doc["vllm"] == _makefile_release()
    tests = _expected()["tests"]
    assert isinstance(tests, dict)
    rows = doc["differences"]
    for test_id, row in rows.items():
        assert test_id in tests, test_id
        assert row["guarded"] != tests[test_id]["outcome"], test_id
        assert len(row["reason"]) > 40, test_id
        path, _, name = row["pinned_by"].partition("::")
        source = (ROOT / path).read_text()
        assert re.search(rf"^def {re.escape(name)}\(", source, re.M), row["pinned_by"]
