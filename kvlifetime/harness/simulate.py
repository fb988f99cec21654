"""``kvlifetime simulate`` and the harness part of ``kvlifetime demo``.

Light at import time on purpose: the CLI builds its parser from here for every command, and
``kvlifetime table`` must not pay for numpy, ZeroMQ or a transfer engine.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

import attrs

if TYPE_CHECKING:
    from kvlifetime.harness.report import Report

POLICIES: tuple[str, ...] = ("naive", "timeout", "proof")
PULL_POLICIES: tuple[str, ...] = ("naive", "lease", "proof")  # harness.pull: decode reads
DIRECTIONS: tuple[str, ...] = ("push", "pull")
BACKENDS: tuple[str, ...] = ("inproc", "mooncake", "nixl")
RESTARTS: tuple[str, ...] = ("none", "naive", "guarded")
DEMO_REQUESTS = 1_000  # about a minute for the ten runs and the page on 2 cores
FULL_REQUESTS = 10_000  # the acceptance size: make demo DEMO_ARGS="--requests 10000"
DEMO_SEED = 2026


def add_arguments(p: argparse.ArgumentParser) -> None:
    from kvlifetime.cli.output import bounded_int, probability

    p.add_argument(
        "--backend",
        choices=BACKENDS,
        default="inproc",
        help="the transfer engine: inproc (in-process threads, no extra engine), mooncake "
        "(Mooncake TCP), nixl (NIXL over UCX/TCP)",
    )
    p.add_argument(
        "--direction",
        choices=DIRECTIONS,
        default="push",
        help="push: prefill writes into decode's blocks (SGLang, Mooncake); pull: decode reads "
        "prefill's source blocks (vLLM's NIXL path; policies naive, lease, proof)",
    )
    p.add_argument(
        "--policy",
        choices=(*POLICIES, "lease"),
        default="proof",
        help="when decode frees blocks: naive (on reject), timeout / lease (at a deadline), "
        "proof (only what the evidence proves)",
    )
    p.add_argument(
        "--requests", type=bounded_int(1), default=1000, metavar="N", help="requests admitted"
    )
    p.add_argument(
        "--seed", type=bounded_int(0), default=0, metavar="S", help="the faults' random seed"
    )
    p.add_argument(
        "--restart",
        choices=RESTARTS,
        default="none",
        help="restart decode mid-run over the same arena while prefill's writes still land: "
        "naive (every block free) or guarded (every block quarantined until fenced)",
    )
    p.add_argument(
        "--no-fence",
        dest="fence",
        action="store_false",
        help="proof policy: never fence (quarantined blocks stay out of the pool)",
    )
    p.add_argument(
        "--tp-ranks",
        type=bounded_int(1, 16),
        default=1,
        metavar="K",
        help="push: each request is written by K prefill ranks (tensor parallel), each its own "
        "process, socket and grant; release needs every rank's proof",
    )
    p.add_argument(
        "--land-after-crash",
        action="store_true",
        help="push, inproc: what a crashed prefill had handed over still lands, from the "
        "target's side, unless a fence discards it",
    )
    p.add_argument(
        "--p-redeliver",
        type=probability,
        default=0.0,
        metavar="P",
        help="push: per batch, the transport applies one of its slices again, 1..12 ticks later",
    )
    p.add_argument(
        "--redeliver-after-done",
        action="store_true",
        help="with --p-redeliver: the transport reports DONE before the re-delivery lands (a "
        "transport that lies about DONE; nothing the ledger is told can protect against it)",
    )
    p.add_argument(
        "--json",
        action="store_true",
        help="stdout is the report as exactly one JSON document (the text report and the "
        "progress go to stderr)",
    )
    p.add_argument(
        "--log-json",
        type=Path,
        default=None,
        metavar="FILE",
        help="also write the ledger's events as JSON lines to FILE, the log kvlifetime replay "
        "checks",
    )


def topology_faults(
    tp_ranks: int = 1,
    land_after_crash: bool = False,
    p_redeliver: float = 0.0,
    redeliver_after_done: bool = False,
) -> dict[str, object]:
    """The ``FaultConfig`` fields of the topology knobs (the others keep their defaults)."""
    return {
        "tp_ranks": tp_ranks,
        "land_after_crash": land_after_crash,
        "p_redeliver": p_redeliver,
        "redeliver_after_done": redeliver_after_done,
    }


def require_backend(backend: str, what: str) -> None:
    """Refuse before anything runs when the harness or the backend's engine is not installed."""
    from kvlifetime.extras import require

    require("harness", what)
    if backend == "nixl":
        from kvlifetime.adapters.nixl import nixl_available, require_tcp

        require("nixl", f"{what} --backend nixl")
        if not nixl_available():
            from kvlifetime.errors import UsageError

            raise UsageError(
                "backend nixl: NIXL is installed but its engine does not import (reinstall "
                "it lean: pip install --no-deps nixl==1.5.1 nixl-cu13==1.5.1)"
            )
        require_tcp()  # UCX_TLS other than tcp: the initiator would write decode's memory itself
    if backend == "mooncake":
        from kvlifetime.adapters.mooncake import mooncake_available

        require("mooncake", f"{what} --backend mooncake")
        if not mooncake_available():
            from kvlifetime.errors import UsageError

            raise UsageError(
                "backend mooncake: mooncake-transfer-engine-non-cuda is installed but its "
                "engine does not import (it needs Debian's libibverbs1: apt-get install "
                "libibverbs1)"
            )


@attrs.frozen(slots=True)
class Narration:
    """Where one harness run says what it does: its event lines and its progress bar.

    ``log`` set: each event line is an ``harness_event`` at info level (the command line shows
    them with ``-v``); unset: the lines are printed to ``stream`` (stderr by default), as a
    library caller who passed neither expects. ``show_progress``: the requests-admitted bar on
    stderr (True, False, or None: when stderr is a terminal).
    """

    stream: TextIO | None = None
    log: Any = None  # a structlog bound logger, or None
    show_progress: bool | None = False
    what: str = "the harness"  # named in a MissingExtra: what needed the extra

    def line(self, run: str) -> Callable[[str], None]:
        if self.log is not None:
            log = self.log
            return lambda line: log.info("harness_event", run=run, message=line)
        err = sys.stderr if self.stream is None else self.stream
        return lambda line: print(line, file=err, flush=True)


def simulate(
    backend: str,
    policy: str,
    requests: int,
    seed: int,
    stream: TextIO | None = None,
    *,
    restart: str = "none",
    fence: bool = True,
    direction: str = "push",
    topology: dict[str, object] | None = None,
    narration: Narration | None = None,
) -> Report:
    """One harness run; ``KeyboardInterrupt`` inside it is raised as ``Interrupted`` with the
    requests admitted so far (every process and socket it started is gone by then)."""
    from kvlifetime.errors import UsageError

    narration = Narration(stream) if narration is None else narration
    if direction == "pull":
        if topology and topology != topology_faults():
            raise UsageError("the topology knobs are push-only")
        return _simulate_pull(backend, policy, requests, seed, restart, fence, narration)
    if direction != "push":
        raise UsageError(f"unknown direction {direction!r} ({', '.join(DIRECTIONS)})")
    if policy not in POLICIES:
        raise UsageError(f"policy {policy!r} is for --direction pull; push: {', '.join(POLICIES)}")
    require_backend(backend, narration.what)
    from kvlifetime.harness.decode import SimConfig, run
    from kvlifetime.harness.faults import FaultConfig

    if topology and topology.get("land_after_crash") and backend != "inproc":
        raise UsageError("--land-after-crash models a transport on the in-process engine only")
    cfg = SimConfig(
        backend=backend,
        policy=policy,
        requests=requests,
        seed=seed,
        restart=restart,
        fence=fence,
        faults=FaultConfig(**topology) if topology else FaultConfig(),  # type: ignore[arg-type]
    )
    name = f"push {policy}" + (f", restart {restart}" if restart != "none" else "")
    with _progress(requests, name, narration) as bar:
        return run(cfg, progress=narration.line(name), on_tick=bar.set)


def _progress(requests: int, name: str, narration: Narration) -> Any:
    from kvlifetime.cli.output import progress

    return progress(requests, name, "requests", show=narration.show_progress)


def _simulate_pull(
    backend: str,
    policy: str,
    requests: int,
    seed: int,
    restart: str,
    fence: bool,
    narration: Narration,
) -> Report:
    from kvlifetime.errors import UsageError

    if policy not in PULL_POLICIES:
        raise UsageError(f"policy {policy!r} is push-only; pull: {', '.join(PULL_POLICIES)}")
    if restart != "none":
        raise UsageError("--restart is push-only (the pull harness restarts no owner)")
    require_backend(backend, narration.what)
    from kvlifetime.harness.pull import PullConfig, run_pull

    cfg = PullConfig(backend=backend, policy=policy, requests=requests, seed=seed, fence=fence)
    name = f"pull {policy}"
    with _progress(requests, name, narration) as bar:
        return run_pull(cfg, progress=narration.line(name), on_tick=bar.set)


def run_command(args: argparse.Namespace) -> int:
    """``kvlifetime simulate``: the text report on stdout, or with ``--json`` on stderr and the
    report as the one JSON document on stdout."""
    import contextlib

    from kvlifetime.cli.eventlog import event_log

    narration = Narration(log=args.log, show_progress=args.progress, what="kvlifetime simulate")
    with contextlib.ExitStack() as stack:
        if args.log_json is not None:
            require_backend(args.backend, "kvlifetime simulate")  # before the file is made
            stack.enter_context(event_log(args.log_json))
        report = simulate(
            args.backend,
            args.policy,
            args.requests,
            args.seed,
            restart=args.restart,
            fence=args.fence,
            direction=args.direction,
            topology=topology_faults(
                args.tp_ranks, args.land_after_crash, args.p_redeliver, args.redeliver_after_done
            ),
            narration=narration,
        )
    if args.json:
        sys.stderr.write(report.to_text())
        sys.stdout.write(report.to_json() + "\n")
    else:
        sys.stdout.write(report.to_text())
    return 0


def demo_runs(backend: str) -> list[DemoRun]:
    """The ten runs of ``kvlifetime demo``, in order: each push policy; naive and proof with
    every topology knob on; the proof policy with each decode restart; each pull policy."""
    plain = topology_faults()
    # Every topology knob on: two prefill ranks per request, a dead initiator's handed-over
    # writes landing after it (the in-process engine models it), re-delivered slices.
    every = topology_faults(tp_ranks=2, land_after_crash=backend == "inproc", p_redeliver=0.02)
    runs = [DemoRun("push", policy, "none", plain, "") for policy in POLICIES]
    runs += [
        DemoRun("push", policy, "none", every, "every topology knob on")
        for policy in ("naive", "proof")
    ]
    # A decode restart mid-run, naive vs guarded, under the proof policy.
    runs += [DemoRun("push", "proof", restart, plain, "") for restart in ("naive", "guarded")]
    # vLLM's direction: decode reads prefill's blocks.
    runs += [DemoRun("pull", policy, "none", plain, "") for policy in PULL_POLICIES]
    return runs


@attrs.frozen(slots=True)
class DemoRun:
    """One harness run of the demo."""

    direction: str  # push / pull
    policy: str
    restart: str  # none / naive / guarded
    topology: dict[str, object]  # topology_faults(...)
    knobs: str  # what the topology turns on, in words ("" for none)

    @property
    def title(self) -> str:
        what = f"{self.direction}, {self.policy}"
        what += f", decode restart {self.restart}" if self.restart != "none" else ""
        return what + (f", {self.knobs}" if self.knobs else "")


def demo_harness(
    out: Path,
    backend: str,
    *,
    requests: int = DEMO_REQUESTS,
    seed: int = DEMO_SEED,
    narration: Narration | None = None,
    on_start: Callable[[int, int, DemoRun], None] | None = None,
    on_done: Callable[[int, int, DemoRun, Report], None] | None = None,
) -> tuple[list[Report], list[Path]]:
    """Run ``demo_runs(backend)`` under one seed; write out/report.txt (every run in full and
    the comparison), report.json (what ``kvlifetime report`` reads) and harness-table.md.
    ``on_start`` / ``on_done`` are told of each run as it starts and ends (a progress line).

    Ctrl-C ends it with ``Interrupted`` saying how many runs finished; nothing is written to
    ``out`` then."""
    from kvlifetime.cli.output import interrupted
    from kvlifetime.harness.report import compare_markdown

    narration = Narration() if narration is None else narration
    reports: list[Report] = []
    runs = demo_runs(backend)
    try:
        for i, run in enumerate(runs, 1):
            if on_start is not None:
                on_start(i, len(runs), run)
            r = simulate(
                backend,
                run.policy,
                requests,
                seed,
                restart=run.restart,
                direction=run.direction,
                topology=run.topology,
                narration=narration,
            )
            reports.append(r)
            if on_done is not None:
                on_done(i, len(runs), run, r)
    except KeyboardInterrupt as e:
        done = (
            f"{len(reports)} of {len(runs)} harness runs finished; {out / 'report.*'} not written"
        )
        raise interrupted(done, e) from e
    table = compare_markdown(reports)
    out.mkdir(parents=True, exist_ok=True)
    txt = out / "report.txt"
    txt.write_text(
        "".join(r.to_text() + "\n" for r in reports) + table, encoding="utf-8", newline="\n"
    )
    js = out / "report.json"
    js.write_text(
        json.dumps([r.to_dict() for r in reports], indent=2, sort_keys=True) + "\n",
        encoding="utf-8",
        newline="\n",
    )
    md = out / "harness-table.md"
    md.write_text(table, encoding="utf-8", newline="\n")
    return reports, [txt, js, md]
