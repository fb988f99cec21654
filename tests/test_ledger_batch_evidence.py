"""The per-step batch calls for evidence and ends against the single calls they stand for.

``apply_many`` is ``apply`` of each piece in order and ``finish_many`` is ``finish`` of each
request in order, each item applied or refused on its own (not all or nothing). Neither may be
a second copy of the rules: here random histories, with adversarial evidence mixed in (stale,
forged, contradictory, unauthorized, not evidence at all), go through the batch call on one
ledger and through the single calls on a copy, and the two must agree on everything: the
ledger's whole observable state, the refused-evidence counters, the transitions fired, which
items were refused with which typed error, and the log events.
"""

from __future__ import annotations

from typing import Any

import attrs
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvlifetime import errors
from kvlifetime.errors import EvidenceError, KVLifetimeError, UsageError
from kvlifetime.evidence import Evidence, TransferCompleted, about
from kvlifetime.grant import Access, Grant, RequestKey
from kvlifetime.ledger import COUNTS, BatchOutcome, BlockLedger, Counts, Transition
from kvlifetime.source import Source
from kvlifetime.testing import adversarial_evidence, captured_logs

N = 6
KEYS: list[RequestKey] = ["a", "b", "c", 1, 2]
ids_st = st.lists(st.integers(0, N - 1), min_size=1, max_size=3, unique=True)


def _state(led: BlockLedger) -> tuple[Any, ...]:
    """The whole state: ``fingerprint()``, the refusal counters, and the per-block open-grant
    counters (``apply_many`` takes closed grants off them in one write at its end)."""
    inside = led.inspect()
    counters = (
        inside.tracking,
        inside.unsettled.tolist(),
        inside.readers.tolist(),
        inside.open_writes,
        inside.open_reads,
    )
    stats = led.stats()
    return led.fingerprint(), stats.refused_evidence, stats.requests_by_state, counters


def _history_step(led: BlockLedger, grants: list[Grant], draw: Any) -> None:
    """One step of a history: an acquire, a grant, an end, some evidence, a release."""
    live = led.live_requests()
    key = draw(st.sampled_from(sorted(live, key=repr) if live else KEYS))
    op = draw(st.sampled_from(["acquire", "grant", "grant", "finish", "reject", "ev", "release"]))
    try:
        if op == "acquire" or not live:
            led.acquire(draw(st.sampled_from(KEYS)), draw(ids_st), shared=draw(st.booleans()))
        elif op == "grant":
            held = led.blocks_of(key).tolist()
            if held:
                part = draw(st.lists(st.sampled_from(held), min_size=1, unique=True))
                peer = draw(st.sampled_from(["p", "q"]))
                grants.append(led.grant(key, peer, part, draw(st.sampled_from(list(Access)))))
        elif op == "finish":
            led.finish(key)
        elif op == "reject":
            led.reject(key)
        elif op == "ev" and grants:
            led.apply(draw(adversarial_evidence(grants, max_size=2)).pop(0))
        elif op == "release":
            led.release(key)
    except (KVLifetimeError, IndexError):
        pass


def _history(led: BlockLedger, draw: Any) -> list[Grant]:
    """A random history; returns every grant it issued (those of released requests included:
    evidence about them is stale)."""
    grants: list[Grant] = []
    for _ in range(draw(st.integers(2, 12))):
        _history_step(led, grants, draw)
    return grants


def _unauthorized(ev: Evidence) -> Evidence:
    # The same claim from a peer's connection: AccessRevoked may never come from the wire,
    # and a peer may not speak for another peer's grant.
    return attrs.evolve(ev, source=Source.peer("q"))


def _evidence_batch(draw: Any, grants: list[Grant]) -> list[Any]:
    if not grants:
        return [draw(st.sampled_from(["not evidence", None, 3]))]
    batch: list[Any] = draw(adversarial_evidence(grants, max_size=10))
    extra = draw(
        st.lists(
            st.one_of(
                st.builds(
                    lambda g, k, n: _unauthorized(about(g, k, n)),
                    st.sampled_from(grants),
                    st.sampled_from(["AccessRevoked", "TransferCompleted", "CancelReceived"]),
                    st.integers(0, 3),
                ),
                st.sampled_from(["not evidence", None, 3]),
            ),
            max_size=3,
        )
    )
    for item in extra:
        batch.insert(draw(st.integers(0, len(batch))), item)
    return batch


def _singles(fn: Any, items: list[Any], caught: type[KVLifetimeError]) -> tuple[Any, ...]:
    """The single call on each item in order: every transition fired, and (position, error
    class, message) of each refusal."""
    fired: list[Transition] = []
    refused: list[tuple[int, type[BaseException], str]] = []
    for i, item in enumerate(items):
        try:
            fired += fn(item)
        except caught as e:
            refused.append((i, type(e), str(e)))
    return tuple(fired), tuple(refused)


def _as_data(out: BatchOutcome) -> tuple[Any, ...]:
    return out.transitions, tuple((r.position, type(r.error), str(r.error)) for r in out.refused)


def _compare(
    led: BlockLedger, batch_call: Any, single_call: Any, items: list[Any], caught: Any
) -> BatchOutcome:
    ref = led.copy()
    with captured_logs() as ref_logs:
        expected = _singles(getattr(ref, single_call), items, caught)
    with captured_logs() as logs:
        out = getattr(led, batch_call)(items)
    assert isinstance(out, BatchOutcome)
    assert _as_data(out) == expected
    assert out.ok == (not expected[1])
    assert _state(led) == _state(ref)
    for r in out.refused:
        assert r.item is items[r.position]
    if single_call == "apply":
        # The same events, refusals included, in the same order.
        assert logs == ref_logs
    else:
        # finish / reject raise (the caller logs); the batch returns the refusal and logs it.
        refusal = f"{single_call}_refused"
        assert [e for e in logs if e["event"] != refusal] == ref_logs
        assert [e["error"] for e in logs if e["event"] == refusal] == [
            r.error.kind for r in out.refused
        ]
    return out


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(counts=st.sampled_from(COUNTS), data=st.data())
def test_apply_many_is_apply_of_each_piece_in_order(counts: Counts, data: Any) -> None:
    led = BlockLedger(N, counts=counts)
    grants = _history(led, data.draw)
    for _ in range(data.draw(st.integers(1, 3))):
        _compare(led, "apply_many", "apply", _evidence_batch(data.draw, grants), EvidenceError)
        _history_step(led, grants, data.draw)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(counts=st.sampled_from(COUNTS), end=st.sampled_from(["finish", "reject"]), data=st.data())
def test_finish_many_and_reject_many_are_each_end_in_order(
    counts: Counts, end: str, data: Any
) -> None:
    led = BlockLedger(N, counts=counts)
    grants = _history(led, data.draw)
    for _ in range(data.draw(st.integers(1, 3))):
        # Live, released, never admitted and invalid keys, repeats allowed.
        key = st.sampled_from([*KEYS, "gone", "", True, 1.5, None])
        items = data.draw(st.lists(key, max_size=6))
        _compare(led, f"{end}_many", end, items, UsageError)
        _history_step(led, grants, data.draw)


def test_one_bad_piece_does_not_stop_the_others() -> None:
    led = BlockLedger(8)
    led.acquire("a", [0, 1])
    led.acquire("b", [2])
    ga = led.grant("a", "p", [0, 1])
    gb = led.grant("b", "p", [2])
    led.finish("a")
    led.finish("b")
    forged = TransferCompleted(ga.id, "b", "p", 0)  # names the wrong request
    batch: list[Any] = [TransferCompleted.of(ga, 1), forged, "junk", TransferCompleted.of(gb, 2)]
    out = led.apply_many(batch)
    assert [(t.request, t.target, t.cause) for t in out.transitions] == [
        ("a", "transfer_quiesced", "TransferCompleted"),
        ("b", "transfer_quiesced", "TransferCompleted"),
    ]
    assert [(r.position, type(r.error)) for r in out.refused] == [
        (1, errors.MismatchedEvidence),
        (2, errors.MalformedEvidence),
    ]
    assert not out.ok
    assert led.stats().refused_evidence == {"mismatched_evidence": 1, "malformed_evidence": 1}
    # Contradictory with what was applied earlier in the same batch: refused, as apply would.
    out = led.apply_many([TransferCompleted.of(gb, 2), TransferCompleted.of(gb, 3)])
    assert out.transitions == ()
    assert [type(r.error) for r in out.refused] == [errors.ContradictoryEvidence]
    assert sorted(led.collect_releasable()) == ["a", "b"]
    # Evidence about released requests is stale.
    out = led.apply_many((TransferCompleted.of(ga, 1),))
    assert [type(r.error) for r in out.refused] == [errors.StaleEvidence]


def test_finish_many_ends_each_request_on_its_own() -> None:
    led = BlockLedger(8)
    led.acquire("a", [0])
    led.acquire("b", [1])
    g = led.grant("b", "p", [1])
    led.acquire("c", [2])
    led.finish("c")
    out = led.finish_many(["a", "nobody", "b", "c", "a", ""])
    assert [(t.request, t.event) for t in out.transitions] == [
        ("a", "finished"),
        ("a", "transfer_quiesced"),  # no grant: quiesced inside the call
        ("b", "finished"),  # its grant is open
    ]
    assert [(r.position, r.item, type(r.error)) for r in out.refused] == [
        (1, "nobody", errors.UnknownRequest),
        (3, "c", errors.IllegalTransition),
        (4, "a", errors.IllegalTransition),
        (5, "", errors.InvalidField),
    ]
    led.apply(TransferCompleted.of(g, 0))
    assert sorted(led.collect_releasable()) == ["a", "b", "c"]
    assert [type(r.error) for r in led.finish_many(["a"]).refused] == [errors.DoubleRelease]
    assert led.finish_many([]) == BatchOutcome((), ())


@pytest.mark.parametrize("call", ["apply_many", "finish_many", "reject_many"])
@pytest.mark.parametrize("bad", [None, "a", b"ab", {"a": 1}, 3, iter(["a"]), {"a"}])
def test_a_batch_that_is_not_a_sequence_is_refused_whole(call: str, bad: Any) -> None:
    led = BlockLedger(4)
    led.acquire("a", [0])
    before = _state(led)
    with pytest.raises(errors.InvalidField):
        getattr(led, call)(bad)
    assert _state(led) == before


@pytest.mark.parametrize("reason", [None, 3, b"x"])
def test_reject_many_with_a_bad_reason_is_refused_whole(reason: Any) -> None:
    led = BlockLedger(4)
    led.acquire("a", [0])
    before = _state(led)
    with pytest.raises(errors.InvalidField):
        led.reject_many(["a"], reason=reason)
    assert _state(led) == before


@pytest.mark.parametrize("counts", COUNTS)
def test_grants_closed_in_one_batch_are_each_taken_off_the_block_counters(
    counts: Counts,
) -> None:
    """Several grants over one block closed by one apply_many: the block is counted once per
    grant, and each is taken off, as apply would one by one."""
    led = BlockLedger(4, counts=counts)
    led.acquire("a", [0, 1])
    led.acquire("b", [0], shared=True)
    grants = [
        led.grant("a", "p", [0, 1], Access.READ),
        led.grant("b", "q", [0], Access.READ),
        led.grant("a", "q", [0], Access.READ),
    ]
    assert led.open_access([0, 1, 2]).tolist() == [1, 1, 0]
    one_by_one = led.copy()
    for g in grants:
        one_by_one.apply(TransferCompleted.of(g, 0))
    assert led.apply_many([TransferCompleted.of(g, 0) for g in grants]).ok
    assert _state(led) == _state(one_by_one)
    assert led.open_access([0, 1, 2]).tolist() == [0, 0, 0]
    # Settled and uncovered again: a's write grant on both blocks is allowed where b lets go.
    led.finish("b")
    led.release("b")
    led.grant("a", "p", [0, 1], Access.WRITE)
    assert led.open_access([0, 1]).tolist() == [2, 2]
