"""A state of the model, projected onto the variables the generated models keep.

The Promela model (``promela.py``) and the compiled checker's C (``cenv.py``) keep the state of
``kvlifetime verify``'s model as flat integers, in the order the Promela model's
``print_state`` prints them (``of_vector`` reads that order). ``of_state`` projects a state
of the Python model the same way, so that the two sides can be compared state by state: the
equality tests of the generated models, and the mapping of a compiled checker's counterexample
back onto the Python model's events (``cenv.python_events``).

A projection keeps what both sides keep: each request's owner phase and ledger state, each
grant's flags, transfers, proof and messages, each peer's flags, the fault budgets. It leaves
out what only one side has (grant ids, the ledger's internals beyond each grant's proof).
"""

from __future__ import annotations

import functools
from typing import Any

from kvlifetime.spec.proof import GrantProof
from kvlifetime.spec.table import request_table
from kvlifetime.verify.promela import QC, QL
from kvlifetime.verify.spec_codes import ProofCoding, proof_tables
from kvlifetime.verify.state import (
    FAILED,
    IN_FLIGHT,
    LANDED,
    LANDED_UNSEEN,
    RELEASED,
    TO_LEDGER,
    TO_PEER,
    Config,
    State,
)

_PHASES = ("unadmitted", "live", "finished", "rejected", "released")
_SPIN_TRANSFERS = {1: "in_flight", 2: "failed", 3: "landed", 4: "unseen"}
_OUR_TRANSFERS = {IN_FLIGHT: "in_flight", FAILED: "failed", LANDED: "landed"}
_OUR_TRANSFERS[LANDED_UNSEEN] = "unseen"
_KINDS = {1: "CancelReceived", 2: "SchedulingStopped", 3: "TransferQuiesced"}
_KINDS[4] = "TransferCompleted"


def proof_fields(p: GrantProof) -> tuple[Any, ...]:
    return (p.cancel_received, p.last_seq, p.through_seq, p.revoked, p.suspect is not None)


@functools.cache
def _tables(transfers_per_grant: int) -> tuple[Any, Any]:
    """The request states and the packed proofs, computed once (each line needs them)."""
    _, proofs = proof_tables(ProofCoding(transfers_per_grant))
    return request_table().states, proofs


def of_vector(v: list[int], config: Config) -> tuple[Any, ...]:
    """A state as the generated models keep it: ``print_state``'s integers, in order."""
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
                None if released else proof_fields(proofs[pf[g]]),
                msgs_l,
                msgs_c,
            )
        )
    peers = tuple((bool(x & 1), bool(x & 2), bool(x & 4)) for x in peerf)
    return (admitted, reqs, tuple(grants), peers, budgets)


def of_state(s: State, config: Config) -> tuple[Any, ...]:
    """A state of ``kvlifetime verify``'s model (either engine), the same way."""
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


def of_line(line: str, config: Config) -> tuple[Any, ...]:
    """A ``KVSTATE ...`` line of the Promela model's ``print_state``."""
    return of_vector([int(x) for x in line.split()[1:]], config)


__all__ = ["of_line", "of_state", "of_vector", "proof_fields"]
