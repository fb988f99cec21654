"""The mutable scratch of one step: a ledger copy made on first need, the environment as it
changes, and the notes; shared by ``semantics`` (the events) and ``policies`` (the release
policies and the checks)."""

from __future__ import annotations

from typing import Any

from kvlifetime.errors import (
    ContradictoryEvidence,
    EvidenceError,
    KVLifetimeError,
    MismatchedEvidence,
    StaleEvidence,
    UnauthorizedEvidence,
)
from kvlifetime.evidence import Evidence
from kvlifetime.spec.owner import owner_step
from kvlifetime.verify.state import (
    Broken,
    Config,
    Env,
    ModelLedger,
    Msg,
    Policy,
    Snap,
    State,
    evolve,
    peer_name,
)


class Scratch:
    """The mutable scratch of one step: a ledger copy made on first need, and the notes."""

    def __init__(self, state: State, config: Config, policy: Policy) -> None:
        self.parent = state
        self.config = config
        self.policy = policy
        self.env = state.env
        self._ledger: ModelLedger | None = None
        self.notes: list[str] = []

    @property
    def ledger(self) -> ModelLedger:
        if self._ledger is None:
            self._ledger = self.parent.snap.ledger.copy()
        return self._ledger

    @property
    def view(self) -> ModelLedger:
        """The ledger for queries: the copy if one was made, else the parent's."""
        return self._ledger if self._ledger is not None else self.parent.snap.ledger

    @property
    def copy_made(self) -> ModelLedger | None:
        """The ledger copy this step made, if it made one (the step changed the ledger)."""
        return self._ledger

    def replace_ledger(self, ledger: ModelLedger) -> None:
        """The step ends with ``ledger`` in place of the parent's (a restart)."""
        self._ledger = ledger

    def call(self, what: str, fn: Any, *args: Any, **kw: Any) -> Any:
        try:
            return fn(*args, **kw)
        except KVLifetimeError as e:
            raise Broken(
                "ledger_error", f"{what} raised {type(e).__name__}: {' '.join(str(e).split())}"
            ) from e

    def set_req(self, ri: int, **changes: Any) -> None:
        reqs = list(self.env.reqs)
        reqs[ri] = evolve(reqs[ri], **changes)
        self.env = evolve(self.env, reqs=tuple(reqs))

    def set_grant(self, gi: int, **changes: Any) -> None:
        grants = list(self.env.grants)
        grants[gi] = evolve(grants[gi], **changes)
        self.env = evolve(self.env, grants=tuple(grants))

    def set_peer(self, pi: int, **changes: Any) -> None:
        peers = list(self.env.peers)
        peers[pi] = evolve(peers[pi], **changes)
        self.env = evolve(self.env, peers=tuple(peers))

    def crash(self, p: int) -> None:
        """The first crash event of peer ``p`` (silent, PeerLost, fencing) spends a crash."""
        if not self.env.peers[p].crashed:
            self.set_peer(p, crashed=True)
            self.env = evolve(self.env, crashes_left=self.env.crashes_left - 1)
            self.notes.append(f"{peer_name(p)} crashes")

    def send(self, msg: Msg) -> None:
        self.env = evolve(self.env, msgs=(*self.env.msgs, msg))

    def take_msg(self, i: int) -> Msg:
        msgs = self.env.msgs
        self.env = evolve(self.env, msgs=msgs[:i] + msgs[i + 1 :])
        return msgs[i]

    def apply(self, ev: Evidence, what: str, *, old: bool = False) -> None:
        try:
            self.ledger.apply(ev)
        except MismatchedEvidence as e:
            if not old:
                raise Broken(
                    "ledger_error", f"honest evidence {what} refused: {type(e).__name__}: {e}"
                ) from e
            self.notes.append(f"ledger refuses {what}: it is about the previous incarnation")
        except StaleEvidence:
            self.notes.append(f"ledger refuses {what}: stale (its request was released)")
        except ContradictoryEvidence as e:
            if not self.policy.believes_the_wire:
                raise Broken(
                    "ledger_error", f"honest evidence {what} refused: {type(e).__name__}: {e}"
                ) from e
            # Only a believed lie can contradict an honest peer.
            self.notes.append(f"ledger refuses {what}: it contradicts a lie it believed")
        except EvidenceError as e:
            raise Broken(
                "ledger_error", f"honest evidence {what} refused: {type(e).__name__}: {e}"
            ) from e
        except KVLifetimeError as e:
            raise Broken("ledger_error", f"apply({what}) raised {type(e).__name__}: {e}") from e

    def apply_lie(self, ev: Evidence, what: str) -> bool:
        """Send a lie to the ledger; return whether it changed anything."""
        assert self._ledger is None  # a lie is the step's only ledger call
        try:
            self.ledger.apply(ev)
        except EvidenceError as e:
            changed = self.ledger.fingerprint() != self.parent.snap.fingerprint()
            self._ledger = None  # a refused lie leaves the ledger as it was: keep the parent's
            if changed:
                raise Broken(
                    "provenance", f"the lie ({what}) was refused ({e.kind}) yet changed the ledger"
                ) from e
            if not (isinstance(e, UnauthorizedEvidence) or self.policy.believes_the_wire):
                raise Broken(
                    "provenance",
                    f"the lie ({what}) refused as {type(e).__name__}, not as unauthorized: {e}",
                ) from e
            self.notes.append(f"ledger refuses it: {type(e).__name__}: {' '.join(str(e).split())}")
            return False
        except KVLifetimeError as e:
            raise Broken("ledger_error", f"apply({what}) raised {type(e).__name__}: {e}") from e
        if not self.policy.believes_the_wire:
            raise Broken("provenance", f"the ledger accepted a lie: {what} (stamped {ev.source})")
        if self.env.faults_left > 0:
            self.env = evolve(self.env, faults_left=self.env.faults_left - 1)
        self.notes.append("the ledger believes it")
        return True

    def snap_view(self) -> Snap:
        """The ledger for queries, as a ``Snap`` (a fresh one for a copy made in this step)."""
        return self.parent.snap if self._ledger is None else Snap(self._ledger)

    def release_as(self, ri: int, ids: Any, how: str) -> None:
        self.set_req(ri, phase=owner_step(self.env.reqs[ri].phase, "handed_back"))
        self.notes.append(
            f"{how} {self.env.reqs[ri].key}: blocks {list(map(int, ids))} to the pool"
        )


def msg_text(env: Env, m: Msg) -> str:
    g = env.grants[m.grant]
    name = f"grant #{g.grant.id.serial}"
    if m.kind == "Cancel":
        return f"Cancel({name}) to {peer_name(m.peer)}"
    if m.kind in ("SchedulingStopped", "TransferCompleted"):
        return f"{m.kind}({name}, last_seq={m.value}) from {peer_name(m.peer)}"
    if m.kind == "TransferQuiesced":
        return f"{m.kind}({name}, through_seq={m.value}) from {peer_name(m.peer)}"
    return f"{m.kind}({name}) from {peer_name(m.peer)}"
