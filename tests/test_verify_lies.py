"""``kvlifetime verify`` with lying peers (``--faults lie``): README, "Who may prove what".

A lying peer sends, at any moment, every claim it may not make. With provenance (every policy
but ``trusting``) the real ledger refuses each one as unauthorized and nothing changes, so the
proof policy stays safe and explores exactly the states it explores without lies; a receiver
that stamps wire evidence as local (``trusting``) believes them and is refuted.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

import kvlifetime.ledger.proofs
import kvlifetime.provenance
from kvlifetime.cli import main
from kvlifetime.evidence import AccessRevoked, Evidence, GrantEvidence
from kvlifetime.ledger import BlockLedger
from kvlifetime.source import LOCAL, Source, SourceKind
from kvlifetime.verify import Config, Event, Fault, Policy, explore, parse_faults, run_events
from kvlifetime.verify.model import (
    ACK_KINDS,
    RELEASED,
    enabled,
    initial,
    lie_evidence,
    lie_table,
    lies,
    step,
)

LYING = Config(2, 2, 2, faults=parse_faults("lie,crash,fence"))


def test_proof_policy_passes_2x2x2_with_lying_peers_crashes_and_fencing() -> None:
    # Every lie refused in every state the search expands: the same states as without lies
    # (explore.py, "lies"), measured and pinned.
    r = explore(LYING, Policy.PROOF)
    assert r.verdict == "pass" and r.complete, r.to_text()
    assert r.states == 8_557
    honest = explore(Config(2, 2, 2, faults=LYING.faults - {Fault.LIE}), Policy.PROOF)
    assert honest.states == r.states
    assert "provenance" in r.to_text()


def test_a_trusting_receiver_is_refuted_by_a_peer_that_revokes_itself() -> None:
    cfg = Config(2, 2, 2, faults=parse_faults("lie"))
    r = explore(cfg, Policy.TRUSTING)
    assert r.violation is not None and r.violation.invariant == "isolation"
    # admit, grant, finish, post, the peer says AccessRevoked about itself (believed: the grant
    # closes, r1 is released), the write lands on the next generation.
    assert [s.event.kind for s in r.trace] == ["admit", "grant", "finish", "post", "lie", "land"]
    assert r.states == 806
    assert r.trace[4].label == "lie: p1 sends AccessRevoked(p1)"
    events = [s.event for s in r.trace]
    # Replayed on a fresh checked ledger: the same violation; by hand, the ledger released the
    # blocks on what it took for proof (no force_release), under a write still in flight.
    before, _n, v = run_events(cfg, Policy.TRUSTING, events[:-1], checked=True)
    assert v is None
    g = before.env.grants[0]
    assert before.env.reqs[0].phase == RELEASED and g.transfers == (0,)
    ledger = before.snap.ledger
    assert (ledger.generation(g.grant.blocks) > g.grant.generations).all()
    assert ledger.stats().unsafe_releases == 0
    _s, _n, again = run_events(cfg, Policy.TRUSTING, events, checked=True)
    assert again == r.violation
    # The same run with provenance: the lie is refused, the write lands where it should.
    _s, notes, ok = run_events(cfg, Policy.PROOF, events, checked=True)
    assert ok is None
    assert any("UnauthorizedEvidence" in n for n in notes[4])


def test_trusting_without_lies_is_the_proof_policy() -> None:
    cfg = Config(2, 2, 2, faults=parse_faults("crash,fence"))
    a, b = explore(cfg, Policy.TRUSTING), explore(cfg, Policy.PROOF)
    assert a.verdict == b.verdict == "pass" and a.states == b.states


@pytest.mark.parametrize("faults", ["lie,loss", "lie,crash,fence,timeout"])
def test_trusting_is_refuted_in_six_steps_with_other_faults(faults: str) -> None:
    r = explore(Config(2, 2, 2, faults=parse_faults(faults), max_faults=1), Policy.TRUSTING)
    assert r.violation is not None and r.violation.invariant == "isolation"
    assert len(r.trace) == 6 and any(s.event.kind == "lie" for s in r.trace)


def _two_grants() -> tuple[Config, Any]:
    """A state with a grant on each of two peers, one transfer posted on each."""
    cfg = Config(2, 2, 2, faults=parse_faults("lie"))
    s = initial(cfg)
    for ev in [
        Event("admit"),
        Event("grant", 0, 0),
        Event("admit"),
        Event("grant", 1, 1),
        Event("post", 0),
        Event("post", 1),
    ]:
        assert ev in enabled(s, cfg)
        s, _ = step(s, ev, cfg, Policy.PROOF)
    return cfg, s


def test_the_lie_table_sends_every_claim_a_peer_may_not_make() -> None:
    cfg, s = _two_grants()
    table = lie_table(s.env, cfg)
    kinds = {(lie.kind, lie.grant >= 0) for lie in table}
    assert ("AccessRevoked", False) in kinds  # peer-wide, about itself
    assert ("AccessRevoked", True) in kinds and ("LeaseExpired", True) in kinds
    assert ("PeerLost", False) in kinds
    for gi, g in enumerate(s.env.grants):
        other = 1 - g.peer
        for kind in ACK_KINDS:
            assert any(x.kind == kind and x.grant == gi and x.sender == other for x in table)
            # In the grant's peer's name and in its own.
            names = {x.subject for x in table if x.kind == kind and x.grant == gi}
            assert names == {0, 1}
    # The evidence is stamped with the liar's connection, never LOCAL.
    for lie in table:
        ev = lie_evidence(s.env, cfg, lie, Policy.PROOF)
        assert ev.source == Source.peer(f"p{lie.sender + 1}")
        assert lie_evidence(s.env, cfg, lie, Policy.TRUSTING).source == LOCAL


def test_every_lie_is_refused_as_unauthorized_and_changes_nothing() -> None:
    cfg, s = _two_grants()
    evs = lies(s, cfg)
    assert len(evs) == len(lie_table(s.env, cfg)) == 26
    for ev in evs:
        nxt, notes = step(s, ev, cfg, Policy.PROOF)
        assert nxt.env is s.env and nxt.snap is s.snap  # a self-loop
        assert any("UnauthorizedEvidence" in n for n in notes), notes


def test_honest_wire_evidence_carries_its_peer_and_local_evidence_stays_local(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    seen: list[Evidence] = []
    real = BlockLedger.apply

    def spy(self: BlockLedger, ev: Evidence) -> Any:
        seen.append(ev)
        return real(self, ev)

    monkeypatch.setattr(BlockLedger, "apply", spy)
    cfg = Config(1, 2, 1, faults=parse_faults("crash,fence,timeout,retry"))
    assert explore(cfg, Policy.PROOF).verdict == "pass"
    kinds = {type(e).__name__ for e in seen}
    assert {"AccessRevoked", "PeerLost", "LeaseExpired"} <= kinds
    assert set(ACK_KINDS) <= kinds
    for e in seen:
        if type(e).__name__ in ACK_KINDS:
            assert isinstance(e, GrantEvidence)
            assert e.source.kind is SourceKind.PEER and e.source.identity == e.peer
        else:
            assert e.source == LOCAL


def test_a_ledger_that_believes_a_lie_breaks_provenance(monkeypatch: pytest.MonkeyPatch) -> None:
    # The check is not only argued: a ledger whose provenance check lets AccessRevoked from a
    # peer through is caught at the first lie (the search takes it; its step breaks).
    real = kvlifetime.provenance.check_source

    def lax(ev: Evidence) -> None:
        if not isinstance(ev, AccessRevoked):
            real(ev)

    monkeypatch.setattr(kvlifetime.ledger.proofs, "check_source", lax)
    r = explore(Config(1, 1, 1, faults=parse_faults("lie")), Policy.PROOF)
    assert r.violation is not None and r.violation.invariant == "provenance"
    assert r.trace[-1].event.kind == "lie"
    assert "accepted a lie" in r.violation.message


def test_cli_verify_trusting_with_lies_exits_1(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["verify", "--policy", "trusting", "--faults", "lie", "--format", "json"]
    assert main(args) == 1
    doc = json.loads(capsys.readouterr().out)
    assert doc["violation"]["invariant"] == "isolation" and len(doc["trace"]) == 6
    assert main(["verify", "--policy", "proof", "--faults", "lie"]) == 0
    assert "provenance" in capsys.readouterr().out
