"""The environment around a real ``BlockLedger``: requests, peers, a faulty control channel.

With ``engine="ledger"`` the explorer (``explore.py``) never models the ledger: every owner call
and every piece of evidence goes to a real ``BlockLedger``, copied before it changes
(``BlockLedger.copy``); ``engine="packed"`` runs this same model over ``packed.PackedLedger``,
proven equal to it (``tests/test_verify_packed.py``), its counterexamples replayed on the real
ledger. What is
modelled here is only what the ledger cannot see — the peers, their transfers, the messages on
the wire — and the *release policy* of the engine around it:

- ``naive``: the engine frees the blocks when it rejects / aborts the request (the error response
  is read as the end of the blocks' life);
- ``timeout``: the engine frees the blocks when a deadline passes (a lease reaper:
  ``force_release`` of every quarantined request);
- ``proof``: the engine frees only what ``collect_releasable()`` returns;
- ``trusting``: as ``proof``, but its receiver has no provenance: it stamps the evidence it
  decodes from the wire as local (it believes whatever a peer says, about anyone);
- ``first-rank``: as ``proof``, but a request is freed once one grant (rank) of each of its
  peers is closed (refuted with ``Config.ranks`` >= 2);
- ``fresh-restart``: as ``proof``, but a restart of the owner (``Config.restarts``) starts a
  ledger with every block free (refuted with ``restarts=1``);
- ``untracked-share``: as ``proof``, but a prefix hit (``Config.share``) is kept in the
  engine's own cache, never told to the ledger (refuted with ``share=True``);
- ``first-failure``, ``counted-completions``, ``ordered-reaper``, ``id-overwrite``: the field's
  bug classes (vLLM #56104, #51786, #58222 / #50789, #49796): the first FAILED transfer frees
  the request; completion notices counted per request; a head-of-line reaper; a reused id
  takes a held request's entry (refuted with the fail fault, duplicate and two grants, two
  requests, ``Config.reuse_ids``);
- ``sglang-0.5.23``: SGLang 0.5.23's own rules: an aborted request is held until every grant is
  closed or its deadline passes (its first lease), then ``force_release``d; with READ grants
  (its prefill) freed at the abort (refuted with the ``timeout`` fault; with READ, with none).

The options ``Config.access`` (READ grants: the pull direction), ``Config.ranks``,
``Config.restarts`` and ``Config.share`` add the library's newer behaviours; none of them
changes what the fault kinds or the first four policies mean.

Evidence a peer sends carries the transport's identity of its connection
(``Source.peer("p1")``) under every policy but ``trusting``; what the process makes itself (a
fencing's ``AccessRevoked``, the clock's ``LeaseExpired``, the failure detector's ``PeerLost``)
stays ``LOCAL``. With the ``lie`` fault any peer may, at any point, send what it may not claim
(``lie_table``); the ledger's provenance rules must refuse it, and a refused lie changes nothing
(see "lies" in ``explore.py``).

Every policy also calls ``collect_releasable()`` after each step (the scheduler loop): they
differ only in the extra, unsafe releases.

Why the peers behave as they do (the table in ``kvlifetime.adapters.mooncake``): a transfer that
reported FAILED may still land later; a crashed peer's transfers already in flight still land unless
it was fenced; only fencing (``AccessRevoked``) stops them, atomically with the evidence: a write
that arrives after the fencing touches nothing. A crash is seen grant by grant: the peer goes silent
on each of its grants at that grant's own moment (the crash that silences them all at once is one of
those runs), and its heartbeat fails (``PeerLost``).

A state is immutable: ``step`` returns a new one. Steps that do not touch the ledger (a peer
posts, a transfer lands, a message is duplicated) share the parent's ledger object, so most
successors cost no ledger copy at all.

The model lives in these modules, one per concept; this one re-exports them:

- ``state``: the configuration (``Config``), the policies, the fault kinds, and the immutable
  state of the environment (``Env``, ``State``, ``Snap``);
- ``events``: which events are enabled (the prompt rule, the fault budgets, crashes);
- ``lies``: the lying peer's table of lies and the ledger's answers to them;
- ``por``: the stubborn sets of the partial-order reduction (argued in ``explore.py``);
- ``semantics``: ``step``, what each event does (over ``scratch``, one step's scratch);
- ``policies``: the release policies run after each step, and the checks (progress,
  exclusivity, no leak).

The search is ``explore`` (its keys in ``keys``, its outcome in ``result``).

``docs/verification.md`` describes the events, fault kinds, policies and reductions in one place.
"""

from __future__ import annotations

from kvlifetime.verify.events import (
    BUDGETED,
    GRANT_EVENTS,
    MSG_EVENTS,
    PEER_EVENTS,
    enabled,
    fence_possible,
    fences_may_close,
    grant_of,
    is_fault,
    lost_possible,
    may_crash,
    owner,
    peer_may_act,
)
from kvlifetime.verify.lies import (
    ACK_KINDS,
    Lie,
    lie_events,
    lie_evidence,
    lie_table,
    lie_text,
    lies,
    wire_source,
)
from kvlifetime.verify.por import (
    stubborn,
)
from kvlifetime.verify.semantics import (
    check_quiet,
    describe_event,
    msg_text,
    run_events,
    step,
)
from kvlifetime.verify.state import (
    ALL_FAULTS,
    FAILED,
    FINISHED,
    IN_FLIGHT,
    INCARNATION,
    INVARIANTS,
    LANDED,
    LANDED_UNSEEN,
    LIMITS,
    LIVE,
    POLICY_RULES,
    REJECTED,
    RELEASED,
    TO_LEDGER,
    TO_PEER,
    Broken,
    Config,
    Env,
    Event,
    Fault,
    GrantSide,
    Msg,
    PeerSide,
    Policy,
    ReqSide,
    Snap,
    State,
    Violation,
    initial,
    parse_faults,
    peer_name,
)

__all__ = [
    "ACK_KINDS",
    "ALL_FAULTS",
    "BUDGETED",
    "FAILED",
    "FINISHED",
    "GRANT_EVENTS",
    "INCARNATION",
    "INVARIANTS",
    "IN_FLIGHT",
    "LANDED",
    "LANDED_UNSEEN",
    "LIMITS",
    "LIVE",
    "MSG_EVENTS",
    "PEER_EVENTS",
    "POLICY_RULES",
    "REJECTED",
    "RELEASED",
    "TO_LEDGER",
    "TO_PEER",
    "Broken",
    "Config",
    "Env",
    "Event",
    "Fault",
    "GrantSide",
    "Lie",
    "Msg",
    "PeerSide",
    "Policy",
    "ReqSide",
    "Snap",
    "State",
    "Violation",
    "check_quiet",
    "describe_event",
    "enabled",
    "fence_possible",
    "fences_may_close",
    "grant_of",
    "initial",
    "is_fault",
    "lie_events",
    "lie_evidence",
    "lie_table",
    "lie_text",
    "lies",
    "lost_possible",
    "may_crash",
    "msg_text",
    "owner",
    "parse_faults",
    "peer_may_act",
    "peer_name",
    "run_events",
    "step",
    "stubborn",
    "wire_source",
]
