"""Runs vLLM's own (0.34.0's) scheduler and KV-connector unit tests on this CPU machine.

    python vllm-tests/run.py baseline   # without the guard: writes expected-outcomes.json
    python vllm-tests/run.py guarded    # with the guard's pytest plugin: compares with it

Both modes run the same test files (FILES) with the same settings, in the vLLM venv, from the
extracted source tree (`make vllm-src`), with the hub offline and HF_HOME holding a hand-written
config for facebook/opt-125m. Every test id's outcome is recorded by outcomes_plugin.py.

`guarded` loads the plugin named by KVLIFETIME_VLLM_PLUGIN (default
kvlifetime.integrations.vllm.pytest_plugin), fails listing every test id whose outcome differs
from expected-outcomes.json (and ids missing or new), prints how many connectors the plugin
wrapped when it logs them (one line per connector in KVLIFETIME_VLLM_WRAPPED_LOG), and then
runs the project's own vLLM scenario tests, tests/in_vllm/, when that folder exists.

Arguments after `--` go to pytest (e.g. `-- -x -k nixl`; a filtered run is compared only on
the ids it ran).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from collections import Counter, defaultdict
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
EXPECTED = HERE / "expected-outcomes.json"
# The guard's intended differences from the baseline: test id -> the guarded outcome, why it is
# the guard's policy, and the project's test that pins it (vllm-tests/README.md).
INTENDED = HERE / "intended-differences.json"
DEFAULT_PLUGIN = "kvlifetime.integrations.vllm.pytest_plugin"

KV_UNIT = "tests/v1/kv_connector/unit"
FILES = [
    "tests/v1/core/test_scheduler.py",
    "tests/v1/core/test_prefix_caching.py",
    "tests/v1/core/test_kv_cache_utils.py",
    *(
        f"{KV_UNIT}/{name}.py"
        for name in (
            "test_remote_decode_lifecycle",
            "test_remote_prefill_lifecycle",
            "test_scheduler_kv_connector_override",
            "test_error_propagation",
            "test_invalid_blocks_correctness",
            "test_kv_load_failure_recovery",
            "test_cache_pollution_prevention",
            "test_example_connector",
            "test_offloading_connector",
            "test_multi_connector",
            "test_nixl_heartbeat",
            "test_nixl_connector",
            "test_nixl_push_connector",
            "offloading_connector/test_scheduler",
        )
    ),
]

# Why a test does not pass here, from its failure or skip message: (category, pattern).
# First match wins; the categories are what expected-outcomes.json records.
CATEGORIES = [
    (
        "offline: the model's config or snapshot is not in the local HF cache",
        r"Invalid repository ID or local directory|LocalEntryNotFound|OfflineModeIsEnabled"
        r"|outgoing traffic has been disabled",
    ),
    (
        "CPU platform: async scheduling with pipeline parallelism is not supported",
        r"Async scheduling is not supported .* pipeline parallelism",
    ),
    (
        "CPU platform: sleep mode is not supported",
        r"Sleep mode is not supported on current platform",
    ),
    ("compiled op missing: vllm._C is not built for CPU", r"_OpNamespace|vllm\._C|torch\.ops"),
    ("needs a GPU", r"CUDA|GPU|cuda"),
    ("needs a GPU: no attention backend to parametrize on CPU", r"empty parameter set"),
]


def categorize(message: str) -> str:
    for category, pattern in CATEGORIES:
        if re.search(pattern, message):
            return category
    return "other"


def test_env(hf_home: Path) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        VLLM_TARGET_DEVICE="cpu",
        # vLLM 0.34 refuses every config on an x86 CPU without triton-cpu unless no CUDA device
        # is named (vllm/platforms/cpu.py); 0.33 only warned.
        CUDA_VISIBLE_DEVICES="",
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        HF_HOME=str(hf_home),
        HF_HUB_DISABLE_TELEMETRY="1",
        VLLM_NO_USAGE_STATS="1",
        DO_NOT_TRACK="1",
        TOKENIZERS_PARALLELISM="false",
    )
    return env


def run_pytest(args: argparse.Namespace, plugin: str | None, out: Path) -> dict[str, dict]:
    venv_python = (ROOT / args.venv / "bin" / "python").absolute()
    src = (ROOT / args.src).resolve()
    hf_home = (ROOT / args.hf_home).resolve()
    if not (src / "tests").is_dir():
        sys.exit(f"{src}/tests missing: run `make vllm-src` first")
    if not (hf_home / "hub" / "models--facebook--opt-125m" / "refs" / "main").is_file():
        sys.exit(f"{hf_home} has no opt-125m config: run `make vllm-hf` first")
    env = test_env(hf_home)
    env["KVLIFETIME_OUTCOMES_JSON"] = str(out)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(HERE), env.get("PYTHONPATH")) if p)
    # Paths among the pytest arguments replace FILES (a partial run).
    paths = [a for a in args.pytest_args if a.startswith("tests/")]
    extra = [a for a in args.pytest_args if not a.startswith("tests/")]
    cmd = [str(venv_python), "-m", "pytest", *(paths or FILES), "-p", "outcomes_plugin"]
    if plugin:
        cmd += ["-p", plugin]
    cmd += ["-q", "--tb=line", "-p", "no:cacheprovider", "--continue-on-collection-errors"]
    cmd += [f"--timeout={args.timeout}"]
    if args.jobs > 1:
        cmd += ["-n", str(args.jobs)]
    cmd += extra
    out.unlink(missing_ok=True)
    print(f"+ (cd {src} && python {' '.join(cmd[1:])})", flush=True)
    t0 = time.monotonic()
    rc = subprocess.call(cmd, cwd=src, env=env)
    wall = time.monotonic() - t0
    # 0: all passed, 1: some failed (expected here); anything else is a broken run.
    if rc not in (0, 1) or not out.is_file():
        sys.exit(f"pytest did not complete (exit status {rc})")
    tests = json.loads(out.read_text())["tests"]
    summarize(tests, wall)
    return tests


def file_of(test_id: str) -> str:
    return test_id.split("::", 1)[0]


def summarize(tests: dict[str, dict], wall: float) -> None:
    per_file: dict[str, Counter[str]] = defaultdict(Counter)
    seconds: Counter[str] = Counter()
    for test_id, entry in tests.items():
        per_file[file_of(test_id)][entry["outcome"]] += 1
        seconds[file_of(test_id)] += entry.get("duration", 0.0)
    total: Counter[str] = Counter()
    print(f"\n{'file':<66} {'pass':>5} {'fail':>5} {'skip':>5} {'other':>5} {'sec':>6}")
    for name in sorted(per_file):
        c = per_file[name]
        total.update(c)
        other = sum(c.values()) - c["passed"] - c["failed"] - c["skipped"]
        print(
            f"{name:<66} {c['passed']:>5} {c['failed']:>5} {c['skipped']:>5} {other:>5}"
            f" {seconds[name]:>6.0f}"
        )
    print(
        f"{'total ' + str(sum(total.values())) + ' tests':<66} {total['passed']:>5}"
        f" {total['failed']:>5} {total['skipped']:>5}"
        f" {sum(total.values()) - total['passed'] - total['failed'] - total['skipped']:>5}"
        f" {sum(seconds.values()):>6.0f}"
    )
    print(f"wall time {wall:.0f} s; outcomes: {dict(sorted(total.items()))}", flush=True)


def venv_vllm_version(args: argparse.Namespace) -> str:
    """The vLLM release installed in the test venv (its distribution's metadata)."""
    venv_python = (ROOT / args.venv / "bin" / "python").absolute()
    code = "import importlib.metadata as m; print(m.version('vllm'))"
    return subprocess.check_output([str(venv_python), "-c", code], text=True).strip()


def check_release(args: argparse.Namespace) -> None:
    """A baseline holds for the release it was recorded on only: any other is a clear stop."""
    recorded = json.loads(EXPECTED.read_text()).get("vllm")
    installed = venv_vllm_version(args)
    if recorded != installed:
        sys.exit(
            f"{EXPECTED.relative_to(ROOT)} was recorded on vLLM {recorded}, the venv has"
            f" {installed}: record a baseline for it (`make vllm-baseline`, vllm-tests/README.md)"
        )


def write_expected(tests: dict[str, dict], release: str) -> None:
    expected: dict[str, dict] = {}
    for test_id, entry in tests.items():
        row = {"outcome": entry["outcome"]}
        if entry["outcome"] != "passed":
            message = entry.get("message", "")
            row["reason"] = (
                "marked xfail by vLLM's own test"
                if entry["outcome"] == "xfailed"
                else categorize(message)
            )
            model = re.search(r"specified: '([^']+)'", message)
            if model:
                row["model"] = model.group(1)
            row["message"] = message[:200]
        expected[test_id] = row
    counts = Counter(e["outcome"] for e in expected.values())
    reasons = Counter(e["reason"] for e in expected.values() if "reason" in e)
    doc = {
        "about": f"Outcome of every test id of vLLM {release}'s tests run by vllm-tests/run.py "
        "without the guard (CPU only, hub offline, opt-125m config only). `make test-vllm` "
        "requires the same outcomes with the guard. Rewrite with `make vllm-baseline`.",
        "vllm": release,
        "counts": dict(sorted(counts.items())),
        "reasons": dict(sorted(reasons.items())),
        "tests": expected,
    }
    EXPECTED.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {EXPECTED.relative_to(ROOT)}: {dict(sorted(counts.items()))}")
    for reason, n in sorted(reasons.items()):
        print(f"  {n:>4}  {reason}")


def intended() -> dict[str, dict]:
    """The intended differences (empty when the file is absent), each checked for its fields."""
    if not INTENDED.is_file():
        return {}
    doc = json.loads(INTENDED.read_text())
    rows = doc.get("differences", {})
    for test_id, row in rows.items():
        missing = {"guarded", "reason", "pinned_by"} - set(row)
        if missing:
            sys.exit(f"{INTENDED.name}: {test_id} lacks {', '.join(sorted(missing))}")
    return rows


def compare(tests: dict[str, dict], filtered: bool) -> tuple[int, list[str], list[str]]:
    """The number of test ids whose outcome matches the baseline or an intended difference,
    every other difference, and the intended differences seen (each with its reason)."""
    expected = json.loads(EXPECTED.read_text())["tests"]
    allowed = intended()
    matched = 0
    problems, seen = [], []
    for test_id in sorted(set(expected) | set(tests)):
        want = expected.get(test_id, {}).get("outcome")
        got = tests.get(test_id, {}).get("outcome")
        why = allowed.get(test_id)
        if why is not None and got is not None:
            if got == why["guarded"] and got != want:
                matched += 1
                seen.append(f"INTENDED {test_id}: {want} -> {got}: {why['reason']}")
                continue
            if got == want:
                # Listed, yet the guard no longer changes it: the list must say only what is.
                problems.append(f"STALE    {test_id}: listed in {INTENDED.name}, now {got}")
                continue
        if want == got:
            matched += 1
            continue
        if got is None:
            if not filtered:
                problems.append(f"MISSING  {test_id} (expected {want})")
        elif want is None:
            problems.append(f"NEW      {test_id} ({got}): {tests[test_id].get('message', '')}")
        else:
            msg = tests[test_id].get("message", "")
            problems.append(f"CHANGED  {test_id}: expected {want}, got {got}  {msg}".rstrip())
    return matched, problems, seen


def wrapped_count(log: Path) -> int:
    if log.is_file():
        lines = [ln for ln in log.read_text().splitlines() if ln.strip()]
        print(f"the guard wrapped {len(lines)} connectors ({log})")
        return len(lines)
    print(f"no wrapped-connector log at {log} (the plugin did not write one)")
    return 0


def scenario_tests(args: argparse.Namespace) -> int:
    folder = ROOT / "tests" / "in_vllm"
    if not folder.is_dir():
        print("tests/in_vllm/ is missing: the guard's scenario tests must run")
        return 1
    venv_python = (ROOT / args.venv / "bin" / "python").absolute()
    env = test_env((ROOT / args.hf_home).resolve())
    # The project's addopts name pytest-markdown-docs (the manual's code blocks, run by `make
    # test` in the main venv); this venv has no such plugin and runs only tests/in_vllm.
    cmd = [
        str(venv_python),
        "-m",
        "pytest",
        "tests/in_vllm",
        "-p",
        "no:cacheprovider",
        "-o",
        "addopts=-q",
    ]
    print("+", " ".join(cmd[1:]), flush=True)
    rc = subprocess.call(cmd, cwd=ROOT, env=env)
    if rc == 5:  # pytest: no tests collected
        print("tests/in_vllm/ collected no test: the guard's scenario tests must run")
    return rc


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("mode", choices=["baseline", "guarded"])
    parser.add_argument("--venv", default=".venv-vllm")
    parser.add_argument("--src", default=".vllm-src")
    parser.add_argument("--hf-home", default=".vllm-hf")
    parser.add_argument("--jobs", "-n", type=int, default=int(os.environ.get("VLLM_TEST_JOBS", 1)))
    # The slowest test here takes under 5 s; a test the guard holds on purpose (a failed load
    # waiting for a fence that the test never makes) ends at this timeout as failed.
    parser.add_argument("--timeout", type=int, default=30, help="seconds per test")
    parser.add_argument("--outcomes", help="JSON file of a previous run: no pytest run")
    argv = sys.argv[1:]
    cut = argv.index("--") if "--" in argv else len(argv)
    args = parser.parse_args(argv[:cut])
    args.pytest_args = argv[cut + 1 :]  # after --: passed to pytest
    run_dir = (ROOT / args.src / "run").resolve()
    run_dir.mkdir(parents=True, exist_ok=True)

    if args.mode == "baseline":
        if args.outcomes:
            tests = json.loads(Path(args.outcomes).read_text())["tests"]
        else:
            tests = run_pytest(args, None, run_dir / "outcomes-baseline.json")
        if args.pytest_args and not args.outcomes:
            print(f"a partial run (pytest arguments given): {EXPECTED.name} not rewritten")
        else:
            write_expected(tests, venv_vllm_version(args))
        return 0

    check_release(args)
    plugin = os.environ.get("KVLIFETIME_VLLM_PLUGIN", DEFAULT_PLUGIN)
    log = Path(os.environ.setdefault("KVLIFETIME_VLLM_WRAPPED_LOG", str(run_dir / "wrapped.log")))
    if args.outcomes:
        tests = json.loads(Path(args.outcomes).read_text())["tests"]
    else:
        log.unlink(missing_ok=True)
        print(f"guard plugin: {plugin}")
        tests = run_pytest(args, plugin, run_dir / "outcomes-guarded.json")
    wrapped = wrapped_count(log)
    matched, problems, seen = compare(tests, filtered=bool(args.pytest_args))
    if seen:
        print(f"\n{len(seen)} intended differences ({INTENDED.relative_to(ROOT)}):")
        print("\n".join(seen))
    if plugin == DEFAULT_PLUGIN and not args.outcomes and wrapped == 0:
        # Equal outcomes prove nothing if the guard was never installed.
        problems.append("the guard's plugin wrapped no connector")
    if problems:
        print(f"\n{len(problems)} test ids differ from {EXPECTED.relative_to(ROOT)}:")
        print("\n".join(problems))
    else:
        print(
            f"every outcome matches {EXPECTED.relative_to(ROOT)} or an intended difference"
            f" ({len(tests)} test ids, {len(seen)} intended differences)"
        )
    # One closing line in the plain 'N passed, N failed' form: test ids whose outcome matches
    # the baseline, and those that differ (or are missing or new).
    print("test ids matching the baseline (or an intended difference) / differing from it:")
    print(f"vllm-guarded: {matched} passed, {len(problems)} failed")
    rc = scenario_tests(args)
    if rc:
        print(f"tests/in_vllm failed (exit status {rc})")
    return 1 if problems or rc else 0


if __name__ == "__main__":
    sys.exit(main())
