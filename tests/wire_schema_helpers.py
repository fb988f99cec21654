"""The control-plane schema written out again, independently of ``kvlifetime.harness.wire``, so
that the fuzz tests can say of any frame whether the decoder must take it or refuse it.

``wire.decode`` is right on a frame when it refuses it (``MalformedMessage``) exactly when
``conforms`` says the frame's body breaks the schema, and when what it returns, encoded again,
is the very body it was given (same keys, same values, same types: nothing coerced, nothing
dropped). The rules below are the schema's as documented (``wire``'s module docstring and
field comments), restated here as literals: a decoder that stops checking a field, or checks it
differently, disagrees with them and fails the tests that use them. Evidence inside an
``evidence`` message names every field of its class and is otherwise the evidence module's to
judge (``from_dict``, its own tests); here it must come back unchanged.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import attrs
import msgpack

from kvlifetime.errors import MalformedEvidence
from kvlifetime.evidence import BY_NAME, from_dict
from kvlifetime.harness import wire
from kvlifetime.source import Source

VERSION = 1
I64 = 2**63 - 1
U32 = 2**32 - 1
U64 = 2**64 - 1
NAME = 256  # chars: request keys, peers, incarnations, counter names
TEXT = 4096  # chars: a rejection's reason
MAX_FRAME = 2**20  # bytes: a larger frame is refused whole

Rule = Callable[[object], bool]


def integer(lo: int = 0, hi: int = I64) -> Rule:
    # ``type(v) is int``: a bool is an int to Python and never one to the schema.
    return lambda v: type(v) is int and lo <= v <= hi


def text(most: int = NAME) -> Rule:
    return lambda v: type(v) is str and 1 <= len(v) <= most


def request(v: object) -> bool:
    return integer()(v) or text()(v)


def grant(v: object) -> bool:
    return type(v) is list and len(v) == 2 and text()(v[0]) and integer(1)(v[1])


def integers(lo: int = 0, hi: int = I64) -> Rule:
    one = integer(lo, hi)
    return lambda v: type(v) is list and all(one(x) for x in v)


def counters(v: object) -> bool:
    return type(v) is dict and all(text()(k) and integer()(x) for k, x in v.items())


def evidence(v: object) -> bool:
    # Every field of its class named (none left to a default), and taken by ``from_dict``.
    if type(v) is not dict:
        return False
    kind = v.get("type")
    cls = BY_NAME.get(kind) if isinstance(kind, str) else None
    if cls is None or any(f.name not in v for f in attrs.fields(cls) if f.name != "source"):
        return False
    try:
        from_dict(v, source=Source.peer("fuzz-peer"))
    except MalformedEvidence:
        return False
    return True


FIELDS: dict[str, dict[str, Rule]] = {
    "assign": {
        "request": request,
        "grant": grant,
        "peer": text(),
        "blocks": integers(),
        "generations": integers(0, U32),
        "addresses": integers(0, U64),
        "tokens": integer(),
    },
    "abort": {"request": request, "grant": grant},
    "query": {"request": request, "grant": grant},
    "tick": {"n": integer()},
    "stop": {},
    "evidence": {"evidence": evidence},
    "rejected": {"request": request, "grant": grant, "reason": text(TEXT)},
    "failed": {"request": request, "grant": grant, "seq": integer(1)},
    "tick_done": {"n": integer(-1)},  # -1: ready, before tick 0
    "stats": {"counters": counters},
    "read_assign": {
        "request": request,
        "grant": grant,
        "peer": text(),
        "blocks": integers(),
        "generations": integers(0, U32),
        "addresses": integers(0, U64),
    },
    "reads_checked": {
        "request": request,
        "grant": grant,
        "seq": integer(1),
        "blocks": integers(),
        "stale": integers(0, 1),
    },
    "reader_pending": {"n": integer(), "grants": integer()},
}

# Lists that run in parallel: one entry per block, and at least one block.
PARALLEL: dict[str, tuple[str, ...]] = {
    "assign": ("blocks", "generations", "addresses"),
    "read_assign": ("blocks", "generations", "addresses"),
    "reads_checked": ("blocks", "stale"),
}


def conforms(body: object) -> bool:
    """Whether a decoded msgpack body is a message of the schema."""
    if type(body) is not dict:
        return False
    if body.get("v") != VERSION or type(body.get("v")) is not int:
        return False
    kind = body.get("t")
    if type(kind) is not str or kind not in FIELDS:
        return False
    fields = FIELDS[kind]
    if set(body) != {"v", "t", *fields}:
        return False
    if not all(rule(body[name]) for name, rule in fields.items()):
        return False
    lengths = {len(body[name]) for name in PARALLEL.get(kind, ())}
    return not lengths or (len(lengths) == 1 and 0 not in lengths)


def same(a: object, b: object) -> bool:
    """Equal values of the same types, all the way down (1 is not True, [1] is not [1.0])."""
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        assert isinstance(b, dict)
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list):
        assert isinstance(b, list)
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    return a == b


def body_of(frame: bytes) -> Any:
    """The frame's msgpack body, read as ``wire.decode`` reads it (``None``: not msgpack)."""
    try:
        return msgpack.unpackb(frame, raw=False, strict_map_key=True, use_list=True)
    except Exception:  # msgpack raises many unrelated types for bad input
        return None


def decode_checked(frame: bytes, sender: str | None = None) -> wire.Message:
    """``wire.decode(frame, sender=sender)``, held to the schema above: it raises
    ``MalformedMessage`` exactly when the frame is not a message of the schema (or is evidence
    from a connection with no identity), and a message it returns encodes back to the very
    body it was given. Any other exception propagates: that too is a failure."""
    body = body_of(frame)
    is_message = len(frame) <= MAX_FRAME and conforms(body)
    if is_message and body["t"] == "evidence" and sender is None:
        is_message = False  # nobody's evidence: refused however well formed
    try:
        msg = wire.decode(frame, sender=sender)
    except wire.MalformedMessage:
        assert not is_message, f"a message of the schema was refused: {body!r}"
        raise
    assert is_message, f"garbage accepted: {body!r} decoded to {msg!r}"
    again = body_of(wire.encode(msg))
    assert same(again, body), f"{body!r} decoded to {msg!r}, which encodes to {again!r}"
    return msg
