"""The optional accelerator (``kvlifetime.accel``, ``hatch_build.py``): the ledger's and the
verifier's modules compiled by mypyc from the same source run when built, the sources run when
they are not (or with ``KVLIFETIME_PURE=1``), and the two behave alike.

``make test`` builds the compiled modules first (``make accel``) and sets
``KVLIFETIME_REQUIRE_ACCEL=1``: there the suite runs on the compiled modules, and these tests
fail, never skip, if they are not the ones imported. Without a build (a plain install, no
compiler) the tests that need one skip and say so; the pure path is tested either way.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from kvlifetime import accel

ROOT = Path(__file__).resolve().parent.parent
REQUIRED = os.environ.get("KVLIFETIME_REQUIRE_ACCEL") == "1"
PURE_HERE = os.environ.get("KVLIFETIME_PURE") == "1"


def _built() -> bool:
    """Every compiled module is present beside its source (``make accel``)."""
    sys.path.insert(0, str(ROOT))
    try:
        import hatch_build
    finally:
        sys.path.pop(0)
    return all(p.exists() for p in hatch_build.compiled_files())


needs_build = pytest.mark.skipif(
    not REQUIRED and not _built(),
    reason="the compiled modules are not built (make accel; make test builds them)",
)

# One deterministic history through both counts modes: single and batch calls, refusals, bad
# evidence; printed as JSON (transitions, refusal kinds, the whole state) to compare variants.
_SCENARIO = r"""
import json, random
from kvlifetime import accel, errors
from kvlifetime.evidence import TransferCompleted, CancelReceived, SchedulingStopped
from kvlifetime.grant import Access
from kvlifetime.ledger import BlockLedger

out = {"variant": accel.variant(), "runs": []}
for counts in ("ledger", "engine"):
    rng = random.Random(7)
    L = BlockLedger(64, counts=counts, incarnation="scenario")
    log = []
    grants = []
    for step in range(60):
        items = []
        for i in range(rng.randint(0, 4)):
            ids = rng.sample(range(64), rng.randint(1, 4))
            items.append((f"r{step}-{i}", ids, rng.choice(["p", "q"]),
                          rng.choice([Access.READ, Access.WRITE])))
        if rng.random() < 0.2 and items:
            items.append(items[0])  # a request twice: refused on its own
        res = L.acquire_and_grant_many(items)
        log.append(["grant", [list(t) for t in res.transitions],
                    [(r.position, r.error.kind) for r in res.refused]])
        grants += res.grants
        live = sorted(L.live_requests(), key=repr)
        ended = [k for k in live if rng.random() < 0.5] + ["nobody"]
        res = L.finish_many(ended)
        log.append(["finish", [list(t) for t in res.transitions],
                    [(r.position, r.error.kind) for r in res.refused]])
        rng.shuffle(grants)
        ev = []
        for g in grants[: rng.randint(0, 4)]:
            kind = rng.random()
            if kind < 0.6:
                ev.append(TransferCompleted.of(g, 1))
            elif kind < 0.8:
                ev.append(SchedulingStopped.of(g, rng.randint(0, 2)))
            else:
                ev.append(CancelReceived.of(g))
        res = L.apply_many(ev)
        log.append(["apply", [list(t) for t in res.transitions],
                    [(r.position, r.error.kind) for r in res.refused]])
        freed = L.collect_releasable()
        log.append(["collect", sorted((repr(k), v.tolist()) for k, v in freed.items())])
        grants = [g for g in grants if g.request in L.live_requests()]
        try:
            L.acquire("x", [0, 1])
            L.release("x")
        except errors.KVLifetimeError as e:
            log.append(["refused", e.kind])
    C = L.copy()
    out["runs"].append({"log": log, "state": repr(L.fingerprint()),
                        "copy": repr(C.fingerprint()), "stats": repr(L.stats())})
print(json.dumps(out))
"""


def _scenario(pure: bool) -> dict[str, object]:
    env = dict(os.environ, KVLIFETIME_PURE="1" if pure else "0", PYTHONPATH=str(ROOT))
    proc = subprocess.run(
        [sys.executable, "-c", _SCENARIO],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    result: dict[str, object] = json.loads(proc.stdout)
    return result


@needs_build
def test_the_compiled_modules_are_the_ones_imported_when_built() -> None:
    if PURE_HERE:
        pytest.skip("this process was told to run the sources (KVLIFETIME_PURE=1)")
    flags = accel.compiled()
    assert flags == dict.fromkeys(accel.MODULES, True)
    assert accel.variant() == "compiled"
    # Nothing outside the list is compiled: BlockLedger, the values and the rest stay
    # interpreted (applications subclass BlockLedger).
    import kvlifetime.ledger.facade
    import kvlifetime.ledger.queries
    import kvlifetime.ledger.values

    for module in (kvlifetime.ledger.facade, kvlifetime.ledger.queries, kvlifetime.ledger.values):
        assert str(module.__file__).endswith(".py")


def test_kvlifetime_pure_imports_the_sources() -> None:
    result = _scenario(pure=True)
    assert result["variant"] == "pure"


@needs_build
def test_compiled_and_pure_run_one_history_alike() -> None:
    """The same source compiled and interpreted: the same transitions, refusals, releases and
    final state (a copy included), in both counts modes."""
    pure, compiled = _scenario(pure=True), _scenario(pure=False)
    assert (pure["variant"], compiled["variant"]) == ("pure", "compiled")
    assert pure["runs"] == compiled["runs"]
    # The history did something: grants, refusals and releases in every mode.
    for run in pure["runs"]:  # type: ignore[attr-defined]
        kinds = {entry[0] for entry in run["log"]}
        assert {"grant", "finish", "apply", "collect"} <= kinds
        assert any(entry[0] == "collect" and entry[1] for entry in run["log"])
        assert any(entry[0] == "grant" and entry[2] for entry in run["log"])


# The verifier's searches through both engines: the states each reaches (every canonical key,
# hashed in a sorted order), its verdict and its shortest counterexample, event by event.
_VERIFY_SCENARIO = r"""
import hashlib, json
from kvlifetime import accel
from kvlifetime.verify import Config, Policy, explore, parse_faults

out = {"variant": accel.variant(), "runs": []}
shapes = [
    (Config(2, 2, 1, faults=parse_faults("all"), max_faults=1), Policy.PROOF),
    (Config(1, 2, 1, faults=parse_faults("lie,fence")), Policy.PROOF),
    (Config(2, 2, 2, faults=parse_faults("fail,timeout"), max_faults=1), Policy.NAIVE),
    (Config(1, 1, 1, faults=parse_faults("fail"), ranks=2), Policy.FIRST_FAILURE),
]
for config, policy in shapes:
    for engine in ("ledger", "packed"):
        reached = set()
        r = explore(config, policy, engine=engine, reached=reached)
        keys = hashlib.sha256("\n".join(sorted(map(repr, reached))).encode()).hexdigest()
        out["runs"].append({
            "shape": [policy.value, engine, repr(config.describe())],
            "states": r.states,
            "keys": keys,
            "verdict": r.verdict,
            "violation": None if r.violation is None else r.violation.invariant,
            "trace": [[s.event.to_list(), s.label, list(s.notes)] for s in r.trace],
        })
print(json.dumps(out))
"""


def _verify_scenario(pure: bool) -> dict[str, Any]:
    env = dict(os.environ, KVLIFETIME_PURE="1" if pure else "0", PYTHONPATH=str(ROOT))
    proc = subprocess.run(
        [sys.executable, "-c", _VERIFY_SCENARIO],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        check=True,
    )
    result: dict[str, Any] = json.loads(proc.stdout)
    return result


@needs_build
def test_compiled_and_pure_verifiers_reach_the_same_states() -> None:
    """The verifier's modules compiled and interpreted, both engines: the same canonical keys
    reached, the same verdicts, the same shortest counterexamples event by event."""
    pure, compiled = _verify_scenario(pure=True), _verify_scenario(pure=False)
    assert (pure["variant"], compiled["variant"]) == ("pure", "compiled")
    assert pure["runs"] == compiled["runs"]
    # The searches did something: a pass over thousands of states, and refutations.
    verdicts = {run["verdict"] for run in pure["runs"]}
    assert "pass" in verdicts and len(verdicts) > 1, verdicts
    assert max(run["states"] for run in pure["runs"]) > 1000
    assert any(run["trace"] for run in pure["runs"])


def test_the_fallback_runs_the_differential_ledger_tests() -> None:
    """The pure path, whatever this process imported: the batch calls' differential tests
    (each against the single calls it stands for) on the sources."""
    env = dict(os.environ, KVLIFETIME_PURE="1", PYTHONPATH=str(ROOT))
    env.pop("KVLIFETIME_REQUIRE_ACCEL", None)
    test = "tests/test_ledger_batch_grants.py"
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=", test],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert " passed" in proc.stdout
