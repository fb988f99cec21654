"""The pull direction (vLLM's NIXL path) end to end on the in-process engine (and on Mooncake and
NIXL, at the end): prefill owns the source blocks, a real decode process READs them, real
sockets."""

from __future__ import annotations

import json
import multiprocessing

import attrs
import msgpack
import pytest
from harness_helpers import QUIET as NO_FAULT
from harness_helpers import child_processes
from mooncake_helpers import need_mooncake
from nixl_helpers import need_nixl

from kvlifetime.adapters.inproc import InprocEngine, InprocTarget
from kvlifetime.adapters.transfer import Status
from kvlifetime.errors import UsageError
from kvlifetime.grant import GrantId
from kvlifetime.harness import wire
from kvlifetime.harness.faults import FaultConfig
from kvlifetime.harness.loop import run
from kvlifetime.harness.pull_initiator import ReaderFailed
from kvlifetime.harness.result import RunResult, compare_markdown
from kvlifetime.harness.settings import PullSettings

SEED = 11
N = 1000
# No fault, but prefixes drawn at the default rate: the pull side ignores them, and the draws
# keep each seed's plans (and so this file's pinned figures) what they were.
QUIET = attrs.evolve(NO_FAULT, p_prefix=FaultConfig().p_prefix)


_cache: dict[tuple[str, int], RunResult] = {}


def report(policy: str, seed: int = SEED) -> RunResult:
    key = (policy, seed)
    if key not in _cache:
        _cache[key] = run(PullSettings(policy=policy, requests=N, seed=seed))
    return _cache[key]


def _views_agree(r: RunResult) -> None:
    # The reader's byte check and prefill's own view of its arena count the same reads.
    o = r.oracle
    assert o["reads"] == o["owner_view_reads"] and r.seen("reads") > 0
    assert o["stale_reads"] == o["owner_view_stale_reads"] == r.stale_reads
    assert o["stale_read_blocks"] == o["owner_view_stale_read_blocks"] == r.stale_read_blocks


def test_proof_policy_has_no_stale_read_and_no_leak() -> None:
    r = report("proof")
    assert r.direction == "pull" and r.requests == N
    assert r.stale_reads == 0 and r.stale_read_blocks == 0 and r.contaminated_blocks == 0
    assert r.leaked_blocks == 0 and r.quarantined_blocks == 0 and r.unsafe_releases == 0
    assert r.peer_crashes == 1  # the reader crashed once: fenced by reaping it
    assert r.fences.get("inproc_initiator_reaped", 0) >= 1
    assert sum(r.reclaimed_blocks.values()) > 0
    _views_agree(r)


def test_lease_policy_reads_blocks_given_to_another_request() -> None:
    r = report("timeout")
    assert r.stale_reads > 0 and r.stale_read_blocks > 0
    assert r.unsafe_releases > 0 and r.leaked_blocks == 0
    _views_agree(r)


def test_naive_policy_reads_blocks_given_to_another_request() -> None:
    r = report("naive")
    assert r.stale_reads > report("timeout").stale_reads > 0
    _views_agree(r)


def test_faults_are_exercised() -> None:
    r = report("proof")
    assert r.aborted > 0 and r.transfer_failed > 0 and r.lost_to_crash > 0
    assert r.ended_mid_transfer > 0 and r.queries > 0
    assert r.released_by_late_proof >= 0 and r.peak_quarantined_blocks > 0
    assert sum(r.refused_evidence.values()) > 0  # duplicates after release: stale, refused


def test_same_seed_same_figures() -> None:
    again = run(PullSettings(policy="timeout", requests=N, seed=SEED))
    assert again.timing_free() == report("timeout").timing_free()


def test_a_planted_stale_read_is_counted_exactly_once() -> None:
    cfg = PullSettings(requests=60, seed=5, faults=QUIET)
    clean = run(cfg)
    assert clean.stale_reads == 0 and clean.seen("reads") > 0
    r = run(PullSettings(requests=60, seed=5, faults=QUIET, plant_stale_read=17))
    assert r.stale_reads == 1 and r.stale_read_blocks == 1 and r.contaminated_requests == 1
    assert r.oracle["reads"] == clean.oracle["reads"]
    _views_agree(r)


def test_no_process_left_behind() -> None:
    run(PullSettings(policy="naive", requests=200, seed=3))
    assert multiprocessing.active_children() == []
    assert child_processes() == []


def test_a_reader_that_keeps_crashing_is_reaped(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvlifetime.harness import peer

    monkeypatch.setattr(peer, "crash_tick", lambda *a: 0)
    with pytest.raises(ReaderFailed):
        run(PullSettings(requests=100, max_restarts=2))
    assert multiprocessing.active_children() == []
    assert child_processes() == []


def test_report_and_table_show_the_reads() -> None:
    text = report("timeout").to_text()
    assert "direction=pull" in text and "stale reads (reader)" in text
    table = compare_markdown([report(p) for p in ("naive", "timeout", "proof")])
    head = table.splitlines()[0]
    assert "| stale reads |" in head and "| stale read blocks |" in head


def test_cli_pull(capsys: pytest.CaptureFixture[str]) -> None:
    from kvlifetime.cli import main

    args = ["simulate", "--direction", "pull", "--policy", "timeout", "--requests", "150"]
    assert main([*args, "--seed", "4", "--json"]) == 0
    d = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert d["direction"] == "pull" and d["policy"] == "timeout" and d["requests"] == 150


def test_one_policy_name_both_ways_and_push_only_knobs() -> None:
    from kvlifetime.harness.simulate import simulate

    # The deadline policy is "timeout" both ways ("lease" was the pull direction's name).
    for direction in ("push", "pull"):
        with pytest.raises(UsageError, match="unknown policy 'lease'"):
            simulate("inproc", "lease", 10, 0, direction=direction)
    with pytest.raises(UsageError):
        simulate("inproc", "proof", 10, 0, direction="pull", restart="naive")
    with pytest.raises(UsageError):
        PullSettings(policy="lease")


# ------------------------------------------------------------------ the engine's READ


def test_inproc_read_semantics_a_failed_batch_still_reads_later() -> None:
    bb = 64
    src = InprocTarget(8 * bb)
    eng = InprocEngine(src.descriptor(), 4 * bb, straggle_ticks=2)
    try:
        src.array[:] = 7
        base = src.descriptor()["base"]
        h = eng.submit_read([(0, base, bb), (bb, base + bb, bb)])
        eng.advance(0)
        assert eng.wait(h, 5) is Status.COMPLETED
        assert (eng.staging[: 2 * bb] == 7).all()
        # One slice outside the source: FAILED at once, the good slice is read later.
        src.array[:] = 9
        h = eng.submit_read([(2 * bb, base, bb), (3 * bb, base + 100 * bb, bb)])
        assert eng.wait(h, 5) is Status.FAILED
        eng.advance(1)
        assert (eng.staging[2 * bb : 3 * bb] == 0).all()
        eng.advance(2)
        assert (eng.staging[2 * bb : 3 * bb] == 9).all()
        assert len(src.landings()) == 0  # a read writes nothing into the source
        # unregister refuses new reads only.
        src.unregister()
        h = eng.submit_read([(0, base, bb)])
        assert eng.wait(h, 5) is Status.FAILED
    finally:
        eng.close()
        src.close()


# ------------------------------------------------------------------ the wire


G = GrantId("inc", 3)


@pytest.mark.parametrize(
    "msg",
    [
        wire.ReadAssign(1, G, "decode-0", (4, 5), (0, 2), (1 << 40, (1 << 40) + 4096)),
        wire.ReadsChecked(1, G, 1, (4, 5), (0, 1)),
        wire.ReaderPending(3, 0),
    ],
    ids=lambda m: m.TYPE,
)
def test_new_messages_round_trip(msg: wire.Message) -> None:
    assert wire.decode(wire.encode(msg)) == msg


@pytest.mark.parametrize(
    "body",
    [
        {
            "t": "reads_checked",
            "request": 1,
            "grant": ["i", 1],
            "seq": 1,
            "blocks": [1],
            "stale": [2],
        },
        {
            "t": "reads_checked",
            "request": 1,
            "grant": ["i", 1],
            "seq": 1,
            "blocks": [1, 2],
            "stale": [0],
        },
        {
            "t": "reads_checked",
            "request": 1,
            "grant": ["i", 1],
            "seq": 0,
            "blocks": [1],
            "stale": [0],
        },
        {
            "t": "reads_checked",
            "request": 1,
            "grant": ["i", 1],
            "seq": 1,
            "blocks": [],
            "stale": [],
        },
        {
            "t": "read_assign",
            "request": 1,
            "grant": ["i", 1],
            "peer": "d",
            "blocks": [1],
            "generations": [],
            "addresses": [1],
        },
        {"t": "reader_pending", "n": 1, "grants": -1},
        {"t": "reader_pending", "n": 1},
    ],
)
def test_new_messages_are_strict(body: dict[str, object]) -> None:
    frame = msgpack.packb({"v": wire.SCHEMA_VERSION, **body})
    with pytest.raises(wire.MalformedMessage):
        wire.decode(frame)


# ------------------------------------------------------------------ Mooncake's batch READ


def test_mooncake_pull_gives_the_in_process_figures() -> None:
    need_mooncake()
    for policy in ("proof", "timeout"):
        cfg = PullSettings(backend="mooncake", policy=policy, requests=300, seed=SEED)
        mc = run(cfg)
        ip = run(PullSettings(policy=policy, requests=300, seed=SEED))
        _views_agree(mc)
        assert mc.stale_reads == ip.stale_reads and mc.seen("reads") == ip.seen("reads")
        assert (mc.stale_reads == 0) == (policy == "proof")
        if policy == "proof":
            assert mc.fences.get("mooncake_target_recreated", 0) >= 1
            assert mc.leaked_blocks == 0 and mc.quarantined_blocks == 0
    assert child_processes() == []


# ------------------------------------------------------------------ NIXL's READ (vLLM's path)


def test_nixl_pull_gives_the_in_process_figures() -> None:
    need_nixl()
    for policy in ("naive", "proof"):
        nx = run(PullSettings(backend="nixl", policy=policy, requests=300, seed=SEED))
        ip = run(PullSettings(policy=policy, requests=300, seed=SEED))
        _views_agree(nx)
        assert nx.stale_reads == ip.stale_reads and nx.seen("reads") == ip.seen("reads")
        assert (nx.stale_reads == 0) == (policy == "proof")
        assert nx.leaked_blocks == 0
        if policy == "proof":
            # The reader crashed once: reaped, and prefill's serving agent replaced.
            assert nx.fences.get("nixl_target_agent_recreated", 0) >= 1
            assert nx.quarantined_blocks == 0 and nx.unsafe_releases == 0
    assert child_processes() == []


def test_cli_pull_on_nixl(capsys: pytest.CaptureFixture[str]) -> None:
    need_nixl()
    from kvlifetime.cli import main

    args = ["simulate", "--direction", "pull", "--backend", "nixl", "--policy", "timeout"]
    assert main([*args, "--requests", "60", "--seed", "4", "--json"]) == 0
    d = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert d["direction"] == "pull" and d["backend"] == "nixl" and d["requests"] == 60
