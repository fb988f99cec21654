"""The control plane between decode and prefill: typed messages, a versioned msgpack schema.

Every frame is a msgpack map ``{"v": SCHEMA_VERSION, "t": <type>, ...fields}``. ``decode``
either returns one of the message classes below or raises ``MalformedMessage``: a frame from
another schema version, of an unknown type, with a missing, extra or ill-typed field. A worker
that gets one logs it, counts it, and goes on; nothing a peer sends can crash it. A control
message is plain data: no serializer that can build arbitrary objects (and so run a peer's code)
ever touches the wire.

Evidence travels as ``kvlifetime.evidence.to_wire`` data (everything but its source) and is
rebuilt with ``from_dict``, so it is checked by the same validators as evidence built locally,
and stamped with the identity of the connection it came in on (``decode(frame, sender=...)``),
never with a name the message gives itself.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, ClassVar, TypeAlias

import attrs

from kvlifetime.extras import needs

with needs("harness", "kvlifetime.harness"):  # the wire format is msgpack: the harness extra
    import msgpack

from kvlifetime import inputs
from kvlifetime.errors import MalformedEvidence, UnauthorizedEvidence, show
from kvlifetime.evidence import BY_NAME, Evidence, from_dict, to_wire
from kvlifetime.grant import GrantId
from kvlifetime.source import Source

SCHEMA_VERSION = 1
"""Bumped on any incompatible change; a frame with another version is refused whole."""

MAX_FRAME = 1 << 20  # bytes; a control frame is small, a huge one is an attack or a bug

# Bounds of the fields, so that a frame the schema accepts is one every handler can take: ints
# within int64 (numpy's block ids, seeds, sequence numbers), generations within uint32 (the
# ledger's), addresses within uint64 (pointers), names and keys short.
INT64_MAX = (1 << 63) - 1
UINT32_MAX = (1 << 32) - 1
UINT64_MAX = (1 << 64) - 1
MAX_NAME = 256  # chars: request keys, peers, incarnations, counter names
MAX_TEXT = 4096  # chars: a rejection's reason


class MalformedMessage(MalformedEvidence):
    """A control frame that is not a message of this schema.
    Not msgpack, another schema version, an unknown type, or a field missing, extra or of the
    wrong type.

    Whose fault: the peer (or the wire). State left: unchanged; the frame is dropped.
    """

    kind = "malformed_message"


class UnauthorizedMessage(UnauthorizedEvidence):
    """A control message about a grant from a connection not its peer's.
    A well-formed control message about a grant (a rejection, a transfer failure, a read
    report, a reader's pending count) from a connection that is not that grant's peer: a
    stranger, another prefill, another tensor rank, or an incarnation already fenced. Decided
    by the transport's identity of the connection, never by a name inside the message.

    Whose fault: the sender. State left: unchanged; the message is dropped, logged, counted.
    """

    kind = "unauthorized_message"


# --------------------------------------------------------------------------- field checks


def _req(v: object) -> int | str:
    # Request keys are compared exactly; bool is an int subclass and never a request id. An int
    # key is a request number: the harness seeds the request's plan with it, and numpy takes
    # no negative seed.
    if isinstance(v, bool) or not isinstance(v, int | str) or v == "":
        raise MalformedMessage(f"request key must be a non-empty str or an int, got {show(v)}")
    if isinstance(v, int) and not 0 <= v <= INT64_MAX:
        raise MalformedMessage(f"request number must be in [0, {INT64_MAX}], got {show(v)}")
    if isinstance(v, str) and len(v) > MAX_NAME:
        raise MalformedMessage(f"request key of {len(v)} chars is over {MAX_NAME}")
    return v


def _int(v: object, lo: int = 0, hi: int = INT64_MAX) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
        raise MalformedMessage(f"expected an int in [{lo}, {hi}], got {show(v)}")
    return v


def _str(v: object, max_len: int = MAX_NAME) -> str:
    if not isinstance(v, str) or not v or len(v) > max_len:
        raise MalformedMessage(
            f"expected a non-empty str of at most {max_len} chars, got {show(v)}"
        )
    return v


def _grant(v: object) -> GrantId:
    if not (isinstance(v, list | tuple) and len(v) == 2):
        raise MalformedMessage(f"grant must be [incarnation, serial], got {show(v)}")
    inc, serial = v
    return GrantId(_str(inc), _int(serial, 1))


def _ints(v: object, lo: int = 0, hi: int = INT64_MAX) -> tuple[int, ...]:
    if not isinstance(v, list | tuple):
        raise MalformedMessage(f"expected a list of ints, got {show(v)}")
    return tuple(_int(x, lo, hi) for x in v)


def _evidence(v: object) -> object:
    # Only the shape here: the evidence is built in ``decode``, where the sender is known.
    if not isinstance(v, Mapping):
        raise MalformedMessage(f"evidence must be a map, got {type(v).__name__}")
    return v


def _stamped(v: object, sender: str | None) -> Evidence:
    if sender is None:
        raise MalformedMessage("evidence from a connection with no identity is refused")
    # Every field of the class, as ``to_wire`` sends it: one left out is refused, never filled
    # in with its default (a ``last_seq`` left out would read as 0, "nothing was posted": the
    # strongest claim, from a field nobody sent).
    given: Mapping[Any, object] = v if isinstance(v, Mapping) else {}
    kind = given.get("type")
    cls = BY_NAME.get(kind) if isinstance(kind, str) else None
    if cls is not None:
        missing = [f.name for f in attrs.fields(cls) if f.name != "source" and f.name not in given]
        if missing:
            raise MalformedMessage(f"evidence: {cls.__name__}: missing fields {missing}")
    try:
        return from_dict(v, source=Source.peer(sender))
    except MalformedEvidence as e:
        raise MalformedMessage(f"evidence: {e}") from e


# --------------------------------------------------------------------------- messages


@attrs.frozen(slots=True)
class Assign:
    """decode -> prefill: write request ``request``'s KV into these blocks (the grant)."""

    TYPE: ClassVar[str] = "assign"
    request: int | str
    grant: GrantId
    peer: str  # the peer the grant names: the prefill worker's id
    blocks: tuple[int, ...]  # decode block ids (for the pattern)
    generations: tuple[int, ...]  # one per block: the grant's generations
    addresses: tuple[int, ...]  # one per block: where to write, in the target's address space
    tokens: int  # prompt length; prefill refuses a request over its capacity


@attrs.frozen(slots=True)
class Abort:
    """decode -> prefill: the client went away; stop writing this grant."""

    TYPE: ClassVar[str] = "abort"
    request: int | str
    grant: GrantId


@attrs.frozen(slots=True)
class Query:
    """decode -> prefill: evidence for this grant may have been lost; send it again."""

    TYPE: ClassVar[str] = "query"
    request: int | str
    grant: GrantId


@attrs.frozen(slots=True)
class Tick:
    """decode -> prefill: logical time ``n`` has come; do its work, then answer ``TickDone``.

    The harness runs in lock-step ticks so that a seed decides every fault and every landing
    order: runs are reproducible, and delays are measured in ticks, not in wall-clock luck."""

    TYPE: ClassVar[str] = "tick"
    n: int


@attrs.frozen(slots=True)
class Stop:
    """decode -> prefill: shut down after answering with ``Stats``."""

    TYPE: ClassVar[str] = "stop"


@attrs.frozen(slots=True)
class EvidenceMsg:
    """prefill -> decode: one piece of evidence about a grant."""

    TYPE: ClassVar[str] = "evidence"
    evidence: Evidence


@attrs.frozen(slots=True)
class Rejected:
    """prefill -> decode: admission refused (decided after the addresses were sent). Says
    nothing about transfers already posted: SchedulingStopped / TransferQuiesced follow."""

    TYPE: ClassVar[str] = "rejected"
    request: int | str
    grant: GrantId
    reason: str


@attrs.frozen(slots=True)
class TransferFailed:
    """prefill -> decode: a batch of this grant reported FAILED. Proves nothing about the
    memory: the batch's other slices may still be landing."""

    TYPE: ClassVar[str] = "failed"
    request: int | str
    grant: GrantId
    seq: int


@attrs.frozen(slots=True)
class TickDone:
    """prefill -> decode: tick ``n`` is done; every message of tick ``n`` was sent before."""

    TYPE: ClassVar[str] = "tick_done"
    n: int


@attrs.frozen(slots=True)
class Stats:
    """prefill -> decode: counters, sent once in answer to ``Stop``."""

    TYPE: ClassVar[str] = "stats"
    counters: Mapping[str, int]


@attrs.frozen(slots=True)
class ReadAssign:
    """prefill -> decode (the pull direction): read request ``request``'s KV out of these
    source blocks of prefill's arena (the grant, a READ grant, opened before this was sent)."""

    TYPE: ClassVar[str] = "read_assign"
    request: int | str
    grant: GrantId
    peer: str  # the peer the grant names: the decode (reader) worker's id
    blocks: tuple[int, ...]  # prefill's source block ids (for the pattern)
    generations: tuple[int, ...]  # one per block: the grant's generations
    addresses: tuple[int, ...]  # one per block: where to read, in the source's address space


@attrs.frozen(slots=True)
class ReadsChecked:
    """decode -> prefill (the pull direction): the reader checked the blocks one read batch
    brought into its staging against the words of its grant. ``stale[i]`` is 1 when block
    ``blocks[i]`` did not hold them (prefill gave it to another request before the read).

    Not evidence, and never proof of anything: the harness's read oracle, counted. Like
    ``Tick`` it models measurement, not the network (never lost or delayed)."""

    TYPE: ClassVar[str] = "reads_checked"
    request: int | str
    grant: GrantId
    seq: int  # the read batch (transfer sequence number, from 1)
    blocks: tuple[int, ...]
    stale: tuple[int, ...]  # one per block: 0 (the grant's words) or 1 (anything else)


@attrs.frozen(slots=True)
class ReaderPending:
    """decode -> prefill (the pull direction), before each ``TickDone``: how many of its grants
    still have reads to post or in flight, control frames still queued included. 0: the reader
    will read nothing more unless assigned. Measurement, like ``TickDone``: never faulted."""

    TYPE: ClassVar[str] = "reader_pending"
    n: int  # the tick it describes
    grants: int


Message: TypeAlias = (
    Assign
    | Abort
    | Query
    | Tick
    | Stop
    | EvidenceMsg
    | Rejected
    | TransferFailed
    | TickDone
    | Stats
    | ReadAssign
    | ReadsChecked
    | ReaderPending
)


def _counters(v: object) -> Mapping[str, int]:
    if not isinstance(v, Mapping):
        raise MalformedMessage(f"counters must be a map, got {type(v).__name__}")
    return {_str(k): _int(x) for k, x in v.items()}


# type -> (class, {field: checker}); the checkers both validate and convert.
_SCHEMA: dict[str, tuple[type[Any], dict[str, Callable[[object], object]]]] = {
    Assign.TYPE: (
        Assign,
        {
            "request": _req,
            "grant": _grant,
            "peer": _str,
            "blocks": _ints,
            "generations": lambda v: _ints(v, 0, UINT32_MAX),
            "addresses": lambda v: _ints(v, 0, UINT64_MAX),
            "tokens": _int,
        },
    ),
    Abort.TYPE: (Abort, {"request": _req, "grant": _grant}),
    Query.TYPE: (Query, {"request": _req, "grant": _grant}),
    Tick.TYPE: (Tick, {"n": _int}),
    Stop.TYPE: (Stop, {}),
    EvidenceMsg.TYPE: (EvidenceMsg, {"evidence": _evidence}),
    Rejected.TYPE: (
        Rejected,
        {"request": _req, "grant": _grant, "reason": lambda v: _str(v, MAX_TEXT)},
    ),
    TransferFailed.TYPE: (
        TransferFailed,
        {"request": _req, "grant": _grant, "seq": lambda v: _int(v, 1)},
    ),
    TickDone.TYPE: (TickDone, {"n": lambda v: _int(v, -1)}),  # -1: ready, before tick 0
    Stats.TYPE: (Stats, {"counters": _counters}),
    ReadAssign.TYPE: (
        ReadAssign,
        {
            "request": _req,
            "grant": _grant,
            "peer": _str,
            "blocks": _ints,
            "generations": lambda v: _ints(v, 0, UINT32_MAX),
            "addresses": lambda v: _ints(v, 0, UINT64_MAX),
        },
    ),
    ReaderPending.TYPE: (ReaderPending, {"n": _int, "grants": _int}),
    ReadsChecked.TYPE: (
        ReadsChecked,
        {
            "request": _req,
            "grant": _grant,
            "seq": lambda v: _int(v, 1),
            "blocks": _ints,
            "stale": lambda v: _ints(v, 0, 1),
        },
    ),
}


def _plain(v: object) -> object:
    if isinstance(v, GrantId):
        return [v.incarnation, v.serial]
    if isinstance(v, Evidence):
        return to_wire(v)
    if isinstance(v, tuple):
        return list(v)
    if isinstance(v, Mapping):
        return dict(v)
    return v


def encode(msg: Message) -> bytes:
    """One frame for ``msg``."""
    body: dict[str, object] = {"v": SCHEMA_VERSION, "t": msg.TYPE}
    for f in attrs.fields(type(msg)):
        body[f.name] = _plain(getattr(msg, f.name))
    out: bytes = msgpack.packb(body, use_bin_type=True)
    return out


def decode(frame: bytes, *, sender: str | None = None) -> Message:
    """The message in ``frame``; anything else raises ``MalformedMessage`` (never another
    exception: this is where untrusted bytes enter).

    ``sender`` is the transport's identity of the connection ``frame`` came in on; evidence in
    an ``EvidenceMsg`` is stamped ``Source.peer(sender)``, whatever peer it names inside.
    Without a sender, an ``EvidenceMsg`` is refused."""
    if not isinstance(frame, bytes | bytearray | memoryview):
        raise MalformedMessage(f"a frame is bytes, got {type(frame).__name__}")
    if len(frame) > MAX_FRAME:
        raise MalformedMessage(f"frame of {len(frame)} bytes is over {MAX_FRAME}")
    try:
        # msgpack bounds what a frame can claim: a length past the frame's own size, nesting
        # past 1,024 levels (StackError) are refused while unpacking.
        body = msgpack.unpackb(frame, raw=False, strict_map_key=True, use_list=True)
    except Exception as e:  # msgpack raises many unrelated types for bad input
        raise MalformedMessage(f"not a msgpack frame: {type(e).__name__}: {str(e)[:200]}") from e
    # Up to 1,024 levels pass msgpack: nothing below formats or compares them until bounded.
    inputs.shallow(body, "frame", error=MalformedMessage)
    if not isinstance(body, dict):
        raise MalformedMessage(f"a frame is a map, got {type(body).__name__}")
    version = body.get("v")
    # The version is the int itself: True and 1.0 compare equal to 1 and are not it.
    if type(version) is not int or version != SCHEMA_VERSION:
        raise MalformedMessage(
            f"schema version {show(version)}, this worker speaks {SCHEMA_VERSION}"
        )
    kind = body.get("t")
    entry = _SCHEMA.get(kind) if isinstance(kind, str) else None
    if entry is None:
        raise MalformedMessage(f"unknown message type {show(kind)}")
    cls, fields = entry
    extra = set(body) - set(fields) - {"v", "t"}
    if extra:
        raise MalformedMessage(f"{kind}: unexpected fields {show(sorted(map(str, extra)), 200)}")
    kwargs: dict[str, object] = {}
    try:
        for name, check in fields.items():
            if name not in body:
                raise MalformedMessage(f"{kind}: missing field {name!r}")
            kwargs[name] = check(body[name])
        if cls is EvidenceMsg:
            kwargs["evidence"] = _stamped(kwargs["evidence"], sender)
    except MalformedMessage:
        raise
    except MalformedEvidence as e:
        raise MalformedMessage(f"{kind}: {e}") from e
    except Exception as e:  # e.g. InvalidField from GrantId: the peer's fault, not ours
        raise MalformedMessage(f"{kind}: {type(e).__name__}: {str(e)[:200]}") from e
    if cls is Assign or cls is ReadAssign:
        n = len(kwargs["blocks"])  # type: ignore[arg-type]
        if n == 0 or len(kwargs["generations"]) != n or len(kwargs["addresses"]) != n:  # type: ignore[arg-type]
            raise MalformedMessage(f"{kind}: blocks, generations and addresses differ in length")
    if cls is ReadsChecked:
        n = len(kwargs["blocks"])  # type: ignore[arg-type]
        if n == 0 or len(kwargs["stale"]) != n:  # type: ignore[arg-type]
            raise MalformedMessage("reads_checked: blocks and stale differ in length, or none")
    msg: Message = cls(**kwargs)
    return msg
