"""Claims and the acknowledgement classes (docs/evidence.md; the rules they serve, in prose:
docs/contract.md#evidence-and-claims).

Evidence is data: an immutable object that states exactly what it proves, about which grant,
and nothing more. It never mutates anything by itself; ``BlockLedger.apply`` (through
``proof.GrantProof``) decides what the accumulated evidence of a grant adds up to.

Each class declares the claims it proves in ``PROVES`` (data, read by the claims matrix, the
ledger and the verifier) and says in its docstring what it does *not* prove.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from typing import Any, ClassVar, TypeVar

import attrs

from kvlifetime import inputs
from kvlifetime.errors import InvalidField, MalformedEvidence, show
from kvlifetime.grant import Grant, GrantId, PeerId, RequestKey, check_peer, check_request_key
from kvlifetime.source import LOCAL, Source


class Claim(enum.Enum):
    """One fact a piece of evidence can prove about a grant."""

    CANCEL_RECEIVED = "cancel_received"
    """The peer received the cancel for the grant."""
    SCHEDULING_STOPPED = "scheduling_stopped"
    """The peer will post no transfer for the grant after a stated sequence number."""
    TRANSFERS_ENDED = "transfers_ended"
    """Every transfer of the grant up to a stated sequence number ended; none will touch memory."""
    ACCESS_REVOKED = "access_revoked"
    """The peer can no longer reach the memory at all."""
    DEADLINE_PASSED = "deadline_passed"
    """Only that time passed. Says nothing about memory access."""
    HEARTBEAT_FAILED = "heartbeat_failed"
    """Only that a heartbeat failed. Says nothing about memory access."""


MEMORY_CLAIMS = frozenset(
    {Claim.CANCEL_RECEIVED, Claim.SCHEDULING_STOPPED, Claim.TRANSFERS_ENDED, Claim.ACCESS_REVOKED}
)
"""Claims that say something about the memory. The others only raise suspicion."""


def _check_seq(_inst: object, attr: attrs.Attribute[Any], value: object) -> None:
    if type(value) is not int or not 0 <= value <= inputs.MAX_SEQ:  # fast path: a plain int
        inputs.seq(value, attr.name)


def _grant(value: object) -> Grant:
    # ``.of(grant)`` reads the grant's fields: anything else is refused here, not with an
    # AttributeError from inside.
    return inputs.instance(value, Grant, "grant")


_new = object.__new__
_set = object.__setattr__


def _issued(cls: type[_E], g: Grant, seq_field: str | None = None, seq: int = 0) -> _E | None:
    """``cls`` about the plain ``Grant`` ``g`` (local source) without running the field
    validators again, or ``None`` where that shortcut does not apply.

    Why it is safe: a ``Grant``'s id, request and peer passed the very checks these fields
    run when the grant was built (its validating constructor, or the ledger's ``make_grant``
    from values the ledger had validated), and a frozen grant cannot change them since. Only
    ``seq`` is new, and it is checked here. Not for a ``Grant`` subclass, nor for a subclass
    of ``cls``: they may add checks of their own, and get the validating constructor."""
    if seq_field is not None and (type(seq) is not int or not 0 <= seq <= inputs.MAX_SEQ):
        return None  # the validating constructor raises the precise error
    ev: _E = _new(cls)
    _set(ev, "source", LOCAL)
    _set(ev, "grant_id", g.id)
    _set(ev, "request", g.request)
    _set(ev, "peer", g.peer)
    if seq_field is not None:
        _set(ev, seq_field, seq)
    return ev


def _check_grant_id(_inst: object, attr: attrs.Attribute[Any], value: object) -> None:
    if not isinstance(value, GrantId):
        raise InvalidField(f"{attr.name} must be a GrantId, got {show(value)}")


def _check_source(_inst: object, attr: attrs.Attribute[Any], value: object) -> None:
    if not isinstance(value, Source):
        raise InvalidField(f"{attr.name} must be a Source, got {show(value)}")


@attrs.frozen(slots=True)
class Evidence:
    """Base of every acknowledgement. Subclasses set ``PROVES`` and document what they do not.

    ``source`` says who asserts it (``kvlifetime.source``): ``LOCAL`` for evidence this process
    made itself (the default), ``Source.peer(identity)`` for evidence decoded from a connection.
    The ledger checks it against ``kvlifetime.provenance.RULES`` before anything else.
    """

    PROVES: ClassVar[frozenset[Claim]] = frozenset()
    SCOPE: ClassVar[str] = "grant"  # "grant": about one grant; "peer": about every grant to a peer
    # Keyword-only and last: who said it is not part of what is said.
    source: Source = attrs.field(default=LOCAL, kw_only=True, validator=_check_source)

    @property
    def kind(self) -> str:
        return type(self).__name__


_E = TypeVar("_E", bound=Evidence)


@attrs.frozen(slots=True)
class GrantEvidence(Evidence):
    """Evidence about one grant. It names the grant, and the request and peer it believes the
    grant belongs to; the ledger refuses it when they do not match (MismatchedEvidence)."""

    grant_id: GrantId = attrs.field(validator=_check_grant_id)
    request: RequestKey = attrs.field(validator=check_request_key)
    peer: PeerId = attrs.field(validator=check_peer)


@attrs.frozen(slots=True)
class CancelReceived(GrantEvidence):
    """The peer acknowledged receipt of the cancel for this grant.

    Proves:
        The peer received the cancel message for this grant.

    Does not prove:
        That the peer stopped scheduling transfers, nor that any transfer already posted has
        ended. A "message received" acknowledgement read as "transfer stopped" is exactly the
        bug kvlifetime exists to prevent.
    """

    PROVES: ClassVar[frozenset[Claim]] = frozenset({Claim.CANCEL_RECEIVED})

    @classmethod
    def of(cls, grant: Grant) -> CancelReceived:
        if cls is CancelReceived and type(grant) is Grant:
            return _issued(cls, grant) or cls(grant.id, grant.request, grant.peer)
        g = grant if type(grant) is Grant else _grant(grant)
        return cls(g.id, g.request, g.peer)


@attrs.frozen(slots=True)
class SchedulingStopped(GrantEvidence):
    """The peer will post no transfer for this grant after sequence ``last_seq``.

    Proves:
        No transfer with a sequence number above ``last_seq`` will ever be posted for this
        grant (``last_seq=0``: nothing was ever posted). Implies the cancel was received.

    Does not prove:
        That transfers already posted (sequence 1..``last_seq``) have finished: they may still
        be writing into the blocks.
    """

    PROVES: ClassVar[frozenset[Claim]] = frozenset(
        {Claim.CANCEL_RECEIVED, Claim.SCHEDULING_STOPPED}
    )
    last_seq: int = attrs.field(default=0, validator=_check_seq)  # >= 0

    @classmethod
    def of(cls, grant: Grant, last_seq: int) -> SchedulingStopped:
        if cls is SchedulingStopped and type(grant) is Grant:
            ev = _issued(cls, grant, "last_seq", last_seq)
            return ev or cls(grant.id, grant.request, grant.peer, last_seq)
        g = grant if type(grant) is Grant else _grant(grant)
        return cls(g.id, g.request, g.peer, last_seq)


@attrs.frozen(slots=True)
class TransferQuiesced(GrantEvidence):
    """Every transfer of this grant numbered ``<= through_seq`` has ended.

    Proves:
        Each transfer of this grant with sequence number at most ``through_seq`` has ended and
        will touch the blocks no more (for Mooncake TCP: every slice reported COMPLETED on
        protocol v2, see ``kvlifetime.adapters.mooncake``).

    Does not prove:
        Anything about transfers numbered above ``through_seq``, nor that the peer will not post
        more: on its own it never closes a grant.
    """

    PROVES: ClassVar[frozenset[Claim]] = frozenset({Claim.TRANSFERS_ENDED})
    through_seq: int = attrs.field(default=0, validator=_check_seq)  # >= 0

    @classmethod
    def of(cls, grant: Grant, through_seq: int) -> TransferQuiesced:
        if cls is TransferQuiesced and type(grant) is Grant:
            ev = _issued(cls, grant, "through_seq", through_seq)
            return ev or cls(grant.id, grant.request, grant.peer, through_seq)
        g = grant if type(grant) is Grant else _grant(grant)
        return cls(g.id, g.request, g.peer, through_seq)


@attrs.frozen(slots=True)
class TransferCompleted(GrantEvidence):
    """The normal end: all transfers of the grant were posted and all of them ended.

    Proves:
        The peer posted exactly ``last_seq`` transfers for this grant, will post no more, and
        every one of them has ended (SchedulingStopped and TransferQuiesced together).

    Does not prove:
        Nothing is left unproven about this grant: it closes it.
    """

    PROVES: ClassVar[frozenset[Claim]] = frozenset(
        {Claim.CANCEL_RECEIVED, Claim.SCHEDULING_STOPPED, Claim.TRANSFERS_ENDED}
    )
    last_seq: int = attrs.field(default=0, validator=_check_seq)  # >= 0

    @classmethod
    def of(cls, grant: Grant, last_seq: int) -> TransferCompleted:
        # The hot path (every normal end): no validator runs again on a ledger's grant.
        if cls is TransferCompleted and type(grant) is Grant:
            ev = _issued(cls, grant, "last_seq", last_seq)
            return ev or cls(grant.id, grant.request, grant.peer, last_seq)
        g = grant if type(grant) is Grant else _grant(grant)
        return cls(g.id, g.request, g.peer, last_seq)


@attrs.frozen(slots=True)
class AccessRevoked(Evidence):
    """The peer can no longer reach the memory at all.

    With ``grant_id`` set it is about that grant; with ``grant_id=None`` about every grant to
    ``peer`` (a connection fenced, an RDMA memory region deregistered). ``fence`` names the
    fence whose completion the local adapter observed (counted in ``stats().reclaimed_blocks``).
    Only a local source may assert it: a peer cannot revoke itself by saying so.

    Proves:
        No access by the peer, in flight or future, can touch the blocks any more. It closes the
        grant(s) whatever else is unproven.

    Does not prove:
        Nothing is left unproven, which is why only real fencing may produce it. Deregistering
        memory on Mooncake's TCP transport is *not* revocation: writes already past the header
        check keep landing (docs/fencing.md).
    """

    PROVES: ClassVar[frozenset[Claim]] = frozenset({Claim.ACCESS_REVOKED})
    SCOPE: ClassVar[str] = "grant or peer"
    peer: PeerId = attrs.field(validator=check_peer)
    grant_id: GrantId | None = attrs.field(default=None)
    request: RequestKey | None = attrs.field(default=None)
    # The fence that ended the access: a short stable name ("inproc_initiator_reaped", ...).
    fence: str = attrs.field(default="unnamed_fence", kw_only=True)

    @fence.validator
    def _check_fence(self, _a: attrs.Attribute[str], v: object) -> None:
        if not isinstance(v, str) or not v or len(v) > 128:
            raise InvalidField(f"fence must be a non-empty str of at most 128 chars, got {show(v)}")

    @grant_id.validator
    def _check_gid(self, a: attrs.Attribute[GrantId | None], v: object) -> None:
        if v is not None:
            _check_grant_id(self, a, v)

    @request.validator
    def _check_req(self, a: attrs.Attribute[RequestKey | None], v: object) -> None:
        if v is not None:
            check_request_key(self, a, v)
        if (v is None) != (self.grant_id is None):
            raise InvalidField("AccessRevoked names both grant_id and request, or neither")

    @classmethod
    def of(cls, grant: Grant, *, fence: str = "unnamed_fence") -> AccessRevoked:
        g = grant if type(grant) is Grant else _grant(grant)
        return cls(g.peer, g.id, g.request, fence=fence)


@attrs.frozen(slots=True)
class LeaseExpired(GrantEvidence):
    """The grant's lease ran out.

    Proves:
        Only that time passed.

    Does not prove:
        Anything about memory access: the peer may still be writing. It leads to quarantine of
        the blocks, never to their release (vLLM's NIXL lease reaper freeing here is the bug).
    """

    PROVES: ClassVar[frozenset[Claim]] = frozenset({Claim.DEADLINE_PASSED})

    @classmethod
    def of(cls, grant: Grant) -> LeaseExpired:
        if cls is LeaseExpired and type(grant) is Grant:
            return _issued(cls, grant) or cls(grant.id, grant.request, grant.peer)
        g = grant if type(grant) is Grant else _grant(grant)
        return cls(g.id, g.request, g.peer)


@attrs.frozen(slots=True)
class PeerLost(Evidence):
    """A heartbeat to ``peer`` failed.

    Proves:
        Only that a heartbeat failed.

    Does not prove:
        That the peer is dead, nor that its transfers stopped: a hung initiator's data may still
        be applied by the target, a partitioned peer may still write. Every grant to the peer is
        quarantined, never released.
    """

    PROVES: ClassVar[frozenset[Claim]] = frozenset({Claim.HEARTBEAT_FAILED})
    SCOPE: ClassVar[str] = "peer"
    peer: PeerId = attrs.field(validator=check_peer)


EVIDENCE_CLASSES: tuple[type[Evidence], ...] = (
    CancelReceived,
    SchedulingStopped,
    TransferQuiesced,
    TransferCompleted,
    AccessRevoked,
    LeaseExpired,
    PeerLost,
)
BY_NAME: Mapping[str, type[Evidence]] = {c.__name__: c for c in EVIDENCE_CLASSES}


def about(grant: Grant, kind: str, seq: int = 0) -> Evidence:
    """The evidence class named ``kind`` about ``grant``; ``seq`` is its ``last_seq`` /
    ``through_seq`` where it has one. ``PeerLost`` names the grant's peer."""
    grant = _grant(grant)
    if kind in ("SchedulingStopped", "TransferQuiesced", "TransferCompleted"):
        cls = BY_NAME[kind]
        assert issubclass(cls, SchedulingStopped | TransferQuiesced | TransferCompleted)
        return cls.of(grant, seq)
    if kind in ("CancelReceived", "AccessRevoked", "LeaseExpired"):
        single = BY_NAME[kind]
        assert issubclass(single, CancelReceived | AccessRevoked | LeaseExpired)
        return single.of(grant)
    if kind == "PeerLost":
        return PeerLost(grant.peer)
    raise InvalidField(f"unknown evidence kind {show(kind)} (known: {', '.join(BY_NAME)})")


def not_proven(cls: type[Evidence]) -> str:
    """The "Does not prove:" paragraph of an evidence class, as one line."""
    return _paragraph(cls, "Does not prove:")


def proves_text(cls: type[Evidence]) -> str:
    """The "Proves:" paragraph of an evidence class, as one line."""
    return _paragraph(cls, "Proves:")


def _paragraph(cls: type[Evidence], heading: str) -> str:
    doc = cls.__doc__ or ""
    lines = [ln.strip() for ln in doc.splitlines()]
    try:
        start = lines.index(heading) + 1
    except ValueError:
        return ""
    out: list[str] = []
    for ln in lines[start:]:
        if not ln:
            break
        out.append(ln)
    return " ".join(out)


def claims_matrix() -> list[dict[str, object]]:
    """Evidence x claim, as rows of plain data (``kvlifetime evidence``)."""
    rows: list[dict[str, object]] = []
    for cls in EVIDENCE_CLASSES:
        rows.append(
            {
                "evidence": cls.__name__,
                "claims": {c.value: (c in cls.PROVES) for c in Claim},
                "proves": proves_text(cls),
                "does_not_prove": not_proven(cls),
            }
        )
    return rows


# ------------------------------------------------------------------ plain data (wire, logs)


def to_dict(ev: Evidence, *, with_source: bool = True) -> dict[str, Any]:
    """Evidence as plain data (msgpack / JSON friendly), its source as ``str(Source)``."""
    out: dict[str, Any] = {"type": type(ev).__name__}
    for f in attrs.fields(type(ev)):
        v = getattr(ev, f.name)
        if f.name == "source":
            if with_source:
                out["source"] = str(v)
            continue
        if isinstance(v, GrantId):
            v = [v.incarnation, v.serial]
        out[f.name] = v
    return out


def to_wire(ev: Evidence) -> dict[str, Any]:
    """What a sender puts on the wire: everything but the source, which is the receiver's
    transport to tell (``from_dict(data, source=...)``)."""
    return to_dict(ev, with_source=False)


def from_dict(data: object, *, source: Source) -> Evidence:
    """Build evidence received from ``source`` (the transport's identity of the connection it
    came in on); anything wrong raises ``MalformedEvidence``.

    Data that names its own ``source`` is refused: a message cannot say who sent it.
    """
    if not isinstance(source, Source):
        raise InvalidField(f"source must be a Source, got {show(source)}")
    return _build(data, source, recorded=False)


def from_record(data: object) -> Evidence:
    """Build evidence from a recorded log line (``to_dict`` output), with the source it
    records (``local`` when the line predates sources). For trusted records only, never for
    bytes from a peer."""
    return _build(data, None, recorded=True)


def _build(data: object, source: Source | None, *, recorded: bool) -> Evidence:
    fields = _fields(data)
    kind = fields.get("type")
    cls = BY_NAME.get(kind) if type(kind) is str else None
    if cls is None:
        raise MalformedEvidence(f"unknown evidence type {show(kind)}")
    names = {f.name for f in attrs.fields(cls)} - {"source"}
    allowed = names | {"type", "source"} if recorded else names | {"type"}
    extra = [k for k in fields if k not in allowed]
    if extra:
        raise MalformedEvidence(f"{cls.__name__}: unexpected fields {show(sorted(extra), 200)}")
    kwargs: dict[str, Any] = {}
    try:
        for name in names:
            if name not in fields:
                continue
            v = fields[name]
            if name == "grant_id" and v is not None:
                v = _grant_id(v)
            elif name == "fence":
                v = inputs.text(v, "fence")  # its validator formats it: a plain str only
            kwargs[name] = v
        if recorded:
            kwargs["source"] = Source.parse(inputs.text(fields.get("source", "local"), "source"))
        else:
            kwargs["source"] = source
        return cls(**kwargs)
    except (InvalidField, TypeError) as e:
        raise MalformedEvidence(f"{cls.__name__}: {e}") from e


def _fields(data: object) -> dict[str, Any]:
    """``data`` read once into a plain dict with plain ``str`` keys, checked ``shallow``: from
    here on nothing formats, compares or hashes a value nested without end, nor runs the code
    of the caller's mapping again. ``MalformedEvidence`` otherwise."""
    if not isinstance(data, Mapping):
        raise MalformedEvidence(f"evidence must be a mapping, got {type(data).__name__}")
    try:
        items = list(_dict_items(data)) if issubclass(type(data), dict) else list(data.items())
    except Exception as e:  # the caller's mapping: whatever its walk raises is its fault
        raise MalformedEvidence(
            f"evidence could not be read: walking {type(data).__name__} raised {type(e).__name__}"
        ) from e
    fields: dict[str, Any] = {}
    for k, v in items:
        plain = k if type(k) is str else _plain_str(k) if issubclass(type(k), str) else None
        if plain is None:
            raise MalformedEvidence(f"evidence field names are str, got {show(k)}")
        fields[plain] = v
    inputs.shallow(fields, "evidence", error=MalformedEvidence)
    return fields


def _grant_id(v: object) -> GrantId:
    """``[incarnation, serial]`` as a ``GrantId``, its parts checked (and shown) here: the
    ``GrantId`` validators print what they refuse with ``repr``."""
    t = type(v)
    parts: list[Any] = _list_copy(v) if issubclass(t, list) else []
    if issubclass(t, tuple):
        parts = list(_tuple_slice(v, slice(None)))
    if len(parts) != 2:
        raise MalformedEvidence(f"grant_id must be [incarnation, serial], got {show(v)}")
    inc, serial = parts
    return GrantId(inputs.peer_id(inc, "incarnation"), inputs.count(serial, "serial", 1))


# The built-in types' own slots: a subclass's overrides never run on outside data.
_dict_items: Any = dict.items
_list_copy: Any = list.copy
_tuple_slice: Any = tuple.__getitem__
_plain_str = str.__str__
