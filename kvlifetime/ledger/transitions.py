"""Request transitions: the tables compiled from the specification, stepped for one record.

A call-driven transition (reject, finish, release, force_released) is ``fire``; the
evidence-driven ones (cancel_received ... transfer_quiesced, quarantined) are ``advance``,
which fires every one whose guard now holds, in proof-chain order. ``moved`` does the table's
bookkeeping on a state change (the requests ready to release, a quarantine's reason and time)
and records the ``Transition``; a checked table mirrors each one into the python-statemachine
lifecycle and fails loudly (``SpecDisagreement``) where the two disagree.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvlifetime.errors import IllegalTransition, InsufficientEvidence, SpecDisagreement, show
from kvlifetime.ledger.records import GrantRecord, RequestRecord
from kvlifetime.ledger.values import Transition
from kvlifetime.spec.table import request_table
from kvlifetime.spec.vocabulary import PROOF_CHAIN, RequestState

if TYPE_CHECKING:
    from kvlifetime.ledger.requests import RequestTable

_TRANSFER_QUIESCED = RequestState.TRANSFER_QUIESCED.value
_QUARANTINED = RequestState.QUARANTINED.value
# Targets that need bookkeeping beyond the state itself.
_BOOKKEEPING = frozenset({_TRANSFER_QUIESCED, _QUARANTINED, RequestState.RELEASED.value})

_new_tuple = tuple.__new__

TABLE = request_table()
# For each state, the evidence-driven transitions that may fire from it, in PROOF_CHAIN order:
# (event, guard function, target). Precomputed so a step is a dict lookup and a guard call.
_CHAIN: dict[str, tuple[tuple[str, Any, str], ...]] = {}
for _state in TABLE.states:
    _CHAIN[_state] = tuple(
        (row.event, TABLE.guards[row.guard] if row.guard else (lambda _f: True), row.target)
        for ev in PROOF_CHAIN
        for row in TABLE.rows_for(_state, ev.value)
    )


def fire(table: RequestTable, req: RequestRecord, event: str, cause: str, out: list[Any]) -> None:
    """Fire a call-driven transition (reject, finish, release, force_released)."""
    target = TABLE.step(req.state, event, req, req.key)
    if target is None:
        if event == "released":
            raise InsufficientEvidence(req.key, table.unproven(req))
        raise IllegalTransition("request", req.key, req.state, event)
    moved(table, req, event, target, cause, None, out)


def advance(
    table: RequestTable,
    req: RequestRecord,
    cause: str,
    rec: GrantRecord | None,
    out: list[Transition],
) -> None:
    """Fire every evidence-driven transition whose guard now holds, in chain order."""
    while True:
        for event, guard, target in _CHAIN[req.state]:
            if guard(req):
                moved(table, req, event, target, cause, rec, out)
                break
        else:
            return


def moved(
    table: RequestTable,
    req: RequestRecord,
    event: str,
    target: str,
    cause: str,
    rec: GrantRecord | None,
    out: list[Transition],
) -> None:
    source = req.state
    if table.checked:
        _mirror(req, event, target)
    req.state = target
    if target in _BOOKKEEPING:
        if target == _TRANSFER_QUIESCED:
            table.releasable[req.key] = None
        elif target == _QUARANTINED:
            req.quarantine_reason = next(
                (p.suspect for p in req.open_proofs() if p.suspect is not None), "deadline"
            )
            req.quarantined_at = table.clock
        else:
            table.releasable.pop(req.key, None)
    # tuple.__new__ with every field: a NamedTuple's own constructor (a Python function that
    # fills in defaults) costs more than half again as much, once per transition.
    if rec is None:
        unsafe = event == "force_released"  # never the normal path: flagged in the log
        out.append(
            _new_tuple(Transition, (req.key, event, source, target, cause, None, None, unsafe))
        )
    else:
        out.append(
            _new_tuple(
                Transition, (req.key, event, source, target, cause, rec.label, rec.peer, False)
            )
        )


def _mirror(req: RequestRecord, event: str, target: str) -> None:
    m = req.machine
    assert m is not None
    try:
        m.send(event)
    except Exception as e:
        raise SpecDisagreement(
            f"request {show(req.key)}: tables fire {event!r} -> {target!r} from {req.state!r}, "
            f"the specification refuses: {e}"
        ) from e
    if m.current_state_value != target:
        raise SpecDisagreement(
            f"request {show(req.key)}: tables reach {target!r} on {event!r}, "
            f"the specification reaches {m.current_state_value!r}"
        )
