"""The Promela model generated from the specification (``kvlifetime.verify.promela``) and the
SPIN swarm on it (``kvlifetime.verify.swarm``).

- drift: the model follows the specification: a changed row, guard or proof rule changes the
  generated text where it should, and a guard the model cannot state is refused;
- the same states: on the smallest shape, every state SPIN stores (printed by the model built
  with ``project=True`` and ``pan -DPRINTF``) is, field by field, a state ``kvlifetime verify``
  reaches over the real ledger with no reduction, and the other way round (the sets are equal);
- the same verdicts as ``kvlifetime verify`` (timeout, trusting; naive and proof at 1x1x1 are
  in test_spin_anchor.py);
- the swarm finds a planted bug (the naive policy) on a shape past exact search.

The SPIN tests are skipped only when ``spin`` or ``gcc`` is missing and
``KVLIFETIME_REQUIRE_SPIN`` is unset.
"""

from __future__ import annotations

import collections
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import attrs
import pytest

from kvlifetime.spec.proof import GrantProof
from kvlifetime.spec.table import Row, request_table
from kvlifetime.verify import Config, Policy, explore, parse_faults
from kvlifetime.verify.events import enabled
from kvlifetime.verify.keys import concrete_key
from kvlifetime.verify.projection import of_line, of_state
from kvlifetime.verify.promela import PromelaError, generate
from kvlifetime.verify.semantics import step
from kvlifetime.verify.spec_codes import NotExpressible, ProofCoding, guard_shapes
from kvlifetime.verify.state import (
    initial,
)
from kvlifetime.verify.swarm import run_swarm

_HAVE = shutil.which("spin") is not None and shutil.which("gcc") is not None
needs_spin = pytest.mark.skipif(
    not _HAVE and not os.environ.get("KVLIFETIME_REQUIRE_SPIN"),
    reason="spin or gcc not installed (Debian: apt-get install spin gcc); "
    "set KVLIFETIME_REQUIRE_SPIN=1 to make this a failure",
)
ALL = "reorder,duplicate,delay,loss,crash,fence,timeout,retry,fail,lie"
SMALLEST = Config(1, 1, 1, faults=parse_faults(ALL))


# ------------------------------------------------------------------ drift


def _with_rows(rows: tuple[Row, ...]) -> Any:
    t = request_table()
    return attrs.evolve(t, rows=rows, index=_index(rows))


def _index(rows: tuple[Row, ...]) -> dict[tuple[str, str], tuple[Row, ...]]:
    out: dict[tuple[str, str], tuple[Row, ...]] = {}
    for r in rows:
        out[(r.source, r.event)] = (*out.get((r.source, r.event), ()), r)
    return out


def _diff(a: str, b: str) -> tuple[list[str], list[str]]:
    la, lb = collections.Counter(a.splitlines()), collections.Counter(b.splitlines())
    return sorted((la - lb).elements()), sorted((lb - la).elements())


def test_every_row_of_the_request_table_is_an_option_of_the_model() -> None:
    text = generate(SMALLEST, Policy.PROOF)
    for r in request_table().rows:
        guard = f" && G_{r.guard}(r)" if r.guard else ""
        assert f":: rs[r] == RS_{r.source}{guard} -> rs[r] = RS_{r.target}" in text


def test_a_changed_row_changes_the_model_there_and_nowhere_else() -> None:
    rows = request_table().rows
    # scheduling_stopped --transfer_quiesced--> transfer_quiesced, retargeted to quarantined
    i = next(
        k
        for k, r in enumerate(rows)
        if (r.source, r.event) == ("scheduling_stopped", "transfer_quiesced")
    )
    changed = (*rows[:i], attrs.evolve(rows[i], target="quarantined"), *rows[i + 1 :])
    before = generate(SMALLEST, Policy.PROOF)
    after = generate(SMALLEST, Policy.PROOF, table=_with_rows(changed))
    gone, new = _diff(before, after)
    assert [g.strip() for g in gone] == [
        ":: rs[r] == RS_scheduling_stopped && G_all_grants_closed(r) -> "
        "rs[r] = RS_transfer_quiesced"
    ]
    assert [n.strip() for n in new] == [
        ":: rs[r] == RS_scheduling_stopped && G_all_grants_closed(r) -> rs[r] = RS_quarantined"
    ]
    # a row dropped: its option goes
    dropped = generate(SMALLEST, Policy.PROOF, table=_with_rows(rows[:i] + rows[i + 1 :]))
    gone, new = _diff(before, dropped)
    assert len(gone) == 1 and "RS_scheduling_stopped" in gone[0] and new == []


def test_a_changed_proof_rule_changes_the_tables(monkeypatch: pytest.MonkeyPatch) -> None:
    before = generate(SMALLEST, Policy.PROOF)
    # A grant closed by SchedulingStopped alone (through_seq ignored): a weaker rule.
    monkeypatch.setattr(
        GrantProof, "closed", property(lambda p: p.revoked or p.last_seq is not None)
    )
    after = generate(SMALLEST, Policy.PROOF)
    gone, new = _diff(before, after)
    # Only the tables change: what is closed (pfact), and what a suspect mark does to a proof
    # that is now closed (GrantProof.mark_suspect leaves a closed grant alone: pfnext).
    assert any(line.strip().startswith("pfact[") for line in gone)
    assert all(line.strip().startswith(("pfact[", "pfnext[")) for line in gone + new)


def test_a_guard_the_model_cannot_state_is_refused() -> None:
    coding = ProofCoding(1)

    def exactly_one_open(f: Any) -> bool:
        return len(list(f.open_proofs())) == 1

    with pytest.raises(NotExpressible, match="cannot state it"):
        guard_shapes({"exactly_one_open": exactly_one_open}, coding)
    shapes = guard_shapes(dict(request_table().guards), coding)
    assert {s.name: s.every for s in shapes}["quarantine_due"] is False
    assert {s.name: s.every for s in shapes}["all_grants_closed"] is True


def test_what_the_model_cannot_state_is_refused() -> None:
    with pytest.raises(PromelaError, match="one block"):
        generate(Config(2, 2, 2, blocks_per_request=2), Policy.PROOF)
    with pytest.raises(PromelaError, match="no policy"):
        generate(SMALLEST, Policy.FIRST_RANK)
    with pytest.raises(PromelaError, match="ranks"):
        generate(Config(1, 1, 1, ranks=2), Policy.PROOF)


# ------------------------------------------------------------------ the same states


def _our_states(config: Config, policy: Policy) -> set[tuple[Any, ...]]:
    """Every state ``kvlifetime verify`` reaches with no reduction (breadth first over the real
    ledger; any peer may crash), projected. Lies are left out: under proof every one is
    refused, a self-loop (``kvlifetime verify`` checks that; test_verify_lies.py)."""
    root = initial(config)
    seen = {concrete_key(root, config)}
    out = {of_state(root, config)}
    queue = collections.deque([root])
    while queue:
        s = queue.popleft()
        for ev in enabled(s, config):
            nxt = step(s, ev, config, policy)[0]
            k = concrete_key(nxt, config)
            if k not in seen:
                seen.add(k)
                out.add(of_state(nxt, config))
                queue.append(nxt)
    return out


def _spin_states(config: Config, policy: Policy, workdir: Path) -> tuple[set[Any], int]:
    (workdir / "m.pml").write_text(generate(config, policy, project=True))
    subprocess.run(["spin", "-a", "m.pml"], cwd=workdir, check=True, capture_output=True)
    subprocess.run(
        ["gcc", "-O0", "-DSAFETY", "-DPRINTF", "-DMEMLIM=1024", "-w", "-o", "pan", "pan.c"],
        cwd=workdir,
        check=True,
        capture_output=True,
    )
    out = subprocess.run(
        ["./pan", "-m100000", "-w22"], cwd=workdir, check=True, capture_output=True, text=True
    ).stdout
    assert "errors: 0" in out
    lines = [ln for ln in out.splitlines() if ln.startswith("KVSTATE")]
    return {of_line(ln, config) for ln in lines}, len(lines)


@needs_spin
def test_spin_stores_the_states_kvlifetime_verify_reaches(tmp_path: Path) -> None:
    ours = _our_states(SMALLEST, Policy.PROOF)
    theirs, printed = _spin_states(SMALLEST, Policy.PROOF, tmp_path)
    assert len(ours) > 1000
    assert theirs - ours == set()
    assert ours - theirs == set()
    # It prints after every step taken, also into a state it had stored: more lines than states.
    assert printed > len(theirs)


# ------------------------------------------------------------------ the same verdicts


@needs_spin
@pytest.mark.parametrize("policy", [Policy.TIMEOUT, Policy.TRUSTING])
def test_spin_gives_kvlifetime_verifys_verdict(policy: Policy, tmp_path: Path) -> None:
    from bench import spin_anchor

    config = Config(1, 2, 1, faults=parse_faults(ALL), max_faults=1)
    ours = explore(config, policy)
    res = spin_anchor.run_spin(config, policy, tmp_path, memlim_mb=1024, hash_log2=20)
    row = spin_anchor.spin_row("1x2x1/k1", config, policy, res)
    assert ours.violation is not None and row.invariant == ours.violation.invariant
    assert res.trail_steps == len(ours.trace)


# ------------------------------------------------------------------ the swarm


@needs_spin
def test_the_swarm_finds_a_planted_bug_past_exact_search(tmp_path: Path) -> None:
    # 3x2x3 with every fault kind and only the per-kind bounds: past exact search (SPIN's
    # exact search runs out of 8 GB there; kvlifetime verify does not finish in 10 minutes).
    config = Config(3, 2, 3, faults=parse_faults(ALL))
    res = run_swarm(
        config, Policy.NAIVE, tmp_path, runs=4, seconds_per_run=20, bits_log2=22, optimize="-O0"
    )
    assert res.verdict == "refuted" and res.invariant == "isolation"
    assert res.trail_steps is not None and res.trail_steps > 0
    assert all(r.hash_factor is not None for r in res.runs)
