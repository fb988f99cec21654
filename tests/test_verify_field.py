"""The field's bug classes as behaviours of the verifier: each naive rule refuted, proof passing.

Each class is a policy (or, where the model already states it, an existing one with an option),
refuted with a pinned shortest counterexample that the explorer replays on a fresh checked
ledger and whose ledger log ``kvlifetime replay`` replays clean; the proof policy passes on the
same shape. See "The field's bug classes" in docs/verification.md.

- vLLM #56104: the first transfer handle to fail frees the blocks while siblings still write;
- vLLM #58222 / #50789: a head-of-line lease reaper strands requests behind one not yet over;
- vLLM #51786 (vllm-ascend #14407): completion notices counted per request, twice or across
  channels;
- vLLM #49796: a client-chosen id reused while the old request's transfer is in flight;
- vLLM #52360: a preemption frees blocks an asynchronous save still reads;
- pre-admission rejection: the prefill frees when the decode rejects: safe only if no address
  left the process (no grant), whatever was posted at the rejection.
"""

from __future__ import annotations

from typing import Any

import attrs
import pytest
from structlog.testing import capture_logs

from kvlifetime.cli import main
from kvlifetime.grant import Access
from kvlifetime.testing import to_jsonl
from kvlifetime.verify import Config, Event, Policy, Result, explore, parse_faults, run_events
from kvlifetime.verify.replay import read_log, replay

NONE: frozenset[Any] = frozenset()


def _refuted(cfg: Config, policy: Policy, invariant: str = "isolation") -> Result:
    r = explore(cfg, policy)
    assert r.violation is not None and r.violation.invariant == invariant, r.to_text()
    _s, _n, again = run_events(cfg, policy, [s.event for s in r.trace], checked=True)
    assert again == r.violation  # the same violation on a fresh checked ledger
    return r


def _replays(cfg: Config, policy: Policy, events: list[Event]) -> list[dict[str, Any]]:
    """The real ledger's log of ``events``, replayed by ``kvlifetime replay``: it must be a
    legal history (the ledger did what it was asked; the engine's release was the mistake)."""
    with capture_logs() as logs:
        run_events(cfg, policy, events, checked=True)
    out = [dict(e) for e in logs]
    rep = replay(read_log(to_jsonl(out).splitlines()))
    assert rep.ok and rep.mode == "full", rep.to_text()
    return out


def _kinds(r: Result) -> list[str]:
    return [s.event.kind for s in r.trace]


def _unsafe(logs: list[dict[str, Any]]) -> list[str]:
    return [e["reason"] for e in logs if e["event"] == "force_released"]


# ------------------------------------------------------------------ vLLM #56104


SIBLINGS = Config(1, 1, 1, faults=parse_faults("fail"), ranks=2)


def test_first_failure_frees_what_a_sibling_handle_still_writes_56104() -> None:
    r = _refuted(Config(1, 1, 1, faults=parse_faults("fail")), Policy.FIRST_FAILURE)
    # Shortest: the FAILED transfer itself still lands (a failed batch may keep writing).
    assert _kinds(r) == ["admit", "grant", "post", "fail", "land"]
    assert "first-failure (one transfer FAILED) releases r1" in " ".join(r.trace[3].notes)
    # The sibling of #56104: two handles (ranks), the first fails, the other lands.
    sib = [
        Event("admit"),
        Event("grant", 0, 0),
        Event("grant", 0, 0),
        Event("post", 0),
        Event("post", 1),
        Event("fail", 0, 0),
        Event("land", 1, 0),
    ]
    _s, _notes, v = run_events(SIBLINGS, Policy.FIRST_FAILURE, sib)
    assert v is not None and v.invariant == "isolation" and "grant #2" in v.message
    logs = _replays(SIBLINGS, Policy.FIRST_FAILURE, sib[:-1])
    assert _unsafe(logs) == ["first-failure: a transfer failed"]
    assert explore(SIBLINGS, Policy.PROOF).verdict == "pass"


# ------------------------------------------------------------------ vLLM #58222 / #50789


def test_a_head_of_line_reaper_strands_a_request_behind_one_not_yet_over_58222() -> None:
    cfg = Config(2, 1, 2, faults=NONE)
    r = _refuted(cfg, Policy.ORDERED_REAPER, "progress")
    assert _kinds(r) == ["admit", "admit", "grant", "finish", "finish"]
    assert "r2 has every grant closed" in r.violation.message  # type: ignore[union-attr]
    assert "the ordered reaper stops at r1" in " ".join(r.trace[-1].notes)
    _replays(cfg, Policy.ORDERED_REAPER, [s.event for s in r.trace])
    assert explore(cfg, Policy.PROOF).verdict == "pass"  # collect_releasable: any order


# ------------------------------------------------------------------ vLLM #51786


@pytest.mark.parametrize(
    "cfg",
    [
        Config(1, 2, 1, faults=parse_faults("duplicate")),  # two connectors (channels)
        Config(1, 1, 1, faults=parse_faults("duplicate"), ranks=2),  # two ranks, one peer
    ],
)
def test_completions_counted_per_request_free_what_a_grant_still_writes_51786(
    cfg: Config,
) -> None:
    r = _refuted(cfg, Policy.COUNTED_COMPLETIONS)
    assert len(r.trace) == 9
    assert _kinds(r) == [
        "admit", "grant", "grant", "finish", "post", "complete", "duplicate", "deliver", "land"
    ]  # fmt: skip
    # One grant's completion, delivered twice, counted as the two grants' notices.
    counted = " ".join(r.trace[7].notes)
    assert "2 of 2 grants" in counted and "counted-completions" in counted
    logs = _replays(cfg, Policy.COUNTED_COMPLETIONS, [s.event for s in r.trace][:-1])
    assert _unsafe(logs) == ["counted-completions: 2 notices for 2 grants"]
    assert explore(cfg, Policy.PROOF).verdict == "pass"  # per grant; a duplicate is a no-op


# ------------------------------------------------------------------ vLLM #49796


def test_a_reused_client_id_takes_the_entry_of_a_request_still_written_49796() -> None:
    cfg = Config(2, 1, 1, faults=NONE, reuse_ids=True)
    r = _refuted(cfg, Policy.ID_OVERWRITE)
    assert _kinds(r) == ["admit", "grant", "finish", "reuse", "post", "land"]
    assert r.trace[3].label == "a new request arrives with r1's id"
    logs = _replays(cfg, Policy.ID_OVERWRITE, [s.event for s in r.trace][:-1])
    assert _unsafe(logs) == ["id-overwrite: the id was reused"]
    # Proof: the ledger refuses the duplicate id; the new request is turned away.
    ok = explore(cfg, Policy.PROOF)
    assert ok.verdict == "pass"
    _s, notes, v = run_events(cfg, Policy.PROOF, [s.event for s in r.trace][:4])
    assert v is None and "the new request is turned away" in " ".join(notes[-1])


# ------------------------------------------------------------------ vLLM #52360


def test_a_preemption_frees_blocks_an_async_save_still_reads_52360() -> None:
    # The save is a READ grant of the request's blocks to the store thread; the preemption is
    # the owner ending the request (reject), and the naive engine frees at once.
    cfg = Config(1, 1, 1, faults=NONE, access=Access.READ)
    r = _refuted(cfg, Policy.NAIVE)
    assert _kinds(r) == ["admit", "grant", "reject", "deliver", "deliver", "post", "land"]
    assert "read for r1" in r.violation.message  # type: ignore[union-attr]
    logs = _replays(cfg, Policy.NAIVE, [s.event for s in r.trace][:-1])
    assert _unsafe(logs) == ["naive: rejected"]
    assert explore(cfg, Policy.PROOF).verdict == "pass"


# ------------------------------------------------------------------ pre-admission rejection


def test_freeing_at_a_rejection_is_safe_only_before_any_grant() -> None:
    read = Config(1, 1, 1, faults=NONE, access=Access.READ)
    # Nothing will ever be posted: freeing at the rejection passes.
    assert explore(attrs.evolve(read, transfers_per_grant=0), Policy.NAIVE).verdict == "pass"
    # A rejection before any grant (no address left the process): released at once, by
    # naive and by the ledger alike (closed vacuously, no evidence needed).
    for policy in (Policy.NAIVE, Policy.PROOF):
        state, notes, v = run_events(read, policy, [Event("admit"), Event("reject", 0)])
        assert v is None and state.env.reqs[0].phase == "released", notes
    # Granted but nothing posted yet at the rejection: the peer may still post (a chunk
    # taken off its queue before the cancel), so freeing then is refuted (7 steps above).
    r = _refuted(read, Policy.NAIVE)
    i = _kinds(r).index("reject")
    assert "post" not in _kinds(r)[:i] and "post" in _kinds(r)[i:]


# ------------------------------------------------------------------ command line


def test_cli_names_each_class_policy(capsys: pytest.CaptureFixture[str]) -> None:
    base = ["verify", "--requests", "1", "--peers", "1", "--blocks", "1", "--no-progress"]
    assert main([*base, "--policy", "first-failure", "--faults", "fail"]) == 1
    assert "refuted in 5 steps" in capsys.readouterr().out
    two = ["verify", "--requests", "2", "--peers", "1", "--blocks", "1", "--no-progress"]
    assert main([*two, "--policy", "id-overwrite", "--faults", "none", "--reuse-ids"]) == 1
    out = capsys.readouterr().out
    assert "reused request ids" in out and "refuted in 6 steps" in out
    assert main([*two, "--policy", "proof", "--faults", "none", "--reuse-ids"]) == 0
