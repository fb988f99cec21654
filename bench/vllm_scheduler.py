"""The guard's cost inside vLLM's real scheduler: guarded / unguarded scheduler time per step.

``.venv-vllm/bin/python -m bench.vllm_scheduler [--requests 1000 --rounds 7 --out FILE]``

vLLM's own ``Scheduler`` (``vllm.v1.core.sched.scheduler``) with ``NixlConnector`` (scheduler
side; nixl is not needed), once as vLLM runs it and once guarded (``GuardedConnector`` named in
``kv_transfer_config``, as a user selects it). The model's output is mocked, as vLLM's own
scheduler tests do: one step is ``schedule()``, then ``update_from_output()`` with one sampled
token per request that completed its prompt, and the connector's sets. Two engines, every
request on the connector path:

- **prefill** (``do_remote_decode=True``, ``max_tokens=1``): each request is prefilled and
  finishes in one step; NIXL delays the free (a remote decode reads the blocks: the guard opens
  a READ grant and holds the request); ``--lag`` steps later the worker reports it in
  ``finished_sending`` (the guard applies ``TransferCompleted`` and hands the id back), and
  vLLM frees the blocks;
- **decode** (``do_remote_prefill=True``): the request waits in ``WAITING_FOR_REMOTE_KVS``
  (the guard opens a WRITE grant over the blocks the load lands in); ``--lag`` steps later the
  worker reports ``finished_recving``; then ``--decode-tokens`` decode steps.

Only ``schedule()`` and ``update_from_output()`` are timed (not building the requests or the
mocked outputs). The two schedulers run in lock-step through the same workload: one step of
each in turn, which one goes first alternating by step and by round, the collector off (this
2-core machine is shared and its speed drifts: whatever else it does falls on both alike).
Every ratio is taken within a round and the median of the rounds is reported. Each round is
checked to have done the same work in both: the same steps, the same requests finished, every
block back in vLLM's pool, and (guarded) the guard's stats with every prefill request handed
back, nothing exposed, withheld or dropped, the ledger empty.

Where the guard's time goes: one more guarded run with the guard's and its ledger's methods
timed on the instances (no profiler), and one under cProfile (kvlifetime's functions by own
time; a profiler inflates small calls, so its figures are for ranking only).

A benchmark, not a test: it measures and checks the work matched; the target (<= 1.05x) is
printed beside the figure, not asserted.
"""

from __future__ import annotations

import argparse
import gc
import itertools
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from bench import vllm_common as common

TARGET = 1.05
BLOCK = 16
EOS = 2


def _vllm() -> dict[str, Any]:
    """vLLM's classes (imported after ``vllm_common`` set the environment)."""
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
    from vllm.v1.request import Request, RequestStatus

    init_none_hash(sha256)
    import logging

    logging.getLogger("vllm").setLevel(logging.ERROR)  # its warnings about a CPU, no weights
    return {
        "SamplingParams": SamplingParams,
        "sha256": sha256,
        "get_request_block_hasher": get_request_block_hasher,
        "KVConnectorOutput": KVConnectorOutput,
        "ModelRunnerOutput": ModelRunnerOutput,
        "Request": Request,
        "RequestStatus": RequestStatus,
    }


def runner_output(v: dict[str, Any], ids: list[str], sampled: Any, kv: Any) -> Any:
    """The mocked worker's ``ModelRunnerOutput`` (vLLM 0.34 dropped ``req_id_to_index``)."""
    cls = v["ModelRunnerOutput"]
    extra: dict[str, Any] = {}
    if "req_id_to_index" in cls.__dataclass_fields__:
        extra["req_id_to_index"] = {r: i for i, r in enumerate(ids)}
    return cls(
        req_ids=ids,
        sampled_token_ids=sampled,
        logprobs=None,
        prompt_logprobs_dict={},
        pooler_output=None,
        kv_connector_output=kv,
        **extra,
    )


class Workload:
    """One engine's requests and the mocked worker, for one run of one scheduler."""

    def __init__(self, v: dict[str, Any], args: argparse.Namespace, side: str) -> None:
        self.v = v
        self.args = args
        self.side = side
        self.prompt = args.prompt_blocks * BLOCK
        self.max_tokens = 1 if side == "prefill" else args.decode_tokens
        self.hasher = v["get_request_block_hasher"](BLOCK, v["sha256"])
        self._ids = itertools.count()

    def scheduler(self, guarded: bool) -> Any:
        from kvlifetime.integrations.vllm import testing

        a = self.args
        assert testing.BLOCK == BLOCK
        return testing.scheduler(
            guarded=guarded,
            num_blocks=a.num_blocks,
            max_num_seqs=a.max_num_seqs,
            max_num_batched_tokens=a.max_num_batched_tokens,
            max_model_len=4096,
        )

    def requests(self, count: int | None = None, *, live: bool = False) -> list[Any]:
        """Fresh requests (a Request is consumed by a run); distinct prompts, no prefix hits.
        ``live``: the requests that stay live through the timed run (one block, one token)."""
        v = self.v
        out = []
        prompt = BLOCK if live else self.prompt
        for _ in range(self.args.requests if count is None else count):
            n = next(self._ids)
            params = v["SamplingParams"](max_tokens=1 if live else self.max_tokens, ignore_eos=True)
            params.update_from_generation_config({}, EOS)
            req = v["Request"](
                request_id=f"{self.side}-{'live-' if live else ''}{n}",
                prompt_token_ids=[(7919 * n + i) % 50000 + 3 for i in range(prompt)],
                sampling_params=params,
                pooling_params=None,
                mm_features=None,
                block_hasher=self.hasher,
            )
            if self.side == "prefill":
                req.kv_transfer_params = {"do_remote_prefill": False, "do_remote_decode": True}
            else:
                req.kv_transfer_params = {
                    "do_remote_prefill": True,
                    "do_remote_decode": False,
                    "remote_engine_id": "prefill-engine",
                    "remote_request_id": f"prefill-{n}",
                    "remote_block_ids": list(range(prompt // BLOCK)),
                    "remote_host": "prefill-host",
                    "remote_port": 1234,
                    "tp_size": 1,
                }
            out.append(req)
        return out

    def run(self, guarded: bool) -> Run:
        return Run(self, guarded)


class Run:
    """One scheduler through the whole workload, one ``step()`` at a time (so two runs can go
    in lock-step); ``sched_ns`` is the time in ``schedule()`` + ``update_from_output()``."""

    def __init__(self, wl: Workload, guarded: bool) -> None:
        self.wl, self.guarded = wl, guarded
        self.s = wl.scheduler(guarded)
        self.reqs = wl.requests()
        self._pending = iter(self.reqs)
        self._due: dict[int, set[str]] = {}  # step -> ids the worker reports done at that step
        self._loading: dict[str, Any] = {}  # decode side: added, not yet seen waiting for KV
        self.added = self.steps = self.sched_ns = 0
        self.done = False
        self.live: list[Any] = []
        if wl.args.live:
            self._hold_live(wl.args.live)

    def _hold_live(self, count: int) -> None:
        """Untimed set-up: ``count`` requests the timed run finds live and leaves so (prefill:
        finished, their free delayed for a remote read; decode: waiting for a load), each
        holding one block; the worker reports them done only after the timed run."""
        s, v = self.s, self.wl.v
        self.live = self.wl.requests(count, live=True)
        for req in self.live:
            s.add_request(req)
        waiting = v["RequestStatus"].WAITING_FOR_REMOTE_KVS
        prefill = self.wl.side == "prefill"

        def held(r: Any) -> bool:
            return bool(r.is_finished()) if prefill else bool(r.status == waiting)

        for _ in range(10 * count):
            if all(held(r) for r in self.live):
                break
            so = s.schedule()
            ids = list(so.num_scheduled_tokens)
            out = runner_output(v, ids, [[0] for _ in ids], None)
            s.update_from_output(so, out)
        else:
            raise RuntimeError(f"{self.wl.side}: the live requests were not all held")
        self._live_ids = {r.request_id for r in self.live}

    def release_live(self) -> None:
        """Untimed: the worker reports every live request done; vLLM frees them all."""
        if not self.live:
            return
        s, v, side = self.s, self.wl.v, self.wl.side
        done = set(self._live_ids)
        kv = v["KVConnectorOutput"](
            finished_sending=done if side == "prefill" else None,
            finished_recving=done if side == "decode" else None,
            failed_recving=set(),
            invalid_block_ids=set(),
        )
        for _ in range(100):
            so = s.schedule()
            ids = list(so.num_scheduled_tokens)
            out = runner_output(v, ids, [[0] for _ in ids], kv)
            kv = None
            s.update_from_output(so, out)
            if not s.requests:
                return
        raise RuntimeError(f"{side}: the live requests were not all freed")

    def step(self) -> bool:
        """One engine step; False once the workload is over (nothing left to do)."""
        wl, a, s = self.wl, self.wl.args, self.s
        v = wl.v
        for req in itertools.islice(self._pending, a.arrivals):
            s.add_request(req)
            self.added += 1
            if wl.side == "decode":
                self._loading[req.request_id] = req
        if self.added == a.requests and len(s.requests) == len(self.live) and not self._due:
            self.done = True
            return False
        perf = time.perf_counter_ns
        t0 = perf()
        so = s.schedule()
        t1 = perf()
        # The mocked worker: a token for every request whose prompt is complete, and the
        # connector's reports that fall due this step.
        ids = list(so.num_scheduled_tokens)
        sampled = []
        for rid in ids:
            r = s.requests[rid]
            sampled.append([0] if r.num_computed_tokens >= r.num_tokens else [])
        done = self._due.pop(self.steps, None)
        kv = None
        if done is not None:
            kv = v["KVConnectorOutput"](
                finished_sending=done if wl.side == "prefill" else None,
                finished_recving=done if wl.side == "decode" else None,
                failed_recving=set(),
                invalid_block_ids=set(),
            )
        out = runner_output(v, ids, sampled, kv)
        t2 = perf()
        s.update_from_output(so, out)
        t3 = perf()
        self.sched_ns += (t1 - t0) + (t3 - t2)
        # What the worker will report later (untimed bookkeeping).
        report_at = self.steps + a.lag
        if wl.side == "prefill":
            for rid in ids:
                r = s.requests.get(rid)
                if r is not None and r.is_finished():
                    self._due.setdefault(report_at, set()).add(rid)
        else:
            waiting = v["RequestStatus"].WAITING_FOR_REMOTE_KVS
            for rid in [k for k, r in self._loading.items() if r.status == waiting]:
                del self._loading[rid]
                self._due.setdefault(report_at, set()).add(rid)
        self.steps += 1
        if self.steps > 100 * a.requests:
            raise RuntimeError(f"{wl.side}: the run does not end (step {self.steps})")
        return True

    def to_end(self) -> Run:
        """The timed workload to its end (the live requests still held: ``release_live``)."""
        while self.step():
            pass
        return self

    def us_per_step(self) -> float:
        return self.sched_ns / max(self.steps, 1) / 1e3

    def work(self) -> dict[str, Any]:
        """What the run did, for the same-work check."""
        out: dict[str, Any] = {
            "steps": self.steps,
            "finished": sum(r.is_finished() for r in self.reqs),
            "live_held": len(self.live),
            "free_blocks": self.s.kv_cache_manager.block_pool.get_num_free_blocks(),
            "tokens_out": sum(r.num_output_tokens for r in self.reqs),
        }
        if self.guarded:
            out["guard"] = _guard_summary(self.s)
        return out


def lockstep(wl: Workload, rnd: int) -> tuple[Run, Run]:
    """The unguarded and the guarded scheduler through the same workload, one step of each in
    turn (which goes first alternates by step and by round), the collector off: whatever
    else the machine does falls on both alike."""
    plain, guarded = common.quiet_run(lambda: (wl.run(False), wl.run(True)))
    gc.collect()
    gc.disable()
    try:
        i = rnd
        while not (plain.done and guarded.done):
            first, second = (plain, guarded) if i % 2 == 0 else (guarded, plain)
            first.step()
            second.step()
            i += 1
    finally:
        gc.enable()
    plain.release_live()
    guarded.release_live()
    return plain, guarded


def _guard_summary(s: Any) -> dict[str, Any]:
    g = s.connector.guard
    st = g.stats()
    led = st.ledger
    return {
        "handed_back": st.handed_back,
        "exposed": st.exposed,
        "withheld": st.withheld,
        "dropped": dict(st.dropped),
        "lease_reaped": st.lease_reaped,
        "load_failed": st.load_failed,
        "open_grants": led.open_grants,
        "live_requests": sum(led.requests_by_state.values()),
        "quarantined": len(led.quarantined),
        "refused_evidence": dict(led.refused_evidence),
    }


def check(side: str, args: argparse.Namespace, plain: Run, guarded: Run) -> dict[str, Any]:
    """Both runs did the same work, and the guard handed every request back."""
    p, g = plain.work(), guarded.work()
    same = {k: p[k] for k in ("steps", "finished", "free_blocks", "tokens_out")}
    if same != {k: g[k] for k in same}:
        raise SystemExit(f"{side}: the runs did different work: plain {p}, guarded {g}")
    if p["finished"] != args.requests or p["free_blocks"] != args.num_blocks - 1:
        raise SystemExit(f"{side}: not every request finished and freed its blocks: {p}")
    gs = g["guard"]
    # Prefill: every request's free was delayed and handed back by the guard. Decode: the
    # loads' WRITE grants closed on finished_recving, so each request was released when it
    # ended (its free not delayed): nothing is left live in the ledger.
    expect_back = args.requests + args.live if side == "prefill" else 0
    clean = (
        gs["handed_back"] == expect_back
        and gs["exposed"] == gs["withheld"] == gs["open_grants"] == gs["live_requests"] == 0
        and gs["quarantined"] == gs["lease_reaped"] == gs["load_failed"] == 0
        and not gs["dropped"]
        and not gs["refused_evidence"]
    )
    if not clean:
        raise SystemExit(f"{side}: the guard did not hand every request back cleanly: {gs}")
    return g


_NOT_HOOKS = frozenset({"revoke", "stats"})
_LEDGER = (  # the guard's ledger (``StepLedger``): its step calls and the queries the guard makes
    "grant_many",
    "grant_read",
    "end_many",
    "prove",
    "collect",
    "open_access",
    "is_open",
    "blocks_under",
)


def guard_time(wl: Workload) -> dict[str, Any]:
    """One guarded run with the guard's methods and its ledger's timed (perf_counter around
    each call, on the instances: no profiler): us per request in each, and the scheduler's
    time per step of the same run."""
    run = wl.run(True)
    guard = run.s.connector.guard
    spent: dict[str, int] = {}
    calls: dict[str, int] = {}
    # The time in the outermost call of each kind only (a guard method calling another, or the
    # ledger calling itself, is counted once in the totals; each row is inclusive).
    outer = {"guard": 0, "ledger": 0}
    depth = {"guard": 0, "ledger": 0}

    def wrap(obj: Any, name: str, label: str) -> None:
        fn = getattr(obj, name)
        perf = time.perf_counter_ns
        kind = label.split(".", 1)[0]

        def timed(*a: Any, **k: Any) -> Any:
            depth[kind] += 1
            t0 = perf()
            try:
                return fn(*a, **k)
            finally:
                dt = perf() - t0
                depth[kind] -= 1
                if depth[kind] == 0:
                    outer[kind] += dt
                spent[label] = spent.get(label, 0) + dt
                calls[label] = calls.get(label, 0) + 1

        setattr(obj, name, timed)

    # The guard's hooks: its public methods but the way out and the stats (found on the class:
    # the guard's API is young).
    hooks = [
        k
        for k, fn in vars(type(guard)).items()
        if callable(fn) and k[0] != "_" and k not in _NOT_HOOKS
    ]
    for name in hooks:
        wrap(guard, name, f"guard.{name}")
    for name in _LEDGER:
        if hasattr(guard.ledger, name):
            wrap(guard.ledger, name, f"ledger.{name}")
    common.quiet_run(run.to_end)
    # The live requests' release is untimed set-up: counted neither here nor in sched_ns.
    for obj in (guard, guard.ledger):
        for name in list(vars(obj)):
            if name in hooks or name in _LEDGER:
                delattr(obj, name)
    run.release_live()
    n = wl.args.requests
    in_guard, ledger = outer["guard"], outer["ledger"]
    return {
        "us_per_request": {k: spent[k] / n / 1e3 for k in sorted(spent)},
        "calls": dict(sorted(calls.items())),
        "guard_us_per_request": in_guard / n / 1e3,
        "ledger_us_per_request": ledger / n / 1e3,
        "guard_outside_ledger_us_per_request": (in_guard - ledger) / n / 1e3,
        "guard_share_of_scheduler": in_guard / run.sched_ns,
    }


def profile(wl: Workload, top: int) -> list[dict[str, Any]]:
    """One guarded run under cProfile: the functions inside kvlifetime by own time."""
    run = wl.run(True)
    out: list[dict[str, Any]] = common.quiet_run(
        lambda: common.own_profile(run.to_end, wl.args.requests, top)
    )
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.vllm_scheduler")
    p.add_argument("--requests", type=int, default=1000, help="requests per engine and run")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--side", choices=("prefill", "decode", "both"), default="both")
    p.add_argument("--prompt-blocks", type=int, default=8, help="prompt length in 16-token blocks")
    p.add_argument("--decode-tokens", type=int, default=8, help="decode side: tokens per request")
    p.add_argument("--arrivals", type=int, default=16, help="requests added per step")
    p.add_argument("--lag", type=int, default=2, help="steps until the worker reports done")
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=4096)
    p.add_argument("--num-blocks", type=int, default=8192)
    p.add_argument(
        "--live",
        type=int,
        default=0,
        help="requests held live through the timed run (one block each, added to --num-blocks)",
    )
    p.add_argument("--profile-top", type=int, default=12, help="0: no cProfile run")
    p.add_argument("--out", type=Path, default=None, help="write the figures as JSON here")
    args = p.parse_args(argv)
    args.num_blocks += args.live
    common.write_hf_cache()
    v = _vllm()
    info = common.machine()
    print(
        f"vLLM {info['vllm']} Scheduler + NixlConnector (scheduler side), mocked model output; "
        f"{info['cores']} cores, Python {info['python']}, the ledger {info['ledger_build']}, "
        f"load average {info['loadavg'][0]}"
    )
    print(
        f"{args.requests} requests per run, prompts of {args.prompt_blocks} blocks, "
        f"{args.arrivals} arrivals per step, worker reports {args.lag} steps later, "
        f"{args.live} requests held live throughout; "
        f"{args.rounds} rounds, unguarded and guarded in lock-step; "
        "ratio guarded / unguarded per round: median [range]"
    )
    report: dict[str, Any] = {
        "bench": "vllm_scheduler",
        "machine": info,
        "config": {k: val for k, val in vars(args).items() if k != "out"},
        "timed": "schedule() + update_from_output(), per step",
        "target_ratio": TARGET,
        "sides": {},
    }
    sides = ("prefill", "decode") if args.side == "both" else (args.side,)
    rows = [["engine", "steps", "unguarded us/step", "guarded us/step", "ratio", "range", "target"]]
    for side in sides:
        wl = Workload(v, args, side)
        lockstep(wl, 0)  # warm-up: first calls, caches
        per_round: list[tuple[float, float]] = []
        work: dict[str, Any] = {}
        for rnd in range(args.rounds):
            plain, guarded = lockstep(wl, rnd)
            work = check(side, args, plain, guarded)
            per_round.append((plain.us_per_step(), guarded.us_per_step()))
        ratios = [g / u for u, g in per_round]
        u_med = statistics.median(u for u, _ in per_round)
        g_med = statistics.median(g for _, g in per_round)
        ratio = statistics.median(ratios)
        steps = work["steps"]
        entry: dict[str, Any] = {
            "steps": steps,
            "unguarded_us_per_step": u_med,
            "guarded_us_per_step": g_med,
            "ratio": ratio,
            "ratio_min": min(ratios),
            "ratio_max": max(ratios),
            "rounds_us_per_step": [{"unguarded": u, "guarded": g} for u, g in per_round],
            "unguarded_us_per_request": u_med * steps / args.requests,
            "added_us_per_request": (ratio - 1) * u_med * steps / args.requests,
            "work": work,
            "guard_time": guard_time(wl),
        }
        if args.profile_top:
            entry["profile_top_own"] = profile(wl, args.profile_top)
        report["sides"][side] = entry
        rows.append(
            [
                side,
                str(steps),
                f"{u_med:.0f}",
                f"{g_med:.0f}",
                f"{ratio:.3f}x",
                f"[{min(ratios):.3f}-{max(ratios):.3f}]",
                "ok" if ratio <= TARGET else f"above {TARGET}x",
            ]
        )
    print()
    print(common.table(rows))
    for side, e in report["sides"].items():
        w, gs, gt = e["work"], e["work"]["guard"], e["guard_time"]
        print(
            f"\n{side}: same work in both runs, every round ({w['steps']} steps, "
            f"{w['finished']} requests finished, all {w['free_blocks']} blocks free at the end; "
            f"guard: {gs['handed_back']} handed back, none exposed, withheld, quarantined or "
            "dropped, the ledger empty)"
        )
        print(
            f"  per request: vLLM {e['unguarded_us_per_request']:.1f} us, the guard adds "
            "(median ratio) "
            f"{e['added_us_per_request']:.1f} us; inside the guard's methods "
            f"{gt['guard_us_per_request']:.1f} us ({gt['guard_share_of_scheduler'] * 100:.0f}% "
            f"of the guarded scheduler's time), of which the ledger "
            f"{gt['ledger_us_per_request']:.1f} us"
        )
        print("  us per request in each (timed on the instances, no profiler):")
        for k, us in gt["us_per_request"].items():
            print(f"    {k:28s} {us:6.2f}   ({gt['calls'][k]} calls)")
        if e.get("profile_top_own"):
            print("  kvlifetime functions by own time (cProfile, 1 guarded run; inflated):")
            for f in e["profile_top_own"]:
                print(f"    {f['fn']:56s} {f['calls']:6d} calls {f['us_per_request']:6.2f} us/req")
    common.write_json(args.out, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
