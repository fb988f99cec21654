#!/usr/bin/env bash
# Run SGLang's own CPU unit tests for deferred decode KV release against SGLang 0.5.23, twice:
# SGLang alone, and with kvlifetime's SGLang hooks installed (role=decode) around every test.
#
# This script fetches nothing and the tests are never committed to this repository (they are
# SGLang's, Apache-2.0, and they do not belong to kvlifetime). Obtain them yourself into a
# scratch directory OUTSIDE this checkout, then point the script at it:
#
#   mkdir -p /tmp/sgl-unit
#   # from a clone of https://github.com/sgl-project/sglang, the version of
#   #   test/registered/unit/disaggregation/test_deferred_decode_kv_release.py
#   # that matches 0.5.23 best (docs/sglang.md, "SGLang's own unit tests", says which one and
#   # how to recognise it: its docstring ends "Device destinations may also release on
#   # timeout; host destinations require the ack.", 43 tests, 36,958 characters; the copy run
#   # here had sha256 229126a6e27cf082cf4db46820fe7b12ba3829a94335b0a55c9d11aefc89f8d2), e.g.
#   #   git -C sglang show <commit>:test/registered/unit/disaggregation/test_deferred_decode_kv_release.py \
#   #       > /tmp/sgl-unit/test_deferred_decode_kv_release.py
#   sglang-tests/run-upstream-unit.sh /tmp/sgl-unit
#
# Needs the SGLang venv (make sglang-venv). Writes conftest.py, junit-*.xml and stats-*.jsonl
# into the scratch directory and prints one line per test: outcome alone / guarded, and the
# first line of the failure. The tests build SGLang's objects with __new__ and SimpleNamespace
# stand-ins, so the queue constructors never run: the guard's ledger is never bound to a pool
# (KVL_SGLANG_LEDGER_BLOCKS=N binds it up front) and it only sees the calls the tests make on
# the wrapped methods themselves.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
scratch="${1:?usage: $0 SCRATCH_DIR [pytest args...]}"
shift
scratch="$(cd "$scratch" && pwd)"
case "$scratch/" in
"$here"/*)
    echo "refused: $scratch is inside the repository; SGLang's tests stay outside it" >&2
    exit 2
    ;;
esac
py="${KVL_SGLANG_PYTHON:-$here/.venv-sglang/bin/python}"
[ -x "$py" ] || {
    echo "no SGLang venv at $py (make sglang-venv)" >&2
    exit 2
}
ls "$scratch"/test_*.py >/dev/null 2>&1 || {
    echo "no test_*.py in $scratch: copy SGLang's test files there first (see the header)" >&2
    exit 2
}

cat >"$scratch/conftest.py" <<'PY'
# Written by kvlifetime's sglang-tests/run-upstream-unit.sh. With KVL_SGLANG_GUARD=decode or
# prefill, kvlifetime's SGLang hooks are installed before each test body and uninstalled after;
# the guard's stats are appended to KVL_SGLANG_STATS.
import json
import os

import pytest

ROLE = os.environ.get("KVL_SGLANG_GUARD", "")
BLOCKS = os.environ.get("KVL_SGLANG_LEDGER_BLOCKS")
STATS = os.environ.get("KVL_SGLANG_STATS", "")


@pytest.fixture(autouse=True)
def _kvlifetime_guard(request):
    if not ROLE:
        yield
        return
    import attrs

    import kvlifetime.integrations.sglang as kv_sglang

    guard = kv_sglang.install(role=ROLE, ledger_blocks=int(BLOCKS) if BLOCKS else None)
    try:
        yield
    finally:
        if STATS:
            with open(STATS, "a") as f:
                row = {"test": request.node.nodeid, "stats": attrs.asdict(guard.stats())}
                f.write(json.dumps(row, default=str) + "\n")
        kv_sglang.uninstall()
PY

run() { # $1 = label, rest = env assignments
    local label="$1"
    shift
    rm -f "$scratch/stats-$label.jsonl"
    (cd "$scratch" && env "$@" KVL_SGLANG_STATS="$scratch/stats-$label.jsonl" \
        "$py" -m pytest -p no:cacheprovider -q --junitxml="$scratch/junit-$label.xml" \
        "${pytest_args[@]}" test_*.py >"$scratch/pytest-$label.log" 2>&1) || true
    grep -E "^=* *[0-9]+ (passed|failed|error).* in [0-9.]+s" "$scratch/pytest-$label.log" | tail -n 1 | sed "s/^/$label: /"
}
pytest_args=("$@")
run alone KVL_SGLANG_GUARD=
run guarded KVL_SGLANG_GUARD=decode

"$py" - "$scratch" <<'PY'
import sys
import xml.etree.ElementTree as ET

scratch = sys.argv[1]


def outcomes(label):
    out = {}
    for case in ET.parse(f"{scratch}/junit-{label}.xml").iter("testcase"):
        name = f"{case.get('classname').rsplit('.', 1)[-1]}::{case.get('name')}"
        why = ""
        for kind in ("failure", "error", "skipped"):
            node = case.find(kind)
            if node is not None:
                # CustomTestCase retries a failing test and then raises its own "retry()
                # exceed maximum number of retries": report the first error under it.
                lines = [
                    ln[1:].strip()
                    for ln in (node.text or "").splitlines()
                    if ln.startswith("E ") and "retry() exceed" not in ln
                ]
                msg = lines or (node.get("message") or "").strip().splitlines()
                why = f"{kind}: {msg[0][:110] if msg else ''}"
                break
        out[name] = ("passed" if not why else why.split(":")[0], why)
    return out


alone, guarded = outcomes("alone"), outcomes("guarded")
for name in sorted(alone.keys() | guarded.keys()):
    a, g = alone.get(name, ("-", "")), guarded.get(name, ("-", ""))
    same = "same" if a == g else "DIFFERS"
    why = a[1] if a[1] == g[1] else f"alone {a[1] or '-'} / guarded {g[1] or '-'}"
    print(f"{name}\t{a[0]}\t{g[0]}\t{same}\t{why}")
PY
