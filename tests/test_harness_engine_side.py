"""The harness owners step the engine-side table (``EngineSideLifecycle``, docs/engine.md), one
``kvlifetime.guard.Holds`` per owner, as every guard in an engine does.

Under the proof policy every hand-back is a row of the table: nothing is refused. Under a policy
that frees without proof (naive, timeout) the owner does not force the table: the hand-back it
refuses is recorded, and their number is the ledger's own count of unsafe releases (two
independent counts of one thing: the table's view of what is still exposed, and the ledger's).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import attrs
import pytest
from harness_helpers import QUIET
from structlog.testing import capture_logs

from kvlifetime.adapters.inproc import InprocTarget
from kvlifetime.evidence import TransferCompleted
from kvlifetime.guard import Refusal
from kvlifetime.harness import pull_owner, push_owner
from kvlifetime.harness.loop import run
from kvlifetime.harness.owner import Ending, Owner
from kvlifetime.harness.result import RunResult
from kvlifetime.harness.settings import PullSettings, PushSettings, RunSettings
from kvlifetime.ledger import BlockLedger
from kvlifetime.spec.table import engine_table
from kvlifetime.spec.vocabulary import RequestState

N = 400
SEED = 11
ROWS = frozenset((r.source, r.event, r.target) for r in engine_table().rows)


@attrs.define
class Seen:
    """What one owner's table did over a run: every row fired, every refusal, the owner."""

    owner: Owner
    fired: list[tuple[str, str, str]] = attrs.field(factory=list)
    refused: list[Refusal] = attrs.field(factory=list)


@pytest.fixture(name="watch")
def watch_fixture(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[Seen]]:
    """Every owner a run creates, with an observer on its holds and its refusals."""
    made: list[Seen] = []

    def watched(base: Any) -> Any:
        class Watched(base):  # type: ignore[misc]
            def __init__(self, *args: Any, **kwargs: Any) -> None:
                super().__init__(*args, **kwargs)
                seen = Seen(self)
                self.holds.observers.append(lambda _r, a, e, b: seen.fired.append((a, e, b)))
                add: Callable[[Refusal], Refusal] = self.refusals.add

                def refuse(refusal: Refusal) -> Refusal:
                    seen.refused.append(refusal)
                    return add(refusal)

                monkeypatch.setattr(self.refusals, "add", refuse)
                made.append(seen)

        return Watched

    monkeypatch.setattr(push_owner, "DecodeWorker", watched(push_owner.DecodeWorker))
    monkeypatch.setattr(pull_owner, "SourceOwner", watched(pull_owner.SourceOwner))
    yield made


def _run(watch: list[Seen], settings: RunSettings) -> tuple[RunResult, Seen]:
    r = run(settings)
    assert len(watch) == 1
    return r, watch[0]


def _settings(direction: str, policy: str, **kw: Any) -> RunSettings:
    cls = PushSettings if direction == "push" else PullSettings
    return cls(policy=policy, requests=N, seed=SEED, **kw)


@pytest.mark.parametrize("direction", ["push", "pull"])
def test_a_proof_run_fires_only_rows_of_the_table_and_refuses_nothing(
    watch: list[Seen], direction: str
) -> None:
    r, seen = _run(watch, _settings(direction, "proof"))
    assert r.requests == N and r.contaminated_blocks == 0 and r.leaked_blocks == 0
    assert set(seen.fired) <= ROWS, set(seen.fired) - ROWS
    assert seen.refused == [] and seen.owner.refusals.counts == {}
    assert r.engine_refusals == {} and r.refused_hand_backs == 0 == r.unsafe_releases
    # Every request went the whole way through the table: admitted, handed back, gone.
    fired = {(a, e) for a, e, _ in seen.fired}
    assert ("releasable", "handed_back") in fired and ("ended", "handed_back") in fired
    assert len(seen.owner.holds) == 0
    # The faults took the interesting ways: quarantine (a crash), and its way out.
    assert ("quarantined", "released") in fired
    if direction == "push":
        assert {("loading", "aborted"), ("loading", "lease_expired")} <= fired
    else:
        assert {("withheld", "reads_done"), ("reading", "fenced")} <= fired


def test_without_fences_the_tables_quarantine_is_the_ledgers(watch: list[Seen]) -> None:
    r, seen = _run(watch, _settings("push", "proof", fence=False))
    assert seen.owner.refusals.counts == {} and set(seen.fired) <= ROWS
    w = seen.owner
    assert isinstance(w, push_owner.DecodeWorker)
    held = {k for k, q in w.reqs.items() if q.state == "quarantined"}
    assert held and held == {k for k in w.reqs if w.ledger.state(k) is RequestState.QUARANTINED}
    assert r.quarantined_requests == len(held)


@pytest.mark.parametrize(
    ("direction", "policy"), [("push", "naive"), ("pull", "naive"), ("push", "timeout")]
)
def test_frees_without_proof_are_the_hand_backs_the_table_refuses(
    watch: list[Seen], direction: str, policy: str
) -> None:
    r, seen = _run(watch, _settings(direction, policy))
    assert set(seen.fired) <= ROWS  # what fired is still a row: the table was never forced
    handed = [x for x in seen.refused if x.event == "handed_back"]
    assert all(x.state in ("withheld", "quarantined") for x in handed)
    # The cross-check: the table's refusals against the ledger's own count of unsafe releases.
    assert r.unsafe_releases > 0
    assert len(handed) == r.refused_hand_backs == r.unsafe_releases
    assert seen.refused == handed  # nothing else was refused
    assert r.engine_refusals == {"out_of_order": r.unsafe_releases}
    assert "refused hand-backs" in r.to_text()
    assert RunResult.from_dict(r.to_dict()) == r


# --------------------------------------------------------------------------- sans-IO

BB = 512
NBLOCKS = 64
PEER = "prefill-0"


@pytest.fixture(name="decode")
def decode_fixture(request: pytest.FixtureRequest) -> Iterator[push_owner.DecodeWorker]:
    cfg = PushSettings(
        policy=request.param,
        requests=2,
        arrivals_per_tick=2,
        block_bytes=BB,
        num_blocks=NBLOCKS,
        faults=QUIET,
    )
    target = InprocTarget(NBLOCKS * BB)
    try:
        yield push_owner.DecodeWorker(cfg, target, BlockLedger(NBLOCKS))
    finally:
        target.close()


@pytest.mark.parametrize("decode", ["naive"], indirect=True)
def test_a_naive_abort_mid_load_is_freed_and_its_hand_back_refused(
    decode: push_owner.DecodeWorker,
) -> None:
    w = decode
    w.tick(0, PEER, True)
    done, gone = sorted(w.reqs)
    assert [w.reqs[k].state for k in (done, gone)] == ["loading", "loading"]
    g = w.reqs[done].grant
    w.receive([_completed(g, 1)], PEER)
    assert w.reqs[done].state == "load_received" and w.reqs[done].consumed
    with capture_logs() as logs:
        w.end(gone, Ending.ABORTED)  # naive: freed at once, a write may still land
        w.tick(1, PEER, False)
    assert gone not in w.reqs and w.ledger.stats().unsafe_releases == 1
    assert w.holds.state(str(gone)) == "withheld"  # the table still holds it exposed
    assert w.count.refused_hand_backs == 1
    assert w.refusals.counts == {"out_of_order": 1}
    # The refusal is data (its log line is the ledger's own warning of the unsafe free).
    assert [e["request"] for e in logs if e["event"] == "force_released"] == [gone]
    assert not [e for e in logs if e["event"] == "guard_refused"]


@pytest.mark.parametrize("decode", ["proof"], indirect=True)
def test_a_proof_abort_waits_withheld_then_is_handed_back_by_the_ledgers_release(
    decode: push_owner.DecodeWorker,
) -> None:
    w = decode
    w.tick(0, PEER, True)
    key = min(w.reqs)
    w.end(key, Ending.ABORTED)
    w.tick(1, PEER, False)
    assert w.reqs[key].state == "withheld"  # no proof yet: it waits
    w.receive([_completed(w.reqs[key].grant, 1)], PEER)
    assert w.reqs[key].state == "withheld" and w.reqs[key].hold.write is None
    w.tick(2, PEER, False)  # the ledger releases it: released, handed back
    assert key not in w.reqs and str(key) not in w.holds
    assert w.refusals.counts == {} and w.count.refused_hand_backs == 0


def _completed(g: Any, last: int) -> bytes:
    from kvlifetime.harness import wire

    return wire.encode(wire.EvidenceMsg(TransferCompleted.of(g, last)))
