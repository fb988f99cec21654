"""Grants: the fact that a peer *may* access some blocks.

A grant exists from the moment a block address leaves the process (or a transfer reading it was
posted). From then on only evidence can end it (see ``kvlifetime.spec.proof``).
"""

from __future__ import annotations

import enum
from typing import Any

import attrs
import numpy as np
import numpy.typing as npt

from kvlifetime import inputs
from kvlifetime.errors import BlockError, InvalidField

RequestKey = str | int
"""A request is identified by an exact key: compared with ``==``, never by prefix."""

PeerId = str
"""A peer: a remote worker, a transfer engine, a DMA stream. Any non-empty string."""

BlockIds = npt.NDArray[np.int64]
Generations = npt.NDArray[np.uint32]


class Access(enum.Enum):
    """What a grant lets the peer do to the blocks."""

    READ = "read"
    WRITE = "write"


def check_request_key(_inst: object, attr: attrs.Attribute[Any], value: object) -> None:
    # bool is an int subclass; a request keyed True is a bug, not an id.
    inputs.request_key(value, attr.name)


def check_peer(_inst: object, attr: attrs.Attribute[Any], value: object) -> None:
    inputs.peer_id(value, attr.name)


@attrs.frozen(slots=True)
class GrantId:
    """Names one grant, unique across ledgers and process restarts.

    ``incarnation`` is random per ledger instance, so a grant id from a previous process (or from
    another ledger) can never be mistaken for one of ours; ``serial`` counts grants within the
    incarnation and is never reused.
    """

    incarnation: str = attrs.field()  # non-empty; random per BlockLedger instance
    serial: int = attrs.field()  # >= 1, strictly increasing within the incarnation

    @incarnation.validator
    def _check_incarnation(self, _a: attrs.Attribute[str], v: object) -> None:
        if not isinstance(v, str) or not v:
            raise InvalidField(f"incarnation must be a non-empty str, got {v!r}")

    @serial.validator
    def _check_serial(self, _a: attrs.Attribute[int], v: object) -> None:
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise InvalidField(f"serial must be an int >= 1, got {v!r}")

    def __str__(self) -> str:
        return f"{self.incarnation}#{self.serial}"


def _readonly_ids(value: object) -> BlockIds:
    # Strict: ints only, never coerced (``inputs.block_ids``); no ledger, so no upper bound.
    return inputs.block_ids(value, None)


def _readonly_generations(value: object) -> Generations:
    try:
        gens = inputs.block_ids(value, 1 << 32, unique=False).astype(np.uint32)
    except BlockError as e:  # a generation is not a block id: say which field is wrong
        raise InvalidField(f"generations must be ints in [0, 2**32): {e}") from None
    gens.flags.writeable = False
    return gens


def _check_gid(_inst: object, attr: attrs.Attribute[Any], value: object) -> None:
    inputs.instance(value, GrantId, attr.name)


def _check_access(_inst: object, attr: attrs.Attribute[Any], value: object) -> None:
    inputs.instance(value, Access, attr.name)


def _check_generations(inst: Grant, attr: attrs.Attribute[Any], value: Generations) -> None:
    if len(value) != len(inst.blocks):
        raise InvalidField(
            f"{attr.name} must have one entry per block ({len(inst.blocks)}), got {len(value)}"
        )


@attrs.frozen(slots=True, eq=False)
class Grant:
    """A peer may access ``blocks`` (at ``generations``) of ``request``, for ``access``.

    Issued by ``BlockLedger.grant``; immutable. Two grants are equal when their ids are: the id
    is unique, and everything else was fixed when it was issued.
    """

    id: GrantId = attrs.field(validator=_check_gid)
    request: RequestKey = attrs.field(validator=check_request_key)  # holds every one of blocks
    peer: PeerId = attrs.field(validator=check_peer)  # who may touch the memory
    blocks: BlockIds = attrs.field(converter=_readonly_ids)  # read-only copy, 1-d int64
    generations: Generations = attrs.field(
        converter=_readonly_generations, validator=_check_generations
    )  # len == blocks
    access: Access = attrs.field(validator=_check_access)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Grant) and other.id == self.id

    def __hash__(self) -> int:
        return hash(self.id)

    def describe(self) -> dict[str, object]:
        """Plain data for logs and the wire."""
        return {
            "grant": str(self.id),
            "request": self.request,
            "peer": self.peer,
            "access": self.access.value,
            "blocks": self.blocks.tolist(),
            "generations": self.generations.tolist(),
        }


def make_grant_id(incarnation: str, serial: int) -> GrantId:
    """A ``GrantId`` from values the ledger already knows are valid (hot path)."""
    gid = object.__new__(GrantId)
    object.__setattr__(gid, "incarnation", incarnation)
    object.__setattr__(gid, "serial", serial)
    return gid


def make_grant(
    gid: GrantId,
    request: RequestKey,
    peer: PeerId,
    blocks: BlockIds,
    generations: Generations,
    access: Access,
) -> Grant:
    """Build a ``Grant`` from values the ledger already validated, without copying arrays.

    ``blocks`` (int64) and ``generations`` (uint32) must already be read-only arrays. This is the
    ledger's hot path; everyone else uses the ``Grant(...)`` constructor.
    """
    g = object.__new__(Grant)
    object.__setattr__(g, "id", gid)
    object.__setattr__(g, "request", request)
    object.__setattr__(g, "peer", peer)
    object.__setattr__(g, "blocks", blocks)
    object.__setattr__(g, "generations", generations)
    object.__setattr__(g, "access", access)
    return g
