"""A pytest plugin that writes every test id's outcome to a JSON file.

Loaded with ``-p outcomes_plugin`` (this folder on PYTHONPATH); the file is named by the
environment variable KVLIFETIME_OUTCOMES_JSON. One outcome per test id: ``error`` when setup or
teardown failed, else ``failed``, ``skipped``, ``xfailed``, ``xpassed`` or ``passed``; a module
that fails to collect is one ``error`` entry under the module's id. Under pytest-xdist only the
controller writes (the workers' reports reach it through the same hook).
"""

from __future__ import annotations

import json
import os
from typing import Any

import pytest

_RANK = {"passed": 0, "xpassed": 1, "skipped": 2, "xfailed": 3, "failed": 4, "error": 5}


def _message(report: Any) -> str:
    longrepr = report.longrepr
    if longrepr is None:
        return ""
    if isinstance(longrepr, tuple):  # a skip: (path, line, reason)
        return str(longrepr[2])
    crash = getattr(getattr(longrepr, "reprcrash", None), "message", None)
    lines = [ln.strip() for ln in (crash or str(longrepr)).splitlines()]
    lines = [ln for ln in lines if ln and not ln.startswith("For further information")]
    return " | ".join(lines)[:400]


def _outcome(report: Any) -> str:
    if hasattr(report, "wasxfail"):
        return "xfailed" if report.skipped else "xpassed"
    if report.passed:
        return "passed"
    if report.skipped:
        return "skipped"
    return "failed" if report.when == "call" else "error"


class _Recorder:
    def __init__(self, path: str) -> None:
        self.path = path
        self.tests: dict[str, dict[str, Any]] = {}

    def _put(self, nodeid: str, outcome: str, message: str, duration: float) -> None:
        entry = self.tests.setdefault(nodeid, {"outcome": "passed", "duration": 0.0})
        entry["duration"] = round(entry["duration"] + duration, 3)
        if _RANK[outcome] > _RANK[entry["outcome"]]:
            entry["outcome"] = outcome
            if message:
                entry["message"] = message

    @pytest.hookimpl(trylast=True)
    def pytest_runtest_logreport(self, report: Any) -> None:
        self._put(report.nodeid, _outcome(report), _message(report), report.duration)

    @pytest.hookimpl(trylast=True)
    def pytest_collectreport(self, report: Any) -> None:
        if report.failed:
            self._put(report.nodeid, "error", _message(report), 0.0)

    @pytest.hookimpl(trylast=True)
    def pytest_sessionfinish(self, session: Any) -> None:
        with open(self.path, "w") as f:
            json.dump({"tests": dict(sorted(self.tests.items()))}, f, indent=1)
            f.write("\n")


def pytest_configure(config: pytest.Config) -> None:
    path = os.environ.get("KVLIFETIME_OUTCOMES_JSON")
    if path and not hasattr(config, "workerinput"):  # not on an xdist worker
        config.pluginmanager.register(_Recorder(path), "kvlifetime-outcomes-recorder")
