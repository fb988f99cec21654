"""The lock-step loop of one harness run, the same for both directions.

The owner (this process) and one incarnation of the peer (other processes, one per rank) take
turns: each tick the owner does its work and sends each rank its frames ending with
``Tick(n)``; each rank does its tick and answers up to ``TickDone(n)``. One seed decides every
fault and every landing order, so two runs with one seed give the same figures on the
in-process engine.

Around that: a peer that crashes (or hangs) is reaped, its requests are lost, and a new
incarnation starts (fenced first under the proof policy); the proof policy fences on
quarantine pressure and once only quarantine is left; the push owner may restart mid-run; a run
stops when the pool is exhausted (nothing admitted for ``drain_ticks``). Then the figures are
read into one ``RunResult``.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable, Mapping
from typing import Any

import attrs

from kvlifetime.adapters.engines import open_memory, require_engine
from kvlifetime.adapters.inproc import InprocTarget
from kvlifetime.adapters.transfer import TargetMemory
from kvlifetime.harness.faults import restart_tick
from kvlifetime.harness.owner import Owner, leaked_blocks
from kvlifetime.harness.peer import PeerFailed, PeerGroup, fence_peer
from kvlifetime.harness.result import RunResult
from kvlifetime.harness.settings import PullSettings, PushSettings, RunSettings
from kvlifetime.ledger import BlockLedger
from kvlifetime.spec.vocabulary import BlockState

StartPeer = Callable[..., PeerGroup]


@attrs.frozen(slots=True)
class _Direction:
    """What the loop needs to know about one direction."""

    owner: Callable[[Any, TargetMemory, BlockLedger], Owner]
    start: StartPeer  # (ctx, settings, memory, incarnation, *, crashed, start) -> PeerGroup
    role: str  # the peer's, in the event lines: "prefill" / "decode"
    failed: type[PeerFailed]  # what a peer that cannot be kept running raises
    memory_name: str | None = None  # the owner's NIXL agent name (None: the default)


def _direction(settings: RunSettings) -> _Direction:
    if isinstance(settings, PushSettings):
        from kvlifetime.harness.push_initiator import start_prefill
        from kvlifetime.harness.push_owner import DecodeWorker

        return _Direction(DecodeWorker, start_prefill, "prefill", PeerFailed)
    if isinstance(settings, PullSettings):
        from kvlifetime.harness.pull_initiator import ReaderFailed, start_reader
        from kvlifetime.harness.pull_owner import SourceOwner

        # On NIXL prefill's agent serves the READs (over TCP its UCX progress thread sends the
        # bytes) and its fence replaces that agent, as decode's does in the push direction.
        return _Direction(
            SourceOwner, start_reader, "decode", ReaderFailed, "kvlifetime-prefill-source"
        )
    raise TypeError(f"settings of no direction: {type(settings).__name__}")


def run(
    settings: RunSettings,
    progress: Callable[[str], None] | None = None,
    *,
    on_tick: Callable[[int], None] | None = None,
) -> RunResult:
    """One run (``PushSettings`` or ``PullSettings``); ``progress`` takes its event lines,
    ``on_tick`` the number of requests admitted so far, every tick. Every process and socket it
    started is gone when it returns. A peer that cannot be started, or keeps crashing, raises
    ``PeerFailed`` (``ReaderFailed`` for the pull direction's reader)."""
    d = _direction(settings)
    require_engine(settings.backend, "the harness")
    try:
        return _run(settings, d, progress, on_tick)
    except PeerFailed as e:
        if isinstance(e, d.failed):
            raise
        raise d.failed(str(e)) from e


def _run(
    cfg: RunSettings,
    d: _Direction,
    progress: Callable[[str], None] | None,
    on_tick: Callable[[int], None] | None,
) -> RunResult:
    import zmq

    t0 = time.perf_counter()
    memory = open_memory(cfg.backend, cfg.num_blocks * cfg.block_bytes, name=d.memory_name)
    owner = d.owner(cfg, memory, BlockLedger(cfg.num_blocks))
    restart = cfg.restart_mode
    restart_at = restart_tick(cfg.seed, cfg.expected_ticks) if restart != "none" else None
    ctx = zmq.Context()
    groups: list[PeerGroup] = []
    peer_counters: dict[str, int] = {}
    crashes = 0
    n = 0
    exhausted = False
    inproc = memory if isinstance(memory, InprocTarget) else None

    def say(line: str) -> None:
        if progress is not None:
            progress(line)

    def start(incarnation: int) -> PeerGroup:
        group = d.start(ctx, cfg, memory, incarnation, crashed=crashes, start=n)
        groups.append(group)
        return group

    def fence_and_replace(old: PeerGroup, why: str) -> PeerGroup:
        owner.quarantined_blocks()  # the peak includes what this fence is about to reclaim
        for rank in old.ranks:
            fence = fence_peer(rank, memory)
            if inproc is not None and rank.region is not None:
                # The target's half: what the reaped rank had handed over and this side not
                # yet applied is discarded (land_after_crash), before the grants are revoked.
                inproc.cut(rank.region)
            owner.fenced(rank.peer, fence)
            say(f"tick {n}: fenced {rank.peer} ({why}; {fence})")
        say(f"tick {n}: starting {d.role} incarnation {old.incarnation + 1}")
        return start(old.incarnation + 1)

    try:
        peer = start(0)
        t0 = time.perf_counter()  # the run, not the process start-up
        last_admit = 0
        while True:
            admitting = owner.next_request < cfg.requests
            if on_tick is not None:  # requests admitted so far: a progress bar's count
                on_tick(owner.next_request)
            if admitting:
                last_admit = n
            quiet = not admitting and owner.idle()
            if n == restart_at:
                say(f"tick {n}: the owner restarts ({restart})")
                owner.restart(restart, peer.peers)
                if restart == "guarded":
                    peer = fence_and_replace(peer, "owner restart")
            elif owner.wants_fence(n, quiet=quiet):
                peer = fence_and_replace(peer, "quarantine")
                continue
            elif quiet or n - last_admit > cfg.drain_ticks:
                break
            elif admitting and n - owner.last_admitted > cfg.drain_ticks:
                # Nothing admitted for this long: the pool is exhausted (what quarantine
                # without fences does to a long run). Stop and say so.
                say(f"tick {n}: the pool is exhausted, no admission since {owner.last_admitted}")
                exhausted = True
                break
            answers = peer.tick(n, owner.tick_ranks(n, peer.peers, admitting), cfg.tick_timeout_s)
            if inproc is not None:
                inproc.advance(n)  # a dead initiator's slices due now land with this tick's
            if answers is None:
                crashes += 1
                if inproc is not None:
                    for rank in peer.ranks:  # reaped: what they handed over is the target's
                        if rank.region is not None:
                            inproc.take_over(rank.region, n)
                for name in peer.peers:
                    owner.peer_crashed(name)
                if crashes > cfg.max_restarts:
                    raise d.failed(f"{d.role} crashed {crashes} times; giving up")
                if cfg.policy == "proof" and cfg.fence:
                    peer = fence_and_replace(peer, "crashed")
                else:
                    say(f"tick {n}: {d.role} {peer.incarnation} crashed; starting another")
                    peer = start(peer.incarnation + 1)
            else:
                for sender, frames in answers:
                    owner.receive(frames, sender)
            n += 1
        for k, v in peer.stop().items():
            peer_counters[k] = peer_counters.get(k, 0) + v
        if inproc is not None:
            # what a dead initiator handed over lands even after the run: count it too
            while inproc.pending_after_death():
                inproc.advance(n)
                n += 1
        owner.observe()  # the last landings, before the memory goes
    finally:
        for g in groups:
            g.close()
        # destroy, not term: a socket whose peer never got into ``groups`` (a Ctrl-C while
        # it started) is closed too, where term() would wait for it for ever.
        ctx.destroy(linger=0)
        wall = time.perf_counter() - t0
        memory.close()
    return _result(cfg, owner, _Outcome(crashes, n, wall, exhausted, peer_counters, inproc))


@attrs.frozen(slots=True)
class _Outcome:
    """What the loop itself saw, beside the owner's counts."""

    crashes: int
    ticks: int
    wall: float
    exhausted: bool
    peer_counters: Mapping[str, int]
    inproc: InprocTarget | None


def _result(cfg: RunSettings, owner: Owner, out: _Outcome) -> RunResult:
    st = owner.ledger.stats()
    refused: collections.Counter[str] = collections.Counter(st.refused_evidence)
    reclaimed: collections.Counter[str] = collections.Counter(st.reclaimed_blocks)
    unsafe = st.unsafe_releases
    for old in owner.retired:  # ledgers replaced by an owner restart
        refused.update(old.refused_evidence)
        reclaimed.update(old.reclaimed_blocks)
        unsafe += old.unsafe_releases
    c = owner.count
    wall = out.wall
    pull = cfg.direction == "pull"
    topology: dict[str, int] = {}
    if isinstance(cfg, PushSettings):
        inproc = out.inproc
        topology = {
            "tp_ranks": cfg.faults.tp_ranks,
            "land_after_crash": int(cfg.faults.land_after_crash),
            "redeliver_permille": round(cfg.faults.p_redeliver * 1000),
            "landed_after_death": 0 if inproc is None else inproc.landed_after_death,
            "cut_by_fence": 0 if inproc is None else inproc.cut_by_fence,
        }
    return RunResult(
        backend=cfg.backend,
        policy=cfg.policy,
        seed=cfg.seed,
        requests=owner.next_request,
        completed=c.completed,
        aborted=c.aborted,
        rejected=c.rejected,
        transfer_failed=c.transfer_failed,
        lost_to_crash=c.lost_to_crash,
        ended_mid_transfer=c.ended_mid_transfer,
        contaminated_blocks=c.contaminated_blocks,
        contaminated_requests=c.contaminated_requests,
        leaked_blocks=leaked_blocks(owner.ledger),
        quarantined_blocks=st.blocks_by_state.get(BlockState.QUARANTINED.label, 0),
        quarantined_requests=len(st.quarantined),
        unsafe_releases=unsafe,
        refused_evidence=dict(refused),
        malformed_refused=c.malformed_refused + out.peer_counters.get("malformed_refused", 0),
        peer_crashes=out.crashes,
        queries=c.queries,
        ticks=out.ticks,
        wall_s=round(wall, 3),
        requests_per_s=round(owner.next_request / wall, 1) if wall > 0 else 0.0,
        kv_bytes=c.kv_bytes,
        gb_per_s=round(c.kv_bytes / wall / 1e9, 4) if wall > 0 else 0.0,
        mean_hold_ticks=round(c.hold_ticks / max(1, c.released_requests), 3),
        peak_blocks_out=c.peak_blocks_out,
        num_blocks=cfg.num_blocks,
        block_bytes=cfg.block_bytes,
        peer_counters=dict(out.peer_counters),
        restart=cfg.restart_mode,
        fences=dict(owner.fences),
        reclaimed_blocks=dict(reclaimed),
        peak_quarantined_blocks=c.peak_quarantined_blocks,
        admission_stalls=c.admission_stalls,
        pool_exhausted=out.exhausted,
        unauthorized_refused=c.unauthorized_refused,
        lost_to_fence=c.lost_to_fence,
        lost_to_restart=c.lost_to_restart,
        released_by_late_proof=c.released_by_late_proof,
        prefix_hits=c.prefix_hits,
        oracle=owner.oracle_figures(),
        direction=cfg.direction,
        stale_reads=c.contaminated_blocks if pull else 0,
        stale_read_blocks=owner.stale_read_blocks,
        topology=topology,
        series=owner.series.columns(),
        engine_refusals=dict(owner.refusals.counts),
        refused_hand_backs=c.refused_hand_backs,
    )
