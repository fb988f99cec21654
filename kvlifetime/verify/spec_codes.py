"""The specification packed into codes, for the models generated from it.

A generated model (the Promela model for SPIN, ``promela.py``; the compiled checker's C,
``cspec.py``) cannot run ``kvlifetime.spec``'s Python: it reads tables of small integers. This
module derives them *from* the specification, by running it, never by restating it:

- **the grant proof, packed** (``ProofCoding``): ``spec.proof.GrantProof`` in one byte for
  transfers numbered up to ``t``; ``proof_tables`` runs ``GrantProof.check`` / ``record`` on
  every packed proof and every evidence code the model can send (``evidence_codes``), giving
  what each proof becomes (``CONTRA``: the evidence contradicts it, refused);
- **the request guards, read by running them** (``guard_shapes``): each guard of the request
  table must be "every open grant's proof has property X" or "some open grant's proof has
  property X"; it is probed on no open grant, on every single proof and on every pair, which
  gives the quantifier and X as a set of packed proofs. A guard of another form is refused
  (``NotExpressible``), never approximated.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from itertools import product
from typing import Any

import attrs

from kvlifetime.errors import ContradictoryEvidence
from kvlifetime.evidence import (
    AccessRevoked,
    CancelReceived,
    Evidence,
    LeaseExpired,
    PeerLost,
    SchedulingStopped,
    TransferCompleted,
    TransferQuiesced,
)
from kvlifetime.grant import GrantId
from kvlifetime.spec.proof import GrantProof
from kvlifetime.spec.vocabulary import RequestEvent

CONTRA = 255  # "the evidence contradicts what is proven" (no packed proof is 255)

CALLS: tuple[str, ...] = tuple(
    e.value
    for e in (
        RequestEvent.REJECTED,
        RequestEvent.FINISHED,
        RequestEvent.RELEASED,
        RequestEvent.FORCE_RELEASED,
    )
)
"""The call-driven request events (the others are evidence-driven, in ``PROOF_CHAIN``): a
generated model fires each as a call of its own; the C numbers them in this order."""


class NotExpressible(Exception):
    """A generated model cannot state the specification: a guard of another form, or evidence
    codes that act differently. The specification's (or its caller's) fault; nothing was
    generated."""


@attrs.frozen(slots=True)
class ProofCoding:
    """``GrantProof`` packed into one byte for transfers numbered up to ``t``: bit 0 cancel
    received, bit 1 revoked, bit 2 suspect, then ``last_seq + 1`` (0: not proven) and
    ``through_seq``. The suspect *reason* is not kept: no guard reads it."""

    t: int  # transfers per grant

    @property
    def last_bits(self) -> int:
        return (self.t + 1).bit_length()  # values 0 .. t + 1

    @property
    def through_bits(self) -> int:
        return max(1, self.t.bit_length())  # values 0 .. t

    @property
    def size(self) -> int:
        return 1 << (3 + self.last_bits + self.through_bits)

    def encode(self, p: GrantProof) -> int:
        last = 0 if p.last_seq is None else p.last_seq + 1
        return (
            int(p.cancel_received)
            | int(p.revoked) << 1
            | int(p.suspect is not None) << 2
            | last << 3
            | p.through_seq << (3 + self.last_bits)
        )

    def proofs(self) -> Iterator[GrantProof]:
        """Every proof the model can hold: each field over its range."""
        for cr, last, through, revoked, suspect in product(
            (False, True),
            (None, *range(self.t + 1)),
            range(self.t + 1),
            (False, True),
            (None, "lease_expired"),
        ):
            p = GrantProof()
            p.cancel_received, p.last_seq, p.through_seq = cr, last, through
            p.revoked, p.suspect = revoked, suspect
            yield p


def evidence_codes(t: int) -> list[tuple[str, list[Evidence]]]:
    """The evidence the model can send, in ``EV_*`` code order: (name, the evidence objects
    that code stands for; more than one must act alike, checked in ``proof_tables``)."""
    gid, req, peer = GrantId("promela", 1), "r", "p"
    codes: list[tuple[str, list[Evidence]]] = [("CR", [CancelReceived(gid, req, peer)])]
    codes += [(f"SS{v}", [SchedulingStopped(gid, req, peer, last_seq=v)]) for v in range(t + 1)]
    codes += [(f"TQ{v}", [TransferQuiesced(gid, req, peer, through_seq=v)]) for v in range(t + 1)]
    codes += [(f"TC{v}", [TransferCompleted(gid, req, peer, last_seq=v)]) for v in range(t + 1)]
    codes.append(("AR", [AccessRevoked(peer, gid, req)]))
    codes.append(("SUSPECT", [LeaseExpired(gid, req, peer), PeerLost(peer)]))
    return codes


def _after(p: GrantProof, ev: Evidence) -> GrantProof | None:
    """``p`` after ``ev`` as the specification's ``GrantProof`` takes it; ``None``: refused."""
    try:
        p.check(ev)
    except ContradictoryEvidence:
        return None
    q = p.copy()
    q.record(ev)
    return q


def proof_tables(coding: ProofCoding) -> tuple[dict[tuple[int, int], int], dict[int, GrantProof]]:
    """``pfnext`` as a mapping (packed proof, evidence code) -> packed proof or ``CONTRA``, and
    every packed proof's ``GrantProof``."""
    codes = evidence_codes(coding.t)
    nxt: dict[tuple[int, int], int] = {}
    proofs: dict[int, GrantProof] = {}
    for p in coding.proofs():
        code = coding.encode(p)
        proofs[code] = p
        for e, (name, evs) in enumerate(codes):
            outs = {None if q is None else coding.encode(q) for q in (_after(p, ev) for ev in evs)}
            if len(outs) != 1:
                raise NotExpressible(f"evidence {name} stands for evidence that acts differently")
            out = outs.pop()
            nxt[(code, e)] = CONTRA if out is None else out
    return nxt, proofs


# ------------------------------------------------------------------ the guards, read by running


class GuardFacts:
    """What a request guard may look at (``spec.vocabulary.RequestFacts``)."""

    def __init__(self, proofs: Sequence[GrantProof]) -> None:
        self._open = [p for p in proofs if not p.closed]

    def open_proofs(self) -> Iterable[GrantProof]:
        return self._open


@attrs.frozen(slots=True)
class GuardShape:
    """A request guard as "every" / "some" open grant's proof with a property."""

    name: str
    every: bool  # True: every open grant (vacuously true); False: some open grant
    holds: frozenset[int]  # the packed open proofs that have the property


def guard_shapes(guards: dict[str, Callable[[Any], bool]], coding: ProofCoding) -> list[GuardShape]:
    """Read each guard by running it on the model's proofs. Raises ``NotExpressible`` for a
    guard that is not "every" / "some" open grant with a property of its proof."""
    _, proofs = proof_tables(coding)
    opened = {c: p for c, p in proofs.items() if not p.closed}
    shapes = []
    for name, fn in guards.items():
        every = bool(fn(GuardFacts([])))
        holds = frozenset(c for c, p in opened.items() if fn(GuardFacts([p])))
        for (a, pa), (b, pb) in product(opened.items(), repeat=2):
            want = (a in holds and b in holds) if every else (a in holds or b in holds)
            if bool(fn(GuardFacts([pa, pb]))) != want:
                raise NotExpressible(
                    f"guard {name!r} is not '{'every' if every else 'some'} open grant with a "
                    "property of its proof': a generated model cannot state it"
                )
        shapes.append(GuardShape(name, every, holds))
    return shapes


__all__ = [
    "CALLS",
    "CONTRA",
    "GuardFacts",
    "GuardShape",
    "NotExpressible",
    "ProofCoding",
    "evidence_codes",
    "guard_shapes",
    "proof_tables",
]
