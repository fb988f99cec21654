"""The engine's release policies, run after every step that may have changed the ledger, and
the invariants checked along the way (progress, exclusivity, no leak)."""

from __future__ import annotations

import numpy as np

from kvlifetime.errors import DuplicateRequest
from kvlifetime.grant import Access
from kvlifetime.spec.owner import owner_step
from kvlifetime.spec.vocabulary import BlockState, RequestState
from kvlifetime.verify.scratch import Scratch
from kvlifetime.verify.state import (
    FINISHED,
    LIVE,
    PREVIOUS,
    REJECTED,
    RELEASED,
    Broken,
    GrantSide,
    Msg,
    Policy,
    ReqSide,
    State,
    Violation,
    evolve,
)

_ENDED = (FINISHED, REJECTED)


def settle(s: Scratch) -> None:
    """The engine's release policy, run after every step that may have changed the ledger."""
    if s.copy_made is None:
        return
    led = s.copy_made
    if s.policy is Policy.TIMEOUT:
        for ri, r in enumerate(s.env.reqs):
            if r.phase in (FINISHED, REJECTED) and led.state(r.key) is RequestState.QUARANTINED:
                ids = s.call(f"force_release({r.key!r})", led.force_release, r.key, "lease reaper")
                s.release_as(ri, ids, "lease reaper (timeout policy) releases")
    if s.policy is Policy.FIRST_RANK:
        for ri, r in enumerate(s.env.reqs):
            if r.phase in (FINISHED, REJECTED) and _one_rank_closed_per_peer(s, r.grants):
                ids = s.call(
                    f"force_release({r.key!r})", led.force_release, r.key, "first rank done"
                )
                s.release_as(ri, ids, "first-rank policy (one rank closed per peer) releases")
    if s.policy is Policy.SGLANG_0_5_23 and s.config.access is Access.WRITE:
        for ri, r in enumerate(s.env.reqs):
            if r.phase == REJECTED and _sglang_deadline_passed(s, r):
                ids = s.call(
                    f"force_release({r.key!r})",
                    led.force_release,
                    r.key,
                    "sglang-0.5.23: deferred release timed out without a full drain ack",
                )
                s.release_as(
                    ri,
                    ids,
                    "sglang-0.5.23's decode (deadline passed without every rank's drain ACK: "
                    '"releasing anyway") releases',
                )
    if s.policy is Policy.COUNTED_COMPLETIONS:
        for ri, r in enumerate(s.env.reqs):
            if (
                r.phase in (FINISHED, REJECTED)
                and r.grants
                and r.completions >= len(r.grants)
                and led.open_grants(r.key)
            ):
                ids = s.call(
                    f"force_release({r.key!r})",
                    led.force_release,
                    r.key,
                    f"counted-completions: {r.completions} notices for {len(r.grants)} grants",
                )
                s.release_as(
                    ri,
                    ids,
                    f"counted-completions ({r.completions} completion notices counted, as many "
                    "as grants) releases",
                )
    if s.policy is Policy.ORDERED_REAPER:
        _reap_in_order(s)
        return
    freed = s.call("collect_releasable()", led.collect_releasable)
    for key, ids in freed.items():
        if key == PREVIOUS:
            s.notes.append(
                f"collect_releasable reclaims blocks {list(map(int, ids))} of the previous "
                "incarnation: every peer is fenced"
            )
            continue
        # A reused id names one held request at a time (an earlier one is released).
        ri = next(i for i, r in enumerate(s.env.reqs) if r.key == key and r.phase != RELEASED)
        s.release_as(ri, ids, "collect_releasable releases")


def _reap_in_order(s: Scratch) -> None:
    """The head-of-line reaper (``Policy.ORDERED_REAPER``): the ended requests in the order
    they ended, each released once the ledger has it provably over (``transfer_quiesced``,
    what ``collect_releasable`` would release), stopping at the first one that is not."""
    led = s.view
    for _, ri in sorted((r.ended, ri) for ri, r in enumerate(s.env.reqs) if r.phase in _ENDED):
        r = s.env.reqs[ri]
        if led.state(r.key) is not RequestState.TRANSFER_QUIESCED:
            s.notes.append(
                f"the ordered reaper stops at {r.key} (not provably over): nothing behind it "
                "is looked at"
            )
            return
        ids = s.call(f"release({r.key!r})", led.release, r.key)
        s.release_as(ri, ids, "the ordered reaper releases")


def end_order(s: Scratch) -> int:
    """The place in the end order of the request ending now: 1 + the most recent one under
    ``ordered-reaper``, which reads it; 0 under every other policy, so the order of ends stays
    out of their states (the key would split on it)."""
    if s.policy is not Policy.ORDERED_REAPER:
        return 0
    return 1 + max((r.ended for r in s.env.reqs), default=0)


def free_on_failure(s: Scratch, ri: int) -> bool:
    """``Policy.FIRST_FAILURE`` at a transfer reporting FAILED: the engine ends the request
    (a live one is rejected, as vLLM's scheduler fails a request whose load failed) and frees
    its blocks at once, whatever its other transfers are doing. Returns whether the ledger
    changed."""
    r = s.env.reqs[ri]
    if s.policy is not Policy.FIRST_FAILURE or r.phase == RELEASED or r.grants == ():
        return False
    if r.phase == LIVE:
        s.call(f"reject({r.key!r})", s.ledger.reject, r.key, "transfer failed")
        s.set_req(ri, phase=owner_step(r.phase, "aborted"), ended=end_order(s))
        s.notes.append(f"{r.key} fails: the engine ends it (the load failed)")
    ids = s.call(
        f"force_release({r.key!r})",
        s.ledger.force_release,
        r.key,
        "first-failure: a transfer failed",
    )
    s.release_as(ri, ids, "first-failure (one transfer FAILED) releases")
    return True


def reuse_id(s: Scratch, ri: int) -> bool:
    """A new request arrives with the id of ``ri``, an ended request the engine still holds.
    ``id-overwrite``: its entry is taken over, the old request's blocks freed to make room,
    and the new request allocated under the same id. Every other policy: the ledger refuses
    the duplicate id (``DuplicateRequest``) and the engine turns the new request away before
    admission (nothing allocated). Returns whether the ledger changed."""
    old = s.env.reqs[ri]
    n = s.config.blocks_per_request
    s.env = evolve(s.env, admitted=s.env.admitted + 1)
    if s.policy is not Policy.ID_OVERWRITE:
        try:
            s.ledger.admit(old.key)
        except DuplicateRequest as e:
            s.notes.append(f"the ledger refuses the id: {e}; the new request is turned away")
            return False
        raise Broken("ledger_error", f"the ledger admitted {old.key!r} twice")
    why = "id-overwrite: the id was reused"
    ids = s.call(f"force_release({old.key!r})", s.ledger.force_release, old.key, why)
    s.release_as(ri, ids, f"id-overwrite (a new request took {old.key}'s entry) releases")
    got = s.call(f"allocate({old.key!r}, {n})", s.ledger.allocate, old.key, n)
    blocks = tuple(int(b) for b in got)
    s.env = evolve(s.env, reqs=(*s.env.reqs, ReqSide(old.key, LIVE, blocks, ())))
    s.notes.append(f"the new {old.key} is admitted: allocates blocks {list(blocks)}")
    check_exclusive(s, len(s.env.reqs) - 1)
    return True


def count_completion(s: Scratch, m: Msg, g: GrantSide) -> None:
    """``Policy.COUNTED_COMPLETIONS`` at a completion notice reaching the engine: one more for
    its request, whichever grant (or channel) it is about and however often it came."""
    if s.policy is not Policy.COUNTED_COMPLETIONS or m.kind != "TransferCompleted" or g.old:
        return
    r = s.env.reqs[g.req]
    if r.phase != RELEASED:
        s.set_req(g.req, completions=r.completions + 1)
        s.notes.append(
            f"the engine counts a completion notice for {r.key}: {r.completions + 1} of "
            f"{len(r.grants)} grants"
        )


def sglang_frees_at_failed(s: Scratch) -> bool:
    """SGLang 0.5.23's prefill frees the source pages its transfer worker reads (READ grants)
    as soon as the sender's poll says Failed (``handle_inflight_transfer_failure``), which it
    does at the abort, with a chunk still in flight."""
    return s.policy is Policy.SGLANG_0_5_23 and s.config.access is Access.READ


def _sglang_deadline_passed(s: Scratch, r: ReqSide) -> bool:
    """SGLang 0.5.23's decode, ``resolve_deferred_releases``: ``ready = drained or now >=
    deadline``. Drained (every rank's grant closed) is ``collect_releasable``'s; this is the
    other half: a grant is still open and the held entry's one deadline, started at the abort
    as every lease of ``r`` is, has passed (the first of ``r``'s leases fired)."""
    return bool(s.view.open_grants(r.key)) and any(s.env.grants[gi].lease_fired for gi in r.grants)


def _one_rank_closed_per_peer(s: Scratch, grants: tuple[int, ...]) -> bool:
    """Whether a grant is still open while each peer has one closed (what an engine that
    tracks one transfer per request and peer takes for the end)."""
    led = s.view
    closed: dict[int, bool] = {}
    some_open = False
    for gi in grants:
        g = s.env.grants[gi]
        c = led.proof_of(g.grant).closed
        some_open = some_open or not c
        closed[g.peer] = closed.get(g.peer, False) or c
    return some_open and all(closed.values())


def check_progress(s: Scratch) -> None:
    led = s.view
    for r in s.env.reqs:
        if r.phase in (FINISHED, REJECTED) and not led.open_grants(r.key):
            raise Broken(
                "progress",
                f"{r.key} has every grant closed but is still held in state "
                f"{led.state(r.key).value}: collect_releasable did not release it",
            )


def check_exclusive(s: Scratch, ri: int) -> None:
    new = s.env.reqs[ri]
    for other in s.env.reqs:
        if other is new or other.phase == RELEASED:
            continue
        both = set(other.blocks) & set(new.blocks)
        if both:
            raise Broken(
                "exclusivity",
                f"blocks {sorted(both)} handed to {new.key} while {other.key} still holds them",
            )


def check_quiet(state: State) -> Violation | None:
    """No leak: in a state where nothing can happen any more, every block is free or
    quarantined with a reason."""
    led = state.snap.ledger
    bs = led.block_state(np.arange(led.num_blocks))
    bad = [
        (b, BlockState(int(c)).label)
        for b, c in enumerate(bs.tolist())
        if c not in (BlockState.FREE, BlockState.QUARANTINED)
    ]
    if bad:
        return Violation(
            "no_leak",
            "quiet state with blocks neither free nor quarantined: "
            + ", ".join(f"block {b} {lab}" for b, lab in bad),
        )
    for q in led.stats().quarantined:
        if not q.reason:
            return Violation("no_leak", f"{q.request} quarantined without a reason")
    return None
