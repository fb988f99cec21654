"""The specification emitted as C (``kvlifetime.verify.cspec``), compiled by the system's
compiler (``cbuild``), held to the Python specification: every packed proof and evidence code,
every request state and call, every set of up to two grants' proofs.

The Python side is the ledger's own: ``GrantProof.check`` / ``record`` for the proofs, the
request table's ``step`` for a call, ``ledger.transitions``' chain for the evidence-driven
transitions. A changed row is caught; a missing compiler is a typed error, not a crash.
"""

from __future__ import annotations

import ctypes
import itertools
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs
import pytest

from kvlifetime.errors import ContradictoryEvidence, IllegalTransition
from kvlifetime.ledger.transitions import _CHAIN
from kvlifetime.spec.proof import GrantProof
from kvlifetime.spec.table import Row, TransitionTable, request_table
from kvlifetime.verify import cbuild
from kvlifetime.verify.cspec import emit
from kvlifetime.verify.spec_codes import CALLS, CONTRA, GuardFacts, ProofCoding, evidence_codes


@pytest.fixture(autouse=True)
def _own_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVLIFETIME_CACHE", str(tmp_path / "cache"))


def _lib(transfers: int, table: TransitionTable | None = None) -> Any:
    return cbuild.build(emit(transfers=transfers, table=table, exports=True), name="spec").library


def _args(proofs: Sequence[int]) -> tuple[Any, int]:
    return (ctypes.c_ubyte * max(1, len(proofs)))(*proofs), len(proofs)


def _after(p: GrantProof, ev: Any) -> GrantProof | None:
    try:
        p.check(ev)
    except ContradictoryEvidence:
        return None
    q = p.copy()
    q.record(ev)
    return q


@pytest.mark.parametrize("transfers", [1, 2])
def test_the_grant_proof_in_c_is_the_specifications(transfers: int) -> None:
    lib = _lib(transfers)
    coding = ProofCoding(transfers)
    codes = evidence_codes(transfers)
    assert lib.kvl_sizes(0) == coding.size and lib.kvl_sizes(1) == len(codes)
    seen = 0
    for p in coding.proofs():
        pc = coding.encode(p)
        assert lib.kvl_pfact(pc) & 1 == int(p.closed), (p, "closed")
        for e, (_, evs) in enumerate(codes):
            q = _after(p, evs[0])
            want = CONTRA if q is None else coding.encode(q)
            assert lib.kvl_prove(pc, e) == want, (p, evs[0])
            seen += 1
    assert seen == len(list(coding.proofs())) * len(codes)  # every proof the model can hold


def _python_fire(table: TransitionTable, state: str, event: str, proofs: list[GrantProof]) -> str:
    try:
        target = table.step(state, event, GuardFacts(proofs))
    except IllegalTransition:
        return "refused"
    return "refused" if target is None else target


def _python_advance(state: str, proofs: list[GrantProof]) -> str:
    facts = GuardFacts(proofs)
    while True:
        for _event, guard, target in _CHAIN[state]:
            if guard(facts):
                state = target
                break
        else:
            return state


def _state_name(table: TransitionTable, code: int) -> str:
    return "refused" if code < 0 else table.states[code - 1]


def _cases(transfers: int) -> list[list[tuple[int, GrantProof]]]:
    coding = ProofCoding(transfers)
    every = [(coding.encode(p), p) for p in coding.proofs()]
    out: list[list[tuple[int, GrantProof]]] = [[]]
    out += [[x] for x in every]
    out += [list(c) for c in itertools.combinations(every, 2)]
    return out


def _disagreements(lib: Any, table: TransitionTable, transfers: int) -> list[str]:
    """Every (state, call or advance, proofs) where the compiled rules and the Python
    specification's differ (the reference is always the specification's own table)."""
    spec = request_table()
    bad: list[str] = []
    for case in _cases(transfers):
        arr, n = _args([c for c, _ in case])
        proofs = [p for _, p in case]
        for i, state in enumerate(spec.states, start=1):
            for k, event in enumerate(CALLS):
                got = _state_name(table, lib.kvl_fire(k, i, arr, n))
                want = _python_fire(spec, state, event, proofs)
                if got != want:
                    bad.append(f"{state} --{event}--> C {got}, Python {want} ({proofs})")
            got = _state_name(table, lib.kvl_advance(i, arr, n))
            want = _python_advance(state, proofs)
            if got != want:
                bad.append(f"{state} advance: C {got}, Python {want} ({proofs})")
    return bad


@pytest.mark.parametrize("transfers", [1, 2])
def test_the_request_rows_in_c_are_the_specifications(transfers: int) -> None:
    table = request_table()
    assert _disagreements(_lib(transfers, table), table, transfers) == []


def test_a_changed_row_is_caught() -> None:
    table = request_table()
    rows = table.rows
    i = next(
        k for k, r in enumerate(rows) if (r.source, r.event) == ("finished", "transfer_quiesced")
    )
    # A finished request whose grants are all closed skips transfer_quiesced: released with
    # no release call (the C must differ from the specification wherever the row fires).
    changed: tuple[Row, ...] = (
        *rows[:i],
        attrs.evolve(rows[i], target="released"),
        *rows[i + 1 :],
    )
    index: dict[tuple[str, str], tuple[Row, ...]] = {}
    for r in changed:
        index[(r.source, r.event)] = (*index.get((r.source, r.event), ()), r)
    drifted = attrs.evolve(table, rows=changed, index=index)
    bad = _disagreements(_lib(1, drifted), drifted, 1)
    assert bad and all(b.startswith("finished advance: C released") for b in bad)


def test_a_missing_compiler_is_a_typed_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CC", "/nonexistent/cc")
    with pytest.raises(cbuild.CompilerUnavailable, match="CC"):
        cbuild.build("int f(void) { return 1; }")
    monkeypatch.delenv("CC")
    monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.raises(cbuild.CompilerUnavailable, match="no C compiler"):
        cbuild.build("int f(void) { return 1; }")


def test_a_compile_error_says_what_the_compiler_said() -> None:
    with pytest.raises(cbuild.CompilerUnavailable, match="failed to compile") as e:
        cbuild.build("int f(void) { return undefined_name; }", name="broken")
    assert "undefined_name" in str(e.value)


def test_a_build_is_cached_by_its_source() -> None:
    first = cbuild.build("int f(void) { return 7; }", name="cached")
    again = cbuild.build("int f(void) { return 7; }", name="cached")
    assert first.compiled and not again.compiled and first.path == again.path
    assert again.library.f() == 7
    other = cbuild.build("int f(void) { return 8; }", name="cached")
    assert other.path != first.path and other.library.f() == 8
    assert sorted(p.name for p in first.path.parent.iterdir()) == sorted(
        [first.path.name, other.path.name]
    )
