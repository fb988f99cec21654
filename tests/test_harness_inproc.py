"""The harness end to end on the in-process engine: a real prefill process, real sockets."""

from __future__ import annotations

import multiprocessing
import threading

import pytest
from harness_helpers import child_processes

from kvlifetime.harness.loop import run
from kvlifetime.harness.peer import PeerFailed
from kvlifetime.harness.result import RunResult
from kvlifetime.harness.settings import PushSettings

SEED = 11
N = 1500


_cache: dict[tuple[str, int], RunResult] = {}


def report(policy: str, seed: int = SEED) -> RunResult:
    key = (policy, seed)
    if key not in _cache:
        _cache[key] = run(PushSettings(policy=policy, requests=N, seed=seed))
    return _cache[key]


def test_proof_policy_has_no_contamination_and_no_leak() -> None:
    r = report("proof")
    assert r.requests == N
    assert r.ended_mid_transfer / r.requests >= 0.20
    assert r.contaminated_blocks == 0
    assert r.leaked_blocks == 0
    assert r.unsafe_releases == 0
    assert r.peer_crashes == 1  # the fault model includes one crash
    # Crash victims and FAILED batches were quarantined, then fenced and reclaimed.
    assert r.peak_quarantined_blocks > 0
    assert r.fences.get("inproc_initiator_reaped", 0) >= 1
    assert sum(r.reclaimed_blocks.values()) >= r.peak_quarantined_blocks
    assert r.quarantined_blocks == 0


def test_a_peer_slower_than_its_deadline_is_quarantined_then_released_by_its_late_proof() -> None:
    r = report("proof")
    assert r.released_by_late_proof > 0  # quarantine is not a verdict: proof still ends it
    assert r.contaminated_blocks == 0 and r.seen("late_writes") == 0


def test_proof_policy_without_fences_keeps_its_quarantine() -> None:
    r = run(PushSettings(policy="proof", requests=N, seed=SEED, fence=False))
    assert r.contaminated_blocks == 0 and r.leaked_blocks == 0
    assert r.quarantined_blocks > 0  # out, counted, never freed: the one-way door
    assert r.fences == {} and r.reclaimed_blocks == {}


def test_naive_policy_is_contaminated_under_the_same_seed() -> None:
    r = report("naive")
    assert r.contaminated_blocks > 0
    assert r.unsafe_releases > 0
    assert r.quarantined_blocks == 0


def test_timeout_policy_is_contaminated_when_delays_exceed_the_lease() -> None:
    r = report("timeout")
    assert r.contaminated_blocks > 0
    assert r.leaked_blocks == 0


def test_same_seed_same_figures() -> None:
    first = report("proof").timing_free()
    again = run(PushSettings(policy="proof", requests=N, seed=SEED)).timing_free()
    assert first == again


def test_faults_are_exercised() -> None:
    r = report("proof")
    assert r.aborted > 0 and r.rejected > 0 and r.transfer_failed > 0 and r.lost_to_crash > 0
    assert r.prefix_hits > 0  # prefix-cache sharing: read-only, checked at consume as well
    assert r.malformed_refused > 0 or r.peer_counters.get("link_garbage", 0) >= 0
    assert sum(r.refused_evidence.values()) > 0  # duplicates after release: stale, refused


def test_no_process_left_behind() -> None:
    run(PushSettings(policy="naive", requests=200, seed=3))
    assert multiprocessing.active_children() == []
    assert child_processes() == []


def test_a_peer_that_keeps_crashing_is_reaped(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvlifetime.harness import peer

    # Every incarnation dies at its first tick: the run gives up, and reaps every process.
    monkeypatch.setattr(peer, "crash_tick", lambda *a: 0)
    with pytest.raises(PeerFailed):
        run(PushSettings(requests=100, max_restarts=2))
    assert multiprocessing.active_children() == []
    assert child_processes() == []


@pytest.mark.parametrize("direction", ["push", "pull"])
@pytest.mark.parametrize("where", ["start", "ready"])
def test_ctrl_c_while_a_peer_starts_ends_the_run(
    monkeypatch: pytest.MonkeyPatch, direction: str, where: str
) -> None:
    """A Ctrl-C while a peer process is being started (``where``: in ``Process.start``, or
    while waiting for its first message) ends the run at once: every socket closed (a socket
    left open made the run wait for ever in ``zmq.Context.term``), no process left."""
    import multiprocessing.context

    from kvlifetime.harness import peer as peer_module
    from kvlifetime.harness.loop import run
    from kvlifetime.harness.settings import PullSettings

    if where == "start":
        real_start = multiprocessing.context.SpawnProcess.start

        def start(self: multiprocessing.context.SpawnProcess) -> None:
            real_start(self)  # the child is started, and then the Ctrl-C comes
            raise KeyboardInterrupt

        monkeypatch.setattr(multiprocessing.context.SpawnProcess, "start", start)
    else:

        def until_tick_done(*a: object) -> None:
            raise KeyboardInterrupt

        monkeypatch.setattr(peer_module.PeerProcess, "until_tick_done", until_tick_done)
    outcome: list[BaseException] = []

    def go() -> None:
        try:
            if direction == "push":
                run(PushSettings(requests=50))
            else:
                run(PullSettings(requests=50))
        except BaseException as e:  # the KeyboardInterrupt, as data for the test
            outcome.append(e)

    thread = threading.Thread(target=go, daemon=True)
    thread.start()
    thread.join(60)
    assert not thread.is_alive(), "the interrupted run never returned"
    assert len(outcome) == 1 and isinstance(outcome[0], KeyboardInterrupt), outcome
    assert multiprocessing.active_children() == []
    assert child_processes() == []


def test_simulate_cli_json_is_the_last_line(capsys: pytest.CaptureFixture[str]) -> None:
    import json

    from kvlifetime.cli import main

    assert main(["simulate", "--requests", "200", "--seed", "5", "--json"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    d = json.loads(lines[-1])
    assert d["policy"] == "proof" and d["requests"] == 200 and d["contaminated_blocks"] == 0
