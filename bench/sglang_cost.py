"""The SGLang guard's cost in SGLang 0.5.23's own scheduler-side disaggregation code: guarded /
alone, in one interleaved run.

``.venv-sglang/bin/python -m bench.sglang_cost [--requests 256,1024 --rounds 7 --out FILE]``

Each side runs in a process of its own (SGLang's runtime context and Mooncake's transfer engine
are per process), with SGLang's real queues, pools, radix cache, metadata buffers and Mooncake
manager / sender / receiver / bootstrap server as the rig of ``tests/in_sglang`` builds them
(``DecodeSide`` / ``PrefillSide`` through ``sglang_rig``). No bytes move: the other side and the
transfer are simulated in the process, so what is timed is the scheduler-side Python work.

- **decode**: ``process_decode_queue`` (SGLang's scheduler method, run on the rig's stand-in
  scheduler), ticked until ``--requests`` admitted requests are all published
  (``pop_preallocated``: pages allocated, ``_send_kv_metadata`` to the prefill rank) and then,
  once their transfers are marked complete, until all are transferred (``pop_transferred``:
  Success, the metadata gate, ``_commit_transfer_to_req``). The prefill is a rank registered
  with a real bootstrap server whose endpoint is a ZeroMQ socket drained in the process; the
  transfer's completion is what the decode's Mooncake thread would record on the prefill's
  message: the room written into the metadata slot and the room's status set to Success.
- **prefill**: ``process_disagg_prefill_inflight_queue`` with ``--requests`` requests in flight,
  polled ``--inflight-polls`` times while their transfers run, then once after every transfer
  is marked complete (the Success branch: ``release_kv_cache``, the sender cleared). The decode's
  metadata arrival is its status set to WaitingForInput; the forward is the rig's (pages
  allocated, ``send_kv_chunk`` timed apart as "send"); no decode destination is known to the
  manager, so ``add_transfer_request`` queues nothing (SGLang's dummy-rank path).

Rounds alternate alone / guarded (``install(role=...)`` before a guarded round, ``uninstall()``
after it; the same queues and pools serve both), the order flipping every round, the collector
off; every ratio is taken within a round and the median is reported (this 2-core machine is
shared and its speed drifts). Each round is checked to have done the same work: every request
through, every page, request slot and metadata slot back, and (guarded) the guard with nothing
held, quarantined or refused. One more guarded round with the guard's methods timed on the
instance gives the guard's own work per request.

A benchmark, not a test: the target (<= 1.05x) is printed beside the figure, not asserted.
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

from bench import common

TARGET = 1.05
ROOT = Path(__file__).resolve().parents[1]
RIG = ROOT / "tests" / "in_sglang"


def _rig() -> Any:
    """A's rig (SGLang's classes as the scenario tests build them)."""
    if str(RIG) not in sys.path:
        sys.path.insert(0, str(RIG))
    # tests/in_sglang, put on the path above
    import sglang_rig

    return sglang_rig


def machine() -> dict[str, Any]:
    import sglang
    import torch

    return common.machine(
        torch=torch.__version__, sglang=sglang.__version__, loadavg=list(os.getloadavg())
    )


class Span:
    """Time spent in the timed calls: the scheduler thread's CPU time (``time.thread_time``:
    what the machine's other load does not add to: waiting for a core or for the GIL is not
    counted) and the wall-clock time beside it."""

    __slots__ = ("cpu", "wall")

    def __init__(self) -> None:
        self.cpu = 0
        self.wall = 0

    def time(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        c0, w0 = time.thread_time_ns(), time.perf_counter_ns()
        try:
            return fn(*args, **kwargs)
        finally:
            self.wall += time.perf_counter_ns() - w0
            self.cpu += time.thread_time_ns() - c0

    def plain(self) -> dict[str, int]:
        return {"cpu": self.cpu, "wall": self.wall}

    @staticmethod
    def total(*spans: Span) -> dict[str, int]:
        return {"cpu": sum(s.cpu for s in spans), "wall": sum(s.wall for s in spans)}


class GuardTimer:
    """The guard's public methods timed on the instance (no profiler): ns and calls each."""

    _NOT = frozenset({"revoke", "stats", "lifecycle", "lifecycles", "ready"})

    def __init__(self, guard: Any) -> None:
        self.spent: dict[str, int] = {}
        self.calls: dict[str, int] = {}
        names = {
            name
            for cls in type(guard).__mro__
            for name, fn in vars(cls).items()
            if callable(fn) and name[0] != "_" and name not in self._NOT
        }
        for name in sorted(names):
            self._wrap(guard, name)

    def _wrap(self, guard: Any, name: str) -> None:
        fn = getattr(guard, name)
        cpu = time.thread_time_ns
        spent, calls = self.spent, self.calls

        def timed(*a: Any, **k: Any) -> Any:
            t0 = cpu()
            try:
                return fn(*a, **k)
            finally:
                spent[name] = spent.get(name, 0) + cpu() - t0
                calls[name] = calls.get(name, 0) + 1

        setattr(guard, name, timed)

    def per_request(self, n: int) -> dict[str, Any]:
        return {
            "us_per_request": {k: self.spent[k] / n / 1e3 for k in sorted(self.spent)},
            "calls": dict(sorted(self.calls.items())),
            "total_us_per_request": sum(self.spent.values()) / n / 1e3,
        }


def _guard_clean(guard: Any, n: int, what: str) -> dict[str, Any]:
    st = guard.stats()
    out = {
        "live": st.live,
        "held": st.held,
        "quarantined": st.quarantined,
        "releasable": st.releasable,
        "completed": st.completed,
        "freed": st.freed,
        "refused": dict(st.refused),
        "duplicates": st.duplicates,
    }
    done = st.completed if what == "decode" else st.freed
    if st.live or st.held or st.releasable or st.refused or done != n:
        raise SystemExit(f"{what}: the guard did not see every request through cleanly: {out}")
    return out


class _SideBench:
    """What both sides' benches share: the rig's side, its requests, the guard of a round, the
    check that a round gave back every page, request slot and metadata slot."""

    side: Any
    pages: int
    room: int
    initial: tuple[int, int, int]

    def __init__(self, args: argparse.Namespace) -> None:
        """After ``_rig()`` (it sets the environment SGLang reads, before the guard imports it)."""
        from kvlifetime.integrations import sglang as kv_sglang

        self.kv_sglang = kv_sglang
        self.args = args
        self.n = max(args.requests_list)

    def _free(self) -> tuple[int, int, int]:
        s = self.side
        return (
            int(s.allocator.available_size()),
            int(s.req_pool.available_size()),
            int(s.meta_alloc.available_size()),
        )

    def _admit(self, n: int, prefix: str) -> list[str]:
        """``n`` new requests admitted to the side, rooms counted on from the last round's."""
        rids = []
        for _ in range(n):
            self.room += 1
            rid = f"{prefix}{self.room}"
            self.side.admit(rid, self.room, self.args.tokens)
            rids.append(rid)
        return rids

    def _install(
        self, role: Literal["decode", "prefill"], guarded: bool, timer: bool
    ) -> tuple[Any | None, GuardTimer | None]:
        """The round's guard (None alone) and, with ``timer``, its methods timed."""
        guard = self.kv_sglang.install(role=role, ledger_blocks=self.pages) if guarded else None
        return guard, (GuardTimer(guard) if timer and guard is not None else None)

    def _check_back(self, what: str) -> None:
        if self._free() != self.initial:
            raise SystemExit(
                f"{what}: pool not back after the round: {self._free()} {self.initial}"
            )


# ====================================================================== decode


class _PrefillEndpoint:
    """The prefill rank's ZeroMQ endpoint, drained in the process (the decode's registration and
    metadata messages go here; nothing answers)."""

    def __init__(self) -> None:
        import zmq

        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.PULL)
        self.port = self._sock.bind_to_random_port("tcp://127.0.0.1")
        self.messages = 0
        threading.Thread(target=self._drain, daemon=True, name="bench-prefill-rank").start()

    def _drain(self) -> None:
        while True:
            self._sock.recv_multipart()
            self.messages += 1


def _register_prefill(bootstrap_port: int, rank_port: int) -> None:
    """What a one-rank prefill's manager PUTs to its bootstrap server
    (``register_to_bootstrap``)."""
    import requests

    payload: dict[str, Any] = {
        "attn_tp_size": 1,
        "attn_tp_rank": 0,
        "attn_cp_size": 1,
        "attn_cp_rank": 0,
        "attn_dp_size": 1,
        "attn_dp_rank": 0,
        "pp_size": 1,
        "pp_rank": 0,
        "system_dp_size": 1,
        "system_dp_rank": 0,
        "rank_ip": "127.0.0.1",
        "rank_port": rank_port,
        "page_size": 1,
        "kv_cache_dtype": "auto",
        "decode_allocation_policy": "early",
    }
    r = requests.put(f"http://127.0.0.1:{bootstrap_port}/route", json=payload, timeout=10)
    r.raise_for_status()


class DecodeBench(_SideBench):
    def __init__(self, args: argparse.Namespace) -> None:
        rig = _rig()
        super().__init__(args)
        from sglang.srt.disaggregation.mooncake.conn import MooncakeKVBootstrapServer

        port = _free_port()
        self.server = MooncakeKVBootstrapServer("127.0.0.1", port)
        self.endpoint = _PrefillEndpoint()
        _wait_http(port)
        _register_prefill(port, self.endpoint.port)
        pool = self.n * args.tokens + 64
        self.side = rig.DecodeSide(
            {"bootstrap_port": port, "pool_tokens": pool, "max_reqs": self.n}, None
        )
        alloc = self.side.allocator
        self.pages = int(alloc.size) // int(alloc.page_size) + 2  # as the hooks size the ledger
        from sglang.srt.disaggregation.base.conn import KVPoll
        from sglang.srt.disaggregation.decode import SchedulerDisaggregationDecodeMixin
        from sglang.srt.mem_cache.common import release_kv_cache

        self.KVPoll = KVPoll
        self.tick_fn = SchedulerDisaggregationDecodeMixin.process_decode_queue
        self.release_kv_cache = release_kv_cache
        self.room = 0
        self.initial = self._free()

    def _ticks_until(self, done: Callable[[], bool], what: str) -> tuple[Span, int]:
        """Tick until ``done()``; (time in ``process_decode_queue``, ticks). Collector off."""
        sched, tick = self.side.sched, self.tick_fn
        span = Span()
        ticks = 0
        gc.collect()
        gc.disable()
        try:
            deadline = time.monotonic() + 120
            while not done():
                span.time(tick, sched)
                ticks += 1
                if time.monotonic() > deadline:
                    raise SystemExit(f"decode: {what} never completed after {ticks} ticks")
        finally:
            gc.enable()
        return span, ticks

    def round(self, n: int, guarded: bool, timer: bool = False) -> dict[str, Any]:
        """``n`` requests admitted, published, transferred; the figures of the round."""
        s = self.side
        tq, meta, mgr = s.transfer_queue, s.meta, s.prealloc_queue.kv_manager
        guard, gt = self._install("decode", guarded, timer)
        try:
            rids = self._admit(n, "d")
            pub_ns, pub_ticks = self._ticks_until(lambda: len(tq.queue) == n, "publishing")
            # The transfer, simulated: what the prefill's aux write and its status message leave.
            published = list(tq.queue)
            for dr in published:
                room = dr.req.bootstrap_room
                meta.bootstrap_room[dr.metadata_buffer_index, 0] = room
                mgr.update_status(room, self.KVPoll.Success)
            xfer_ns, xfer_ticks = self._ticks_until(
                lambda: len(s.sched.waiting_queue) == n, "the transfers"
            )
            got = {r.rid for r in s.sched.waiting_queue}
            if got != set(rids) or tq.queue or tq._deferred_releases:
                raise SystemExit(f"decode: not every request was transferred ({len(got)} of {n})")
            work: dict[str, Any] = {"transferred": len(got)}
            if guard is not None:
                work["guard"] = _guard_clean(guard, n, "decode")
        finally:
            if guarded:
                self.kv_sglang.uninstall()
        # The requests end (untimed): pages and request slots back, receivers cleared.
        for dr in published:
            if dr.kv_receiver is not None:  # (SGLang clears it on commit)
                dr.kv_receiver.clear()
        for req in s.sched.waiting_queue:
            self.release_kv_cache(req, s.tree, checkpoint=False)
        s.sched.waiting_queue.clear()
        s.reqs.clear()
        s.pages.clear()
        self._check_back("decode")
        out = {
            "tick": Span.total(pub_ns, xfer_ns),
            "publish": pub_ns.plain(),
            "transferred": xfer_ns.plain(),
            "ticks": (pub_ticks, xfer_ticks),
            "work": work,
        }
        if gt is not None:
            out["guard_time"] = gt.per_request(n)
        return out


# ====================================================================== prefill


class PrefillBench(_SideBench):
    def __init__(self, args: argparse.Namespace) -> None:
        rig = _rig()
        super().__init__(args)
        from kvlifetime.integrations.sglang import facts_v0_5_23

        pool = self.n * args.tokens + 64
        self.side = rig.PrefillSide(
            {"bootstrap_port": _free_port(), "pool_tokens": pool, "max_reqs": self.n}, None
        )
        self.pages = facts_v0_5_23.prefill_pages(self.side.bootstrap_queue)
        from sglang.srt.disaggregation.base.conn import KVPoll
        from sglang.srt.disaggregation.prefill import SchedulerDisaggregationPrefillMixin

        self.KVPoll = KVPoll
        self.mixin = SchedulerDisaggregationPrefillMixin
        self.room = 10**9  # apart from the decode's rooms (another process anyway)
        self.initial = self._free()

    def round(self, n: int, guarded: bool, timer: bool = False) -> dict[str, Any]:
        s = self.side
        sched, mgr = s.sched, s.mgr
        guard, gt = self._install("prefill", guarded, timer)
        try:
            reqs = [s.reqs[rid] for rid in self._admit(n, "p")]
            # The decode's metadata arrived for every room (its Mooncake thread's update).
            for req in reqs:
                mgr.update_status(req.bootstrap_room, self.KVPoll.WaitingForInput)
            popped: list[Any] = []
            deadline = time.monotonic() + 60
            while len(popped) < n:
                popped += s.bootstrap_queue.pop_bootstrapped()
                if time.monotonic() > deadline:
                    raise SystemExit(f"prefill: bootstrapped {len(popped)} of {n}")
            gc.collect()
            gc.disable()
            try:
                send, inflight, concluding = Span(), Span(), Span()
                for req in popped:
                    # The rig's forward bar the page fill; send_kv_chunk timed apart.
                    s.allocate_forward(req)
                    send.time(self.mixin.send_kv_chunk, sched, req, last_chunk=True)
                    sched.disagg_prefill_inflight_queue.append(req)
                poll = self.mixin.process_disagg_prefill_inflight_queue
                for _ in range(self.args.inflight_polls):
                    if inflight.time(poll, sched):
                        raise SystemExit("prefill: a request concluded before its transfer did")
                # The transfers complete (what the worker records after each room's last chunk).
                for req in popped:
                    mgr.update_status(req.bootstrap_room, self.KVPoll.Success)
                done = concluding.time(poll, sched)
            finally:
                gc.enable()
            if len(done) != n or sched.disagg_prefill_inflight_queue:
                raise SystemExit(f"prefill: {len(done)} of {n} concluded")
            work: dict[str, Any] = {"concluded": len(done)}
            if guard is not None:
                work["guard"] = _guard_clean(guard, n, "prefill")
        finally:
            if guarded:
                self.kv_sglang.uninstall()
        s.reqs.clear()
        self._check_back("prefill")
        out = {
            "tick": Span.total(inflight, concluding),
            "inflight": inflight.plain(),
            "concluding": concluding.plain(),
            "send": send.plain(),
            "work": work,
        }
        if gt is not None:
            out["guard_time"] = gt.per_request(n)
        return out


# ====================================================================== the run


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait_http(port: int) -> None:
    import socket

    deadline = time.monotonic() + 30
    while True:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                return
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


_PARTS = {"decode": ("publish", "transferred"), "prefill": ("inflight", "concluding", "send")}


def measure(side: str, args: argparse.Namespace) -> dict[str, Any]:
    """One side, in this process: for each size, alternating rounds, ratios within a round."""
    bench: DecodeBench | PrefillBench = (DecodeBench if side == "decode" else PrefillBench)(args)
    # SGLang's and torch's heap, built once, out of the collector's way: a full collection
    # before each timed section then takes milliseconds, not seconds.
    gc.collect()
    gc.freeze()
    out: dict[str, Any] = {"sizes": {}}
    for n in args.requests_list:
        bench.round(n, False)  # warm-up: first calls, caches
        bench.round(n, True)
        per_round: list[dict[str, dict[str, Any]]] = []
        for r in range(args.rounds):
            order = (False, True) if r % 2 == 0 else (True, False)
            got = {("guarded" if g else "alone"): bench.round(n, g) for g in order}
            if {k: v for k, v in got["alone"]["work"].items() if k != "guard"} != {
                k: v for k, v in got["guarded"]["work"].items() if k != "guard"
            }:
                raise SystemExit(f"{side}: the rounds did different work: {got}")
            per_round.append(got)
        entry: dict[str, Any] = {}
        for part in ("tick", *_PARTS[side]):
            entry[part] = {}
            for clock in ("cpu", "wall"):
                alone = [x["alone"][part][clock] for x in per_round]
                guarded = [x["guarded"][part][clock] for x in per_round]
                ratios = [g / a for a, g in zip(alone, guarded, strict=True)]
                entry[part][clock] = {
                    "alone_us_per_request": statistics.median(alone) / n / 1e3,
                    "guarded_us_per_request": statistics.median(guarded) / n / 1e3,
                    "ratio": statistics.median(ratios),
                    "ratio_min": min(ratios),
                    "ratio_max": max(ratios),
                }
        entry["ticks"] = [x["alone"].get("ticks") for x in per_round]
        entry["work"] = per_round[-1]["guarded"]["work"]
        entry["guard_time"] = bench.round(n, True, timer=True)["guard_time"]
        if args.profile_top:
            entry["profile_top_own"] = common.own_profile(
                functools.partial(bench.round, n, True), n, args.profile_top
            )
        out["sizes"][str(n)] = entry
    return out


def _child(side: str, args: argparse.Namespace) -> dict[str, Any]:
    """Run one side in a fresh process (SGLang's runtime context is per process)."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / f"{side}.json"
        cmd = [
            sys.executable,
            "-m",
            "bench.sglang_cost",
            "--side",
            side,
            "--requests",
            ",".join(map(str, args.requests_list)),
            "--tokens",
            str(args.tokens),
            "--rounds",
            str(args.rounds),
            "--inflight-polls",
            str(args.inflight_polls),
            "--profile-top",
            str(args.profile_top),
            "--child-out",
            str(path),
        ]
        # SGLang's import warnings (no CUDA) are noise here.
        env = {**os.environ, "PYTHONWARNINGS": "ignore"}
        subprocess.run(cmd, check=True, cwd=ROOT, env=env)
        result: dict[str, Any] = json.loads(path.read_text(encoding="utf-8"))
        return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.sglang_cost")
    p.add_argument("--requests", default="256,1024", help="requests in flight, comma-separated")
    p.add_argument("--tokens", type=int, default=32, help="prompt tokens (pages) per request")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--inflight-polls", type=int, default=4, help="prefill polls while in flight")
    p.add_argument("--side", choices=("decode", "prefill", "both"), default="both")
    p.add_argument("--profile-top", type=int, default=12, help="0: no cProfile round")
    p.add_argument("--out", type=Path, default=None, help="write the figures as JSON here")
    p.add_argument("--child-out", type=Path, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.requests_list = [int(x) for x in args.requests.split(",") if x]
    if args.child_out is not None:
        result = {"side": args.side, "loadavg_after": list(os.getloadavg())}
        result.update(measure(args.side, args))
        args.child_out.write_text(json.dumps(result), encoding="utf-8")
        return 0
    info = machine()
    print(
        f"SGLang {info['sglang']} disaggregation queues (real classes, transfers simulated in "
        f"the process); {info['cores']} cores, Python {info['python']}, "
        f"load average {info['loadavg'][0]:.2f} {info['loadavg'][1]:.2f} {info['loadavg'][2]:.2f}"
    )
    print(
        f"requests in flight {args.requests}, {args.tokens} pages each, {args.rounds} rounds "
        "alternating alone / guarded; ratio guarded / alone per round: median [range]"
    )
    sides = ("decode", "prefill") if args.side == "both" else (args.side,)
    report: dict[str, Any] = {
        "bench": "sglang_cost",
        "machine": info,
        "config": {k: v for k, v in vars(args).items() if k not in ("out", "child_out")},
        "target_ratio": TARGET,
        "sides": {},
    }
    for side in sides:
        report["sides"][side] = _child(side, args)
    report["machine"]["loadavg_end"] = list(os.getloadavg())
    _print(report)
    common.write_json(args.out, report)
    return 0


_LABELS = {
    "tick": "the tick (timed total)",
    "publish": "  publish ticks",
    "transferred": "  transferred ticks",
    "inflight": "  polls in flight",
    "concluding": "  poll concluding",
    "send": "send_kv_chunk (apart)",
}


def _print(report: dict[str, Any]) -> None:
    rows = [
        [
            "side / requests",
            "part",
            "alone us/req",
            "guarded us/req",
            "ratio (cpu)",
            "range",
            "ratio (wall)",
            "target",
        ]
    ]
    for side, res in report["sides"].items():
        for n, e in res["sizes"].items():
            for part in ("tick", *_PARTS[side]):
                c, w = e[part]["cpu"], e[part]["wall"]
                target = ""
                if part == "tick":
                    target = "ok" if c["ratio"] <= TARGET else f"above {TARGET}x"
                rows.append(
                    [
                        f"{side} {n}",
                        _LABELS[part],
                        f"{c['alone_us_per_request']:.1f}",
                        f"{c['guarded_us_per_request']:.1f}",
                        f"{c['ratio']:.3f}x",
                        f"[{c['ratio_min']:.2f}-{c['ratio_max']:.2f}]",
                        f"{w['ratio']:.3f}x",
                        target,
                    ]
                )
    print()
    print(common.table(rows))
    for side, res in report["sides"].items():
        for n, e in res["sizes"].items():
            gt, alone = e["guard_time"], e["tick"]["cpu"]["alone_us_per_request"]
            print(
                f"\n{side} {n}: the guard's own work {gt['total_us_per_request']:.1f} us per "
                f"request (CPU, timed on the instance in one more guarded round) beside SGLang's "
                f"{alone:.1f} us alone; guard after each round {e['work'].get('guard')}"
            )
            for k, us in gt["us_per_request"].items():
                print(f"    guard.{k:20s} {us:7.2f} us/req  ({gt['calls'][k]} calls)")
            if e.get("profile_top_own"):
                print("  kvlifetime functions by own time (cProfile, 1 guarded round; inflated):")
                for f in e["profile_top_own"]:
                    print(
                        f"    {f['fn']:56s} {f['calls']:6d} calls {f['us_per_request']:6.2f} us/req"
                    )
    print(
        f"\nload average: {report['machine']['loadavg']} at the start, "
        f"{report['machine']['loadavg_end']} at the end (2 cores shared with other work; "
        "CPU time is the scheduler thread's, wall time includes waiting for a core)"
    )


if __name__ == "__main__":
    sys.exit(main())
