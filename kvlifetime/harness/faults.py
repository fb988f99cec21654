"""Faults, seeded and reproducible.

Everything random in a run comes from the seed: what each request looks like and what happens to
it (``plan``), and what the wire does to each control message (``FaultyLink``). Both workers
compute a request's plan from (seed, request) alone, so decode and prefill agree on it without
talking, and the same seed gives the same run.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import attrs
import numpy as np

from kvlifetime.errors import UsageError, show
from kvlifetime.extras import needs
from kvlifetime.inputs import shallow

with needs("harness", "kvlifetime.harness"):
    import msgpack

from kvlifetime.harness.wire import SCHEMA_VERSION

BLOCKS_PER_CHUNK = 2  # blocks written by one batch (one transfer, one sequence number)


def _knob(name: str, default: object, v: object) -> object:
    """``v`` for the knob ``name`` whose default is ``default``, if it is of the same kind."""
    if isinstance(default, bool):
        ok = type(v) is bool
    elif isinstance(default, int):
        ok = type(v) is int
    elif isinstance(default, float):
        ok = type(v) is int or (isinstance(v, float) and type(v) is float and math.isfinite(v))
    elif isinstance(default, tuple):
        ok = type(v) in (list, tuple) and len(v) == len(default)  # type: ignore[arg-type]
        ok = ok and all(type(x) is int for x in v)  # type: ignore[attr-defined]
        v = tuple(v) if ok else v  # type: ignore[arg-type]
    else:
        ok = False
    if not ok:
        raise UsageError(f"fault knob {name!r} must be like {default!r}, got {show(v)}")
    return v


@attrs.frozen(slots=True)
class FaultConfig:
    """Fault rates. Probabilities are per request, per batch or per control message."""

    p_abort: float = 0.35  # the client aborts, at a random tick in [0, abort_window]
    abort_window: int = 6
    capacity_tokens: int = 3400  # prefill refuses longer prompts (tokens in [64, 4096])
    max_stub_chunks: int = 2  # batches a rejected request still posts before the decision
    p_slow: float = 0.05  # a batch takes slow_ticks (beyond the timeout policy's lease)
    slow_ticks: tuple[int, int] = (10, 30)
    fast_ticks: tuple[int, int] = (0, 3)
    # a batch slower than the proof policy's deadline: its request is quarantined, then its
    # late proof releases it (no fence needed)
    p_late: float = 0.003
    late_ticks: tuple[int, int] = (80, 160)
    # prefix caching: a request shares its first blocks, read-only, with an earlier request
    # still decoding (when decode has one), and prefill writes only the rest
    p_prefix: float = 0.25
    prefix_blocks: tuple[int, int] = (1, 2)
    p_fail: float = 0.004  # a batch gets one slice outside the arena: the engine FAILs it
    straggle_ticks: int = 4  # in-process engine: a FAILED batch's other slices land this late
    p_lose: float = 0.02  # a control message is lost
    p_dup: float = 0.03  # ... delivered twice
    p_delay: float = 0.06  # ... delayed (and so reordered) by 1..max_delay ticks
    max_delay: int = 6
    p_malformed: float = 0.002  # a garbage frame is sent alongside
    crash: bool = True  # the prefill worker crashes mid-run
    crashes: int = 1  # how many times (each incarnation at most once)
    # Topologies (off by default: the figures of runs without them stay what they were).
    # Tensor parallel: each request's blocks are written by this many prefill ranks, each its own
    # process, socket and grant (a byte range of every block); release needs every rank's proof.
    tp_ranks: int = 1
    rank_jitter_ticks: int = 2  # rank r > 0: each batch lands up to this many ticks later
    # In-process engine: what a crashed initiator had already handed over still lands, from a
    # queue on the target's side, at its own due tick (at the earliest the tick after the crash)
    # unless a fence at the target discards it first.
    land_after_crash: bool = False
    # The transport applies a copy of one slice of a completed batch again, some ticks after it
    # landed (a late retransmission). Before DONE: the batch's status comes after the copy (a
    # transport that reports DONE honestly); after DONE: COMPLETED is reported at once and the
    # copy lands later (a transport that lies about DONE).
    p_redeliver: float = 0.0
    redeliver_ticks: tuple[int, int] = (1, 12)
    redeliver_after_done: bool = False

    def to_dict(self) -> dict[str, object]:
        return {k: list(v) if isinstance(v, tuple) else v for k, v in attrs.asdict(self).items()}

    @classmethod
    def from_dict(cls, d: Mapping[str, object]) -> FaultConfig:
        """The knobs back from ``to_dict()``. ``UsageError`` for anything else: not a mapping,
        an unknown knob, a value not of its default's kind (a pair for a range), data nested
        deeper than ``inputs.MAX_NESTING``."""
        if not isinstance(d, Mapping):
            raise UsageError(f"fault knobs must be a mapping, not {type(d).__name__}")
        shallow(d, "fault knobs", error=UsageError)
        fields = {f.name: f for f in attrs.fields(cls)}
        kw: dict[str, Any] = {}
        for k, v in d.items():
            f = fields.get(k) if isinstance(k, str) else None
            if f is None:
                raise UsageError(f"unknown fault knob {show(k)}")
            kw[k] = _knob(k, f.default, v)
        return cls(**kw)


@attrs.frozen(slots=True)
class RequestPlan:
    """What happens to one request, decided by (seed, request) alone."""

    request: int
    nblocks: int  # 2..6
    tokens: int  # prompt length; over capacity -> rejected by prefill after stub_chunks
    abort_after: int | None  # ticks after admission at which the client aborts
    decode_ticks: int  # ticks decode keeps the blocks after consuming them
    latencies: tuple[int, ...]  # per batch (transfer seq 1..), ticks from post to landing
    fails: tuple[bool, ...]  # per batch: one slice is refused, the batch FAILs
    stub_chunks: int  # batches posted before a rejection is decided
    prefix: int = 0  # leading blocks it may share with an earlier request (prefix cache hit)

    @property
    def nchunks(self) -> int:
        return len(self.latencies)


def chunks(nblocks: int) -> int:
    """Batches needed to write ``nblocks`` blocks."""
    return -(-nblocks // BLOCKS_PER_CHUNK)


def plan(seed: int, request: int, cfg: FaultConfig) -> RequestPlan:
    rng = np.random.default_rng((seed, request, 0x6B76))
    nblocks = int(rng.integers(2, 7))
    nchunks = -(-nblocks // BLOCKS_PER_CHUNK)
    tokens = int(rng.integers(64, 4097))
    abort = int(rng.integers(0, cfg.abort_window + 1)) if rng.random() < cfg.p_abort else None
    decode_ticks = int(rng.integers(1, 5))
    slow = rng.random(nchunks) < cfg.p_slow
    lat = np.where(
        slow,
        rng.integers(cfg.slow_ticks[0], cfg.slow_ticks[1] + 1, nchunks),
        rng.integers(cfg.fast_ticks[0], cfg.fast_ticks[1] + 1, nchunks),
    )
    fails = rng.random(nchunks) < cfg.p_fail
    stub = int(rng.integers(0, cfg.max_stub_chunks + 1))
    # Drawn last, so that every draw above is what it was before this knob existed.
    late = rng.random(nchunks) < cfg.p_late
    if late.any():
        lat = np.where(late, rng.integers(cfg.late_ticks[0], cfg.late_ticks[1] + 1, nchunks), lat)
    prefix = 0
    if rng.random() < cfg.p_prefix:
        prefix = min(nblocks - 1, int(rng.integers(cfg.prefix_blocks[0], cfg.prefix_blocks[1] + 1)))
    return RequestPlan(
        request,
        nblocks,
        tokens,
        abort,
        decode_ticks,
        tuple(int(x) for x in lat),
        tuple(bool(x) for x in fails),
        min(stub, nchunks - 1),  # a rejection always comes before the last batch
        prefix,
    )


def rank_latencies(seed: int, p: RequestPlan, rank: int, cfg: FaultConfig) -> tuple[int, ...]:
    """Batch latencies of tensor-parallel rank ``rank``: rank 0 has the plan's, rank r > 0 lands
    each batch 0..``rank_jitter_ticks`` ticks later than rank 0 (its own seeded draw)."""
    if rank == 0 or cfg.rank_jitter_ticks <= 0:
        return p.latencies
    rng = np.random.default_rng((seed, p.request, rank, 0x7A2))
    jitter = rng.integers(0, cfg.rank_jitter_ticks + 1, p.nchunks)
    return tuple(int(a) + int(j) for a, j in zip(p.latencies, jitter, strict=True))


def redeliveries(
    seed: int, request: int, rank: int, nchunks: int, cfg: FaultConfig
) -> tuple[int | None, ...]:
    """Per batch: ticks after its landing at which the transport applies one of its slices
    again (None: never). Its own seeded stream: runs without the knob draw nothing."""
    if cfg.p_redeliver <= 0:
        return (None,) * nchunks
    rng = np.random.default_rng((seed, request, rank, 0x2EDE))
    hit = rng.random(nchunks) < cfg.p_redeliver
    lo, hi = cfg.redeliver_ticks
    after = rng.integers(lo, hi + 1, nchunks)
    return tuple(int(a) if h else None for h, a in zip(hit, after, strict=True))


def crash_tick(
    seed: int, crashed: int, expected_ticks: int, cfg: FaultConfig, start: int = 0
) -> int | None:
    """The tick at which the prefill incarnation started at tick ``start`` crashes, when
    ``crashed`` crashes already happened (None: it does not). With ``cfg.crashes = k`` the
    crashes fall in k windows splitting 30%..90% of the run (one crash: 30%..60%)."""
    if not cfg.crash or crashed >= cfg.crashes or expected_ticks < 8:
        return None
    if cfg.crashes == 1:
        rng = np.random.default_rng((seed, 0xC4A5))
        return int(rng.integers(expected_ticks * 3 // 10, expected_ticks * 6 // 10 + 1))
    span = expected_ticks * 6 // 10 // cfg.crashes
    lo = expected_ticks * 3 // 10 + crashed * span
    rng = np.random.default_rng((seed, 0xC4A5, crashed))
    return max(start + 1, int(rng.integers(lo, lo + max(1, span))))


def restart_tick(seed: int, expected_ticks: int) -> int:
    """The tick at which decode restarts (``PushSettings.restart``), mid-run, away from the crash
    window's start so that both can be told apart."""
    rng = np.random.default_rng((seed, 0x2E57))
    lo = max(1, expected_ticks * 45 // 100)
    return int(rng.integers(lo, max(lo, expected_ticks * 65 // 100) + 1))


class FaultyLink:
    """What the wire does to control messages from one sender: loses, duplicates, delays (so
    reorders) them, and slips in garbage frames. Ticks and tick acknowledgements are not
    control messages and are never touched: they model time, not the network."""

    def __init__(self, seed: int, salt: int, cfg: FaultConfig) -> None:
        self._rng = np.random.default_rng((seed, salt, 0x11A4))
        self._cfg = cfg
        self._queue: dict[int, list[bytes]] = {}
        self.lost = 0
        self.duplicated = 0
        self.delayed = 0
        self.garbage = 0

    def offer(self, frame: bytes, now: int) -> None:
        cfg, rng = self._cfg, self._rng
        r = rng.random(4)
        if r[0] < cfg.p_malformed:
            self.garbage += 1
            self._at(now, self._garbage(frame))
        if r[1] < cfg.p_lose:
            self.lost += 1
            return
        due = now
        if r[2] < cfg.p_delay:
            self.delayed += 1
            due = now + int(rng.integers(1, cfg.max_delay + 1))
        self._at(due, frame)
        if r[3] < cfg.p_dup:
            self.duplicated += 1
            self._at(due + int(rng.integers(0, 3)), frame)

    def _at(self, due: int, frame: bytes) -> None:
        self._queue.setdefault(due, []).append(frame)

    def due(self, now: int) -> list[bytes]:
        """Frames to send at ``now``, in a reproducible order."""
        out: list[bytes] = []
        for t in sorted(t for t in self._queue if t <= now):
            out.extend(self._queue.pop(t))
        return out

    def pending(self) -> int:
        return sum(len(v) for v in self._queue.values())

    def _garbage(self, frame: bytes) -> bytes:
        kind = int(self._rng.integers(0, 5))
        if kind == 0:
            return bytes(self._rng.integers(0, 256, int(self._rng.integers(0, 64)), dtype=np.uint8))
        if kind == 1:
            return frame[: max(1, len(frame) // 2)]  # truncated
        body: dict[str, object] = {"v": SCHEMA_VERSION, "t": "evidence"}
        if kind == 2:
            body["v"] = SCHEMA_VERSION + 1  # a newer schema
        elif kind == 3:
            body["t"] = "reticulate_splines"  # an unknown type
        else:
            body["evidence"] = {"type": "TransferCompleted", "last_seq": -1}  # invalid fields
        out: bytes = msgpack.packb(body)
        return out
