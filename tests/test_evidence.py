"""Evidence classes: what each proves (exactly), how each refuses bad fields, the wire format."""

from __future__ import annotations

from typing import Any

import attrs
import pytest

from kvlifetime.errors import InvalidField, MalformedEvidence
from kvlifetime.evidence import (
    BY_NAME,
    EVIDENCE_CLASSES,
    MEMORY_CLAIMS,
    AccessRevoked,
    CancelReceived,
    Claim,
    Evidence,
    LeaseExpired,
    PeerLost,
    SchedulingStopped,
    TransferCompleted,
    TransferQuiesced,
    claims_matrix,
    from_dict,
    from_record,
    not_proven,
    proves_text,
    to_dict,
    to_wire,
)
from kvlifetime.grant import GrantId
from kvlifetime.source import LOCAL, Source

C = Claim
GID = GrantId("inc-a", 7)

# docs/evidence.md, "Evidence and what it proves", as data.
EXPECTED_PROVES: dict[type[Evidence], frozenset[Claim]] = {
    CancelReceived: frozenset({C.CANCEL_RECEIVED}),
    SchedulingStopped: frozenset({C.CANCEL_RECEIVED, C.SCHEDULING_STOPPED}),
    TransferQuiesced: frozenset({C.TRANSFERS_ENDED}),
    TransferCompleted: frozenset({C.CANCEL_RECEIVED, C.SCHEDULING_STOPPED, C.TRANSFERS_ENDED}),
    AccessRevoked: frozenset({C.ACCESS_REVOKED}),
    LeaseExpired: frozenset({C.DEADLINE_PASSED}),
    PeerLost: frozenset({C.HEARTBEAT_FAILED}),
}

# One valid instance of each class (and of the peer-wide form of AccessRevoked).
SAMPLES: list[Evidence] = [
    CancelReceived(GID, "req-1", "peer-a"),
    SchedulingStopped(GID, "req-1", "peer-a", last_seq=0),
    SchedulingStopped(GID, 42, "peer-a", last_seq=5),
    TransferQuiesced(GID, "req-1", "peer-a", through_seq=3),
    TransferCompleted(GID, "req-1", "peer-a", last_seq=9),
    AccessRevoked("peer-a", GID, "req-1"),
    AccessRevoked("peer-a"),
    LeaseExpired(GID, "req-1", "peer-a"),
    PeerLost("peer-a"),
]

# type[Any]: the tests call them with bad arguments on purpose
SEQ_FIELDS: list[tuple[type[Any], str]] = [
    (SchedulingStopped, "last_seq"),
    (TransferQuiesced, "through_seq"),
    (TransferCompleted, "last_seq"),
]
GRANT_CLASSES: list[type[Any]] = [
    CancelReceived,
    SchedulingStopped,
    TransferQuiesced,
    TransferCompleted,
    LeaseExpired,
]


def test_every_class_is_listed() -> None:
    assert set(EVIDENCE_CLASSES) == set(EXPECTED_PROVES)
    assert {type(s) for s in SAMPLES} == set(EVIDENCE_CLASSES)
    assert dict(BY_NAME) == {c.__name__: c for c in EVIDENCE_CLASSES}


@pytest.mark.parametrize("cls", EVIDENCE_CLASSES, ids=lambda c: c.__name__)
def test_proves_exactly(cls: type[Evidence]) -> None:
    assert EXPECTED_PROVES[cls] == cls.PROVES


def test_suspicion_is_not_a_memory_claim() -> None:
    assert C.DEADLINE_PASSED not in MEMORY_CLAIMS
    assert C.HEARTBEAT_FAILED not in MEMORY_CLAIMS
    assert not (LeaseExpired.PROVES | PeerLost.PROVES) & MEMORY_CLAIMS


@pytest.mark.parametrize("cls", EVIDENCE_CLASSES, ids=lambda c: c.__name__)
def test_docstring_says_what_it_proves_and_not(cls: type[Evidence]) -> None:
    lines = [ln.strip() for ln in (cls.__doc__ or "").splitlines()]
    assert "Proves:" in lines
    assert "Does not prove:" in lines
    assert lines.index("Proves:") < lines.index("Does not prove:")
    assert proves_text(cls)
    assert not_proven(cls)
    assert "Does not prove" not in proves_text(cls)


# --------------------------------------------------------------------------- validation


@pytest.mark.parametrize(("cls", "field"), SEQ_FIELDS, ids=lambda x: getattr(x, "__name__", x))
@pytest.mark.parametrize("bad", [-1, True, False, 1.0, "3", None])
def test_bad_sequence_number(cls: type[Any], field: str, bad: object) -> None:
    with pytest.raises(InvalidField, match=field):
        cls(GID, "req-1", "peer-a", **{field: bad})


@pytest.mark.parametrize(("cls", "field"), SEQ_FIELDS, ids=lambda x: getattr(x, "__name__", x))
def test_sequence_zero_is_valid(cls: type[Any], field: str) -> None:
    assert getattr(cls(GID, "req-1", "peer-a", **{field: 0}), field) == 0


@pytest.mark.parametrize("cls", GRANT_CLASSES, ids=lambda c: c.__name__)
@pytest.mark.parametrize(
    ("grant_id", "request_key", "peer"),
    [
        ("inc-a#7", "req-1", "peer-a"),  # a grant id must be a GrantId, not its text
        (None, "req-1", "peer-a"),
        (GID, "", "peer-a"),  # empty request key
        (GID, True, "peer-a"),  # bool is not a request key
        (GID, 1.5, "peer-a"),
        (GID, None, "peer-a"),
        (GID, "req-1", ""),  # empty peer
        (GID, "req-1", 3),
        (GID, "req-1", None),
    ],
)
def test_bad_grant_fields(cls: type[Any], grant_id: Any, request_key: Any, peer: Any) -> None:
    with pytest.raises(InvalidField):
        cls(grant_id, request_key, peer)


def test_int_request_keys_are_valid() -> None:
    assert CancelReceived(GID, 0, "p").request == 0


@pytest.mark.parametrize(
    ("incarnation", "serial"), [("", 1), (None, 1), ("inc", 0), ("inc", -1), ("inc", True)]
)
def test_bad_grant_id(incarnation: Any, serial: Any) -> None:
    with pytest.raises(InvalidField):
        GrantId(incarnation, serial)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"peer": ""},
        {"peer": 1},
        {"peer": "p", "grant_id": GID},  # grant without its request
        {"peer": "p", "request": "req-1"},  # request without its grant
        {"peer": "p", "grant_id": "inc#1", "request": "req-1"},
        {"peer": "p", "grant_id": GID, "request": ""},
    ],
)
def test_bad_access_revoked(kwargs: dict[str, Any]) -> None:
    with pytest.raises(InvalidField):
        AccessRevoked(**kwargs)


@pytest.mark.parametrize("peer", ["", None, 0])
def test_bad_peer_lost(peer: Any) -> None:
    with pytest.raises(InvalidField):
        PeerLost(peer)


def test_invalid_field_is_a_value_error() -> None:
    # callers that only know ValueError still catch it
    with pytest.raises(ValueError):
        TransferQuiesced(GID, "r", "p", through_seq=-5)


# --------------------------------------------------------------------------- immutability


@pytest.mark.parametrize("ev", SAMPLES, ids=lambda e: e.kind)
def test_frozen(ev: Evidence) -> None:
    name = attrs.fields(type(ev))[0].name
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        setattr(ev, name, getattr(ev, name))
    with pytest.raises((AttributeError, TypeError)):
        ev.extra = 1  # type: ignore[attr-defined]  # slotted: no new attributes


@pytest.mark.parametrize("ev", SAMPLES, ids=lambda e: e.kind)
def test_value_semantics(ev: Evidence) -> None:
    twin = from_record(to_dict(ev))
    assert twin == ev
    assert hash(twin) == hash(ev)
    assert ev.kind == type(ev).__name__


# --------------------------------------------------------------------------- wire format


@pytest.mark.parametrize("ev", SAMPLES, ids=lambda e: e.kind)
def test_round_trip(ev: Evidence) -> None:
    data = to_dict(ev)
    assert data["type"] == type(ev).__name__
    back = from_record(data)
    assert type(back) is type(ev)
    assert back == ev
    # Off the wire, the receiver stamps the connection's identity instead.
    wire = to_wire(ev)
    assert "source" not in wire
    peer = Source.peer("conn-7")
    assert from_dict(wire, source=peer) == attrs.evolve(ev, source=peer)


def test_a_message_cannot_name_its_own_source() -> None:
    data = {**to_wire(CancelReceived(GID, "r", "p")), "source": "local"}
    with pytest.raises(MalformedEvidence, match="source"):
        from_dict(data, source=Source.peer("p"))


def test_from_dict_needs_a_source() -> None:
    with pytest.raises(InvalidField):
        from_dict(to_wire(CancelReceived(GID, "r", "p")), source="p")  # type: ignore[arg-type]


def test_to_dict_is_plain_data() -> None:
    assert to_dict(SchedulingStopped(GID, "req-1", "peer-a", last_seq=4)) == {
        "type": "SchedulingStopped",
        "grant_id": ["inc-a", 7],
        "request": "req-1",
        "peer": "peer-a",
        "last_seq": 4,
        "source": "local",
    }
    assert to_dict(PeerLost("peer-b", source=Source.peer("x"))) == {
        "type": "PeerLost",
        "peer": "peer-b",
        "source": "peer:x",
    }


def test_from_dict_accepts_tuple_grant_id() -> None:
    data = {"type": "CancelReceived", "grant_id": ("inc-a", 7), "request": "r", "peer": "p"}
    assert from_dict(data, source=LOCAL) == CancelReceived(GID, "r", "p")


_GOOD = {"type": "TransferQuiesced", "grant_id": ["inc-a", 7], "request": "r", "peer": "p"}
_MIXED_KEYS: dict[object, object] = dict(_GOOD.items())
_MIXED_KEYS.update({1: "x", "y": 2})


@pytest.mark.parametrize(
    "data",
    [
        None,
        "TransferQuiesced",
        [("type", "TransferQuiesced")],
        {},
        {"type": "Ack2"},
        {"type": 3},
        {**_GOOD, "type": "transferquiesced"},
        {**_GOOD, "extra": 1},
        {**_GOOD, "grant_id": "inc-a#7"},
        {**_GOOD, "grant_id": ["inc-a"]},
        {**_GOOD, "grant_id": ["inc-a", 7, 1]},
        {**_GOOD, "grant_id": ["", 7]},
        {**_GOOD, "grant_id": ["inc-a", 0]},
        {**_GOOD, "grant_id": ["inc-a", True]},
        {**_GOOD, "through_seq": -1},
        {**_GOOD, "through_seq": "1"},
        {**_GOOD, "request": ""},
        {**_GOOD, "peer": None},
        {k: v for k, v in _GOOD.items() if k != "peer"},  # missing a required field
        {"type": "AccessRevoked", "peer": "p", "request": "r"},
        {"type": "PeerLost"},
        _MIXED_KEYS,  # extra keys of mixed types (they do not sort)
        {**_GOOD, "source": "local"},  # a message naming its own source
    ],
)
def test_from_dict_malformed(data: object) -> None:
    with pytest.raises(MalformedEvidence):
        from_dict(data, source=Source.peer("p"))


def test_from_dict_good_sample_is_accepted() -> None:
    # the malformed cases above are one change away from this
    assert from_dict(_GOOD, source=LOCAL) == TransferQuiesced(GID, "r", "p", through_seq=0)


def test_malformed_chains_the_cause() -> None:
    with pytest.raises(MalformedEvidence) as exc:
        from_dict({**_GOOD, "through_seq": -1}, source=LOCAL)
    assert isinstance(exc.value.__cause__, InvalidField)
    assert exc.value.kind == "malformed_evidence"


# --------------------------------------------------------------------------- claims matrix


def test_claims_matrix() -> None:
    rows = claims_matrix()
    assert [r["evidence"] for r in rows] == [c.__name__ for c in EVIDENCE_CLASSES]
    for r in rows:
        cls = BY_NAME[str(r["evidence"])]
        assert r["claims"] == {c.value: c in EXPECTED_PROVES[cls] for c in Claim}
        assert r["proves"] == proves_text(cls)
        assert r["does_not_prove"] == not_proven(cls)
        assert r["proves"] and r["does_not_prove"]


def test_claims_matrix_spot_checks() -> None:
    by = {r["evidence"]: r for r in claims_matrix()}
    assert by["CancelReceived"]["does_not_prove"] is not None
    assert "stopped scheduling" in str(by["CancelReceived"]["does_not_prove"])
    assert by["LeaseExpired"]["proves"] == "Only that time passed."
    cancel_claims = by["CancelReceived"]["claims"]
    assert isinstance(cancel_claims, dict)
    assert cancel_claims["scheduling_stopped"] is False


def test_about_builds_each_kind_for_a_grant_and_refuses_unknown_kinds() -> None:
    from kvlifetime.errors import InvalidField
    from kvlifetime.evidence import EVIDENCE_CLASSES, about
    from kvlifetime.grant import Access, Grant, GrantId

    g = Grant(GrantId("inc", 3), "r", "p", [1, 2], [0, 0], Access.WRITE)
    for cls in EVIDENCE_CLASSES:
        ev = about(g, cls.__name__, 4)
        assert type(ev) is cls
        assert getattr(ev, "peer") == "p"  # noqa: B009 - every evidence class has a peer
        if hasattr(ev, "grant_id"):
            assert getattr(ev, "grant_id") == g.id  # noqa: B009
    assert about(g, "SchedulingStopped", 4) == SchedulingStopped.of(g, 4)
    with pytest.raises(InvalidField, match="unknown evidence kind"):
        about(g, "Ack2")
