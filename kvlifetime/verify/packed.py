"""The packed ledger: the verifier's successor over plain values instead of a ``BlockLedger``.

``explore(..., engine="packed")`` runs the very same model (``semantics.step``, ``events``,
``keys``, ``por``, ``lies``: one copy of the environment's rules) over a ``PackedLedger`` in
place of the real ``BlockLedger``. What it keeps is what the model asks of a ledger, as ints,
strings and tuples in three small maps: per block its generation and holder; per request its
state, blocks and grants; per grant the ``Grant`` issued, its proof as the tuple
``GrantProof.key()`` and whether it is open. A copy is three shallow copies; no lock, no
argument checks (the model passes only values it built), no log events, no numpy on the way.

Where its rules come from (so that they are not a second copy left to drift):

- **request transitions** are the specification's compiled table (``spec.table.request_table``)
  and its guards (``spec.vocabulary.REQUEST_GUARDS``), stepped here in ``PROOF_CHAIN`` order
  exactly as ``ledger.transitions`` steps them;
- **what one piece of evidence proves** is the ledger's own ``GrantProof`` (``check`` and
  ``record``), run on a proof rebuilt from the packed tuple;
- **who may say it** is the ledger's own ``provenance.check_source`` / ``check_grant_peer``;
- what is restated here is the bookkeeping around them, as ``ledger.proofs.apply`` and
  ``ledger.requests`` do it: which grant a piece of evidence names (stale, mismatched), a peer-wide
  ``AccessRevoked`` / ``PeerLost`` reaching the peer's open grants, a grant closed once proven
  over, a release bumping its blocks' generations, and the block states the no-leak check reads.

That restated part is **proven equal** to the real ledger, not argued: ``tests/test_verify_packed``
explores a grid of small shapes under every policy and every fault kind with both engines and
requires the same set of canonical keys reached, the same verdict and the same shortest
counterexample length. And a counterexample the packed engine finds is replayed on the real
ledger (``confirm_on_ledger``, below) before it is reported: a reported violation is always
a real one.

Not modelled (``supports`` says why; ``explore`` refuses them for this engine): restarts
(``BlockLedger.after_restart`` and its fence-only grants) and prefix sharing (shared holds).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import attrs
import numpy as np
import numpy.typing as npt

from kvlifetime.errors import (
    DoubleRelease,
    DuplicateRequest,
    IllegalTransition,
    InsufficientEvidence,
    MismatchedEvidence,
    OutOfBlocks,
    SpecDisagreement,
    StaleEvidence,
    UnknownGrant,
    UnknownRequest,
)
from kvlifetime.evidence import AccessRevoked, Evidence, GrantEvidence, PeerLost
from kvlifetime.grant import Access, Grant, GrantId, make_grant, make_grant_id
from kvlifetime.provenance import check_grant_peer, check_source
from kvlifetime.source import SourceKind
from kvlifetime.spec.proof import GrantProof
from kvlifetime.spec.table import request_table
from kvlifetime.spec.vocabulary import PROOF_CHAIN, REQUEST_GUARDS, BlockState, RequestState
from kvlifetime.verify.semantics import run_events
from kvlifetime.verify.state import INCARNATION, Config, Event, Policy, State, Violation, initial

__all__ = ["ENGINES", "PackedLedger", "confirm_on_ledger", "engine_root", "supports"]

_ADMITTED = RequestState.ADMITTED.value
_TRANSFER_QUIESCED = RequestState.TRANSFER_QUIESCED.value
_QUARANTINED = RequestState.QUARANTINED.value

_TABLE = request_table()
# Per state, the evidence-driven transitions in PROOF_CHAIN order: (guard, target), generated
# from the specification's rows (as ``ledger.transitions`` does for the real ledger).
_CHAIN: dict[str, tuple[tuple[Any, str], ...]] = {
    state: tuple(
        (REQUEST_GUARDS[row.guard] if row.guard else (lambda _f: True), row.target)
        for ev in PROOF_CHAIN
        for row in _TABLE.rows_for(state, ev.value)
    )
    for state in _TABLE.states
}

# A proof as ``GrantProof.key()``: (cancel_received, last_seq, through_seq, revoked, suspect).
Proof = tuple[bool, int | None, int, bool, str | None]
_NEW_PROOF: Proof = (False, None, 0, False, None)


def supports(config: Config) -> str | None:
    """Why the packed engine cannot run ``config`` (``None``: it can)."""
    if config.restarts:
        return (
            "restarts: the packed ledger has no after_restart (a previous incarnation's "
            "fence-only quarantine); use engine='ledger'"
        )
    if config.share:
        return "prefix sharing: the packed ledger has no shared holds; use engine='ledger'"
    return None


def _proof(p: Proof) -> GrantProof:
    """The ledger's own ``GrantProof`` holding the facts of ``p``."""
    g = GrantProof.__new__(GrantProof)
    g.cancel_received, g.last_seq, g.through_seq, g.revoked, g.suspect = p
    return g


@attrs.frozen(slots=True)
class _Grant:
    grant: Grant
    proof: Proof
    open: bool  # not proven over yet


@attrs.frozen(slots=True)
class _Request:
    state: str  # a RequestState value
    blocks: tuple[int, ...]
    grants: tuple[int, ...]  # serials, in issue order


class _Facts:
    """What the request guards read (``spec.vocabulary.RequestFacts``): the open proofs."""

    __slots__ = ("_proofs",)

    def __init__(self, proofs: list[GrantProof]) -> None:
        self._proofs = proofs

    def open_proofs(self) -> Iterable[GrantProof]:
        return self._proofs


@attrs.frozen(slots=True)
class QuarantinedRequest:
    """One quarantined request, as ``check_quiet`` reads ``stats().quarantined``."""

    request: str
    reason: str


@attrs.frozen(slots=True)
class PackedStats:
    quarantined: tuple[QuarantinedRequest, ...]


class PackedLedger:
    """The model's ledger as plain values (see the module docstring). Only the calls the
    model makes, with the values it passes; every refusal the model can meet raises the same
    typed error as ``BlockLedger``."""

    __slots__ = ("_gens", "_grants", "_holder", "_reqs", "checked", "incarnation", "next_serial")

    def __init__(self, num_blocks: int, *, incarnation: str) -> None:
        self.incarnation = incarnation
        self.checked = False
        self._gens: list[int] = [0] * num_blocks
        self._holder: list[str | None] = [None] * num_blocks
        self._reqs: dict[str, _Request] = {}
        self._grants: dict[int, _Grant] = {}  # serial -> grant, of requests not released
        self.next_serial = 1

    @property
    def num_blocks(self) -> int:
        return len(self._gens)

    def copy(self) -> PackedLedger:
        # Through __init__ (an empty arena), not object.__new__: a class compiled by mypyc
        # (the accelerator) refuses a blank instance.
        new = PackedLedger(0, incarnation=self.incarnation)
        new._gens = self._gens.copy()
        new._holder = self._holder.copy()
        new._reqs = self._reqs.copy()
        new._grants = self._grants.copy()
        new.next_serial = self.next_serial
        return new

    def __reduce__(self) -> tuple[Any, ...]:
        # Pickled by its fields (the parallel search sends it): a class compiled by mypyc (the
        # accelerator) has no slot state for pickle's default to read.
        fields = (self._gens, self._holder, self._reqs, self._grants, self.next_serial)
        return (_packed_of, (self.incarnation, *fields))

    def fingerprint(self) -> tuple[Any, ...]:
        return (
            tuple(self._gens),
            tuple(self._holder),
            tuple(sorted((k, r.state, r.blocks, r.grants) for k, r in self._reqs.items())),
            tuple(sorted((s, g.proof, g.open) for s, g in self._grants.items())),
            self.next_serial,
        )

    # ------------------------------------------------------------------ queries

    def _get(self, request: str) -> _Request:
        r = self._reqs.get(request)
        if r is None:
            raise UnknownRequest(request)
        return r

    def state(self, request: str) -> RequestState:
        return RequestState(self._get(request).state)

    def proof_of(self, grant: Grant) -> GrantProof:
        g = self._grants.get(grant.id.serial)
        if g is None:
            raise UnknownGrant(f"no live grant {grant.id}")
        return _proof(g.proof)

    def open_grants(self, request: str) -> list[Grant]:
        return [g.grant for s in self._get(request).grants if (g := self._grants[s]).open]

    def generation(self, ids: npt.ArrayLike) -> npt.NDArray[np.uint32]:
        gens = self._gens
        return np.array([gens[int(b)] for b in np.asarray(ids).tolist()], dtype=np.uint32)

    def free_count(self) -> int:
        return sum(h is None for h in self._holder)

    def blocks_of(self, request: str) -> npt.NDArray[np.int64]:
        return np.array(self._get(request).blocks, dtype=np.int64)

    def block_state(self, ids: npt.ArrayLike) -> npt.NDArray[np.uint8]:
        """As ``BlockCounts.derive_states``: from the holder's state and its open grants."""
        out: list[int] = []
        for b in np.asarray(ids).tolist():
            key = self._holder[int(b)]
            if key is None:
                out.append(BlockState.FREE)
                continue
            r = self._reqs[key]
            opened = any(self._grants[s].open for s in r.grants)
            if r.state == _ADMITTED:
                out.append(BlockState.EXPOSED if opened else BlockState.OWNED)
            elif not opened:
                out.append(BlockState.QUIESCED)
            else:
                q = r.state == _QUARANTINED
                out.append(BlockState.QUARANTINED if q else BlockState.DRAINING)
        return np.array(out, dtype=np.uint8)

    def stats(self) -> PackedStats:
        return PackedStats(
            tuple(
                QuarantinedRequest(k, self._quarantine_reason(r))
                for k, r in self._reqs.items()
                if r.state == _QUARANTINED
            )
        )

    def _quarantine_reason(self, r: _Request) -> str:
        """As ``ledger.transitions.moved``: the first open grant's suspicion, else deadline."""
        for s in r.grants:
            g = self._grants[s]
            if g.open and g.proof[4] is not None:
                return g.proof[4]
        return "deadline"

    # ------------------------------------------------------------------ owner calls

    def allocate(self, request: str, n: int) -> npt.NDArray[np.int64]:
        if request in self._reqs:
            raise DuplicateRequest(request)
        free = [b for b, h in enumerate(self._holder) if h is None]
        if len(free) < n:
            raise OutOfBlocks(n, len(free))
        got = tuple(free[:n])
        for b in got:
            self._holder[b] = request
        self._reqs[request] = _Request(_ADMITTED, got, ())
        return np.array(got, dtype=np.int64)

    def admit(self, request: str) -> None:
        if request in self._reqs:
            raise DuplicateRequest(request)
        self._reqs[request] = _Request(_ADMITTED, (), ())

    def acquire(self, request: str, blocks: npt.ArrayLike, /, *, shared: bool) -> None:
        raise ValueError(supports(Config(share=True)))  # explore refuses share for this engine

    def grant(
        self, request: str, peer: str, blocks: npt.ArrayLike, access: Access = Access.WRITE
    ) -> Grant:
        r = self._get(request)
        if r.state != _ADMITTED:
            raise IllegalTransition("request", request, r.state, "grant")
        arr = np.asarray(blocks, dtype=np.int64)
        serial = self.next_serial
        self.next_serial = serial + 1
        gens = self.generation(arr)
        gens.flags.writeable = False
        g = make_grant(make_grant_id(self.incarnation, serial), request, peer, arr, gens, access)
        self._grants[serial] = _Grant(g, _NEW_PROOF, True)
        self._reqs[request] = _Request(r.state, r.blocks, (*r.grants, serial))
        return g

    def finish(self, request: str) -> None:
        self._end(request, "finished")

    def reject(self, request: str, reason: str = "rejected") -> None:
        self._end(request, "rejected")

    def _end(self, request: str, event: str) -> None:
        r = self._ending(request)
        self._fire(request, r, event)
        self._advance(request)

    def _ending(self, request: str) -> _Request:
        r = self._reqs.get(request)
        if r is None:
            # The model never reuses a released key (reuse_ids takes a held one): a call on a
            # released request is a double release, as the real ledger remembers them.
            raise DoubleRelease(f"request {request!r} was already released")
        return r

    def _facts(self, r: _Request) -> _Facts:
        return _Facts([_proof(g.proof) for s in r.grants if (g := self._grants[s]).open])

    def _fire(self, request: str, r: _Request, event: str) -> str | None:
        """A call-driven transition of the specification's table; the target (``None``: a
        guard refused). Raises ``IllegalTransition`` where the table has no row."""
        target = _TABLE.step(r.state, event, self._facts(r), request)
        if target is not None:
            self._reqs[request] = _Request(target, r.blocks, r.grants)
        return target

    def _advance(self, request: str) -> None:
        """Every evidence-driven transition whose guard now holds, in chain order."""
        while True:
            r = self._reqs[request]
            facts = self._facts(r)
            for guard, target in _CHAIN[r.state]:
                if guard(facts):
                    self._reqs[request] = _Request(target, r.blocks, r.grants)
                    break
            else:
                return

    def release(self, request: str) -> npt.NDArray[np.int64]:
        r = self._ending(request)
        if self._fire(request, r, "released") is None:
            raise InsufficientEvidence(request, {})
        return self._let_go(request)

    def force_release(self, request: str, reason: str) -> npt.NDArray[np.int64]:
        r = self._ending(request)
        event = "released" if r.state == _TRANSFER_QUIESCED else "force_released"
        if self._fire(request, r, event) is None:
            raise IllegalTransition("request", request, r.state, event)
        return self._let_go(request)

    def collect_releasable(self) -> dict[str, npt.NDArray[np.int64]]:
        ready = [k for k, r in self._reqs.items() if r.state == _TRANSFER_QUIESCED]
        out: dict[str, npt.NDArray[np.int64]] = {}
        for k in ready:
            self._fire(k, self._reqs[k], "released")
            out[k] = self._let_go(k)
        return out

    def _let_go(self, request: str) -> npt.NDArray[np.int64]:
        """Forget ``request`` and its grants; its blocks go back to the pool, generation+1."""
        r = self._reqs.pop(request)
        for s in r.grants:
            del self._grants[s]
        for b in r.blocks:
            self._holder[b] = None
            self._gens[b] += 1
        return np.array(r.blocks, dtype=np.int64)

    # ------------------------------------------------------------------ evidence

    def apply(self, ev: Evidence) -> None:
        """As ``ledger.proofs.apply``: who may say it, which grant it names, what it proves."""
        if ev.source.kind is not SourceKind.LOCAL:
            check_source(ev)
        if isinstance(ev, GrantEvidence) or (isinstance(ev, AccessRevoked) and ev.grant_id):
            serial = self._grant_named(ev)
            g = self._grants[serial]
            p = _proof(g.proof)
            p.check(ev)
            if g.open and p.record(ev):
                self._proven(serial, g, p)
        elif isinstance(ev, AccessRevoked | PeerLost):
            named = [(s, g) for s, g in self._grants.items() if g.open and g.grant.peer == ev.peer]
            proofs = [_proof(g.proof) for _, g in named]
            for p in proofs:
                p.check(ev)  # every check before any change: all or nothing
            for (s, g), p in zip(named, proofs, strict=True):
                if p.record(ev):
                    self._proven(s, g, p)

    def _grant_named(self, ev: GrantEvidence | AccessRevoked) -> int:
        """The serial of the live grant ``ev`` names; the real ledger's error where none."""
        gid = ev.grant_id
        assert isinstance(gid, GrantId)
        if gid.incarnation != self.incarnation:
            raise MismatchedEvidence(
                f"{ev.kind} is about grant {gid} of another ledger or incarnation", evidence=ev
            )
        g = self._grants.get(gid.serial)
        if g is None:
            if gid.serial < self.next_serial:
                raise StaleEvidence(
                    f"{ev.kind} is about grant {gid}, whose request was already released",
                    evidence=ev,
                )
            raise MismatchedEvidence(f"{ev.kind}: grant {gid} was never issued", evidence=ev)
        check_grant_peer(ev, g.grant.peer)
        if ev.request != g.grant.request or ev.peer != g.grant.peer:
            raise MismatchedEvidence(
                f"{ev.kind} names another request or peer than grant {gid}", evidence=ev
            )
        return gid.serial

    def _proven(self, serial: int, g: _Grant, p: GrantProof) -> None:
        """Something new was proven about grant ``serial``: keep it, close the grant if it
        now is, advance its request (``ledger.proofs._proven``)."""
        self._grants[serial] = _Grant(g.grant, p.key(), g.open and not p.closed)
        request = g.grant.request
        assert isinstance(request, str)
        if self._reqs[request].state != _ADMITTED:
            self._advance(request)


def _packed_of(
    incarnation: str,
    gens: list[int],
    holder: list[str | None],
    reqs: dict[str, _Request],
    grants: dict[int, _Grant],
    next_serial: int,
) -> PackedLedger:
    """A ``PackedLedger`` from its fields (``PackedLedger.__reduce__``)."""
    new = PackedLedger(0, incarnation=incarnation)
    new._gens, new._holder, new._reqs, new._grants = gens, holder, reqs, grants
    new.next_serial = next_serial
    return new


# ------------------------------------------------------------------ choosing the engine

# The ledgers the model can drive: the real ``BlockLedger``, or ``packed.PackedLedger`` (the
# same model over plain values, proven equal to the real one on a grid of shapes by
# ``tests/test_verify_packed.py``; its counterexamples are replayed on the real ledger).
ENGINES = ("ledger", "packed")


def engine_root(config: Config, engine: str, *, checked: bool, crash_first: bool) -> State:
    """The initial state for ``engine``; ``ValueError`` if it cannot run ``config``."""
    if engine == "ledger":
        return initial(config, checked=checked, crash_first=crash_first)
    if engine != "packed":
        raise ValueError(f"unknown engine {engine!r} (known: {', '.join(ENGINES)})")
    why = supports(config)
    if why is not None:
        raise ValueError(f"the packed engine does not model {why}")
    if checked:
        raise ValueError("checked=True mirrors the real ledger's transitions: engine='ledger'")
    led = PackedLedger(config.blocks, incarnation=INCARNATION)
    return initial(config, crash_first=crash_first, ledger=led)


def confirm_on_ledger(
    config: Config, policy: Policy, events: list[Event], violation: Violation
) -> None:
    """Replay ``events`` on the real ledger; raise ``SpecDisagreement`` unless it breaks the
    same invariant (the packed engine reports only what the real ledger confirms)."""
    try:
        _, _, got = run_events(config, policy, events, checked=False)
    except ValueError as e:  # an event the real model does not enable there
        raise SpecDisagreement(f"the packed engine's counterexample does not replay: {e}") from e
    if got is None or got.invariant != violation.invariant:
        raise SpecDisagreement(
            f"the packed engine found {violation.invariant} ({violation.message}); replayed on "
            f"the real ledger the same events give {got!r}"
        )
