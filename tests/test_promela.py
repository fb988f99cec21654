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
import functools
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
from kvlifetime.verify.promela import QC, QL, PromelaError, generate
from kvlifetime.verify.semantics import step
from kvlifetime.verify.spec_codes import NotExpressible, ProofCoding, guard_shapes, proof_tables
from kvlifetime.verify.state import (
    FAILED,
    IN_FLIGHT,
    LANDED,
    LANDED_UNSEEN,
    RELEASED,
    TO_LEDGER,
    TO_PEER,
    State,
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

_PHASES = ("unadmitted", "live", "finished", "rejected", "released")
_SPIN_TRANSFERS = {1: "in_flight", 2: "failed", 3: "landed", 4: "unseen"}
_OUR_TRANSFERS = {IN_FLIGHT: "in_flight", FAILED: "failed", LANDED: "landed"}
_OUR_TRANSFERS[LANDED_UNSEEN] = "unseen"
_KINDS = {1: "CancelReceived", 2: "SchedulingStopped", 3: "TransferQuiesced"}
_KINDS[4] = "TransferCompleted"


def _proof_fields(p: GrantProof) -> tuple[Any, ...]:
    return (p.cancel_received, p.last_seq, p.through_seq, p.revoked, p.suspect is not None)


@functools.cache
def _tables(transfers_per_grant: int) -> tuple[Any, Any]:
    """The request states and the packed proofs, computed once (each line needs them)."""
    _, proofs = proof_tables(ProofCoding(transfers_per_grant))
    return request_table().states, proofs


def _spin_projection(line: str, config: Config) -> tuple[Any, ...]:
    """A state as the model printed it (``print_state``), field by field."""
    v = [int(x) for x in line.split()[1:]]
    r_, p_ = config.requests, config.peers
    g_ = r_ * p_
    it = iter(v)

    def take(n: int) -> list[int]:
        return [next(it) for _ in range(n)]

    admitted = take(1)[0]
    phase, rs, stale = take(r_), take(r_), take(g_)
    gf, tf, pf, lqn, cqn, peerf = take(g_), take(g_), take(g_), take(g_), take(g_), take(p_)
    lq, cq = take(g_ * QL), take(g_ * QC)
    budgets = tuple(take(5))
    states, proofs = _tables(config.transfers_per_grant)
    reqs = tuple((_PHASES[phase[r]], None if rs[r] == 0 else states[rs[r] - 1]) for r in range(r_))
    grants: list[Any] = []
    for g in range(g_):
        if not gf[g] & 1:
            grants.append(None)
            continue
        f = gf[g]
        transfers = tuple(
            _SPIN_TRANSFERS[(tf[g] >> (3 * s)) & 7] for s in range(2) if (tf[g] >> (3 * s)) & 7
        )
        released = phase[g // p_] == 4
        msgs_l = tuple(
            (_KINDS[m & 7], (m >> 3) & 3, not m & 32, bool(m & 64))
            for m in lq[g * QL : g * QL + lqn[g]]
        )
        msgs_c = tuple((not m & 32, bool(m & 64)) for m in cq[g * QC : g * QC + cqn[g]])
        grants.append(
            (
                bool(stale[g]),
                bool(f & 2),
                bool(f & 4),
                bool(f & 8),
                bool(f & 16),
                bool(f & 32),
                f >> 6,
                transfers,
                None if released else _proof_fields(proofs[pf[g]]),
                msgs_l,
                msgs_c,
            )
        )
    peers = tuple((bool(x & 1), bool(x & 2), bool(x & 4)) for x in peerf)
    return (admitted, reqs, tuple(grants), peers, budgets)


def _our_projection(s: State, config: Config) -> tuple[Any, ...]:
    """A state of ``kvlifetime verify`` (the real ledger and the environment), the same way."""
    env, snap = s.env, s.snap
    r_, p_ = config.requests, config.peers
    reqs: list[tuple[str, str | None]] = []
    for r in range(r_):
        if r >= len(env.reqs):
            reqs.append(("unadmitted", None))
            continue
        q = env.reqs[r]
        reqs.append((q.phase, "released" if q.phase == RELEASED else snap.state(q.key)))
    grants: list[Any] = [None] * (r_ * p_)
    for gi, g in enumerate(env.grants):
        released = env.reqs[g.req].phase == RELEASED
        proof = None
        if not released:
            cr, last, through, revoked, suspect, _closed = snap.proof(g.grant)
            proof = (cr, None if last == -1 else last, through, revoked, suspect != "")
        msgs_l = tuple(
            (m.kind, m.value, m.dupable, m.delayed)
            for m in env.msgs
            if m.grant == gi and m.dest == TO_LEDGER
        )
        msgs_c = tuple(
            (m.dupable, m.delayed) for m in env.msgs if m.grant == gi and m.dest == TO_PEER
        )
        grants[g.req * p_ + g.peer] = (
            snap.stale(g.grant),
            g.cancelled,
            g.stopped,
            g.quiesced_sent,
            g.lease_fired,
            g.silent,
            g.retries,
            tuple(_OUR_TRANSFERS[t] for t in g.transfers),
            proof,
            msgs_l,
            msgs_c,
        )
    peers = tuple((p.crashed, p.fenced, p.lost_reported) for p in env.peers)
    budgets = (env.dups_left, env.delays_left, env.losses_left, env.crashes_left, env.faults_left)
    return (env.admitted, tuple(reqs), tuple(grants), peers, budgets)


def _our_states(config: Config, policy: Policy) -> set[tuple[Any, ...]]:
    """Every state ``kvlifetime verify`` reaches with no reduction (breadth first over the real
    ledger; any peer may crash), projected. Lies are left out: under proof every one is
    refused, a self-loop (``kvlifetime verify`` checks that; test_verify_lies.py)."""
    root = initial(config)
    seen = {concrete_key(root, config)}
    out = {_our_projection(root, config)}
    queue = collections.deque([root])
    while queue:
        s = queue.popleft()
        for ev in enabled(s, config):
            nxt = step(s, ev, config, policy)[0]
            k = concrete_key(nxt, config)
            if k not in seen:
                seen.add(k)
                out.add(_our_projection(nxt, config))
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
    return {_spin_projection(ln, config) for ln in lines}, len(lines)


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
