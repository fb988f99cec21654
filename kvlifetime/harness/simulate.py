"""``kvlifetime simulate`` and the harness part of ``kvlifetime demo``.

Light at import time on purpose: the CLI builds its parser from here for every command, and
``kvlifetime table`` must not pay for numpy, ZeroMQ or a transfer engine.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, TextIO

if TYPE_CHECKING:
    from kvlifetime.harness.report import Report

POLICIES: tuple[str, ...] = ("naive", "timeout", "proof")
PULL_POLICIES: tuple[str, ...] = ("naive", "lease", "proof")  # harness.pull: decode reads
DIRECTIONS: tuple[str, ...] = ("push", "pull")
BACKENDS: tuple[str, ...] = ("inproc", "mooncake", "nixl")
RESTARTS: tuple[str, ...] = ("none", "naive", "guarded")
DEMO_REQUESTS = 10_000
DEMO_SEED = 2026


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--backend", choices=BACKENDS, default="inproc")
    p.add_argument(
        "--direction",
        choices=DIRECTIONS,
        default="push",
        help="push: prefill writes into decode's blocks (SGLang, Mooncake); pull: decode reads "
        "prefill's source blocks (vLLM's NIXL path; policies naive, lease, proof)",
    )
    p.add_argument("--policy", choices=(*POLICIES, "lease"), default="proof")
    p.add_argument("--requests", type=int, default=1000, metavar="N")
    p.add_argument("--seed", type=int, default=0, metavar="S")
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
        type=int,
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
        type=float,
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
    p.add_argument("--json", action="store_true", help="end with the report as one JSON line")


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


def _require_backend(backend: str) -> None:
    if backend == "nixl":
        from kvlifetime.adapters.nixl import nixl_available, require_tcp
        from kvlifetime.errors import UsageError

        if not nixl_available():
            raise UsageError(
                "backend nixl needs NIXL's Python package: pip install --no-deps nixl==1.5.1 "
                "nixl-cu13==1.5.1 (the lean install: no torch, no CUDA libraries; `make` does "
                "it)"
            )
        require_tcp()  # UCX_TLS other than tcp: the initiator would write decode's memory itself
    if backend == "mooncake":
        from kvlifetime.adapters.mooncake import mooncake_available
        from kvlifetime.errors import UsageError

        if not mooncake_available():
            raise UsageError(
                "backend mooncake needs mooncake-transfer-engine-non-cuda (pip install "
                "'kvlifetime[mooncake]') and Debian's libibverbs1"
            )


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
) -> Report:
    from kvlifetime.errors import UsageError

    if direction == "pull":
        if topology and topology != topology_faults():
            raise UsageError("the topology knobs are push-only")
        return _simulate_pull(backend, policy, requests, seed, stream, restart, fence)
    if direction != "push":
        raise UsageError(f"unknown direction {direction!r} ({', '.join(DIRECTIONS)})")
    if policy not in POLICIES:
        raise UsageError(f"policy {policy!r} is for --direction pull; push: {', '.join(POLICIES)}")
    from kvlifetime.harness.decode import SimConfig, run
    from kvlifetime.harness.faults import FaultConfig

    _require_backend(backend)
    if topology and topology.get("land_after_crash") and backend != "inproc":
        raise UsageError("--land-after-crash models a transport on the in-process engine only")
    err = sys.stderr if stream is None else stream
    cfg = SimConfig(
        backend=backend,
        policy=policy,
        requests=requests,
        seed=seed,
        restart=restart,
        fence=fence,
        faults=FaultConfig(**topology) if topology else FaultConfig(),  # type: ignore[arg-type]
    )
    return run(cfg, progress=lambda line: print(line, file=err, flush=True))


def _simulate_pull(
    backend: str,
    policy: str,
    requests: int,
    seed: int,
    stream: TextIO | None,
    restart: str,
    fence: bool,
) -> Report:
    from kvlifetime.errors import UsageError
    from kvlifetime.harness.pull import PullConfig, run_pull

    if policy not in PULL_POLICIES:
        raise UsageError(f"policy {policy!r} is push-only; pull: {', '.join(PULL_POLICIES)}")
    if restart != "none":
        raise UsageError("--restart is push-only (the pull harness restarts no owner)")
    _require_backend(backend)
    err = sys.stderr if stream is None else stream
    cfg = PullConfig(backend=backend, policy=policy, requests=requests, seed=seed, fence=fence)
    return run_pull(cfg, progress=lambda line: print(line, file=err, flush=True))


def run_command(args: argparse.Namespace) -> int:
    report = simulate(
        args.backend,
        args.policy,
        args.requests,
        args.seed,
        restart=args.restart,
        fence=args.fence,
        direction=getattr(args, "direction", "push"),
        topology=topology_faults(
            args.tp_ranks, args.land_after_crash, args.p_redeliver, args.redeliver_after_done
        ),
    )
    sys.stdout.write(report.to_text())
    if args.json:
        sys.stdout.write(report.to_json() + "\n")  # the last line of output
    return 0


def demo_harness(
    out: Path,
    backend: str,
    stream: TextIO,
    *,
    requests: int = DEMO_REQUESTS,
    seed: int = DEMO_SEED,
    policies: Sequence[str] = POLICIES,
    restarts: Sequence[str] = ("naive", "guarded"),
    pulls: Sequence[str] = PULL_POLICIES,
    topology_policies: Sequence[str] = ("naive", "proof"),
) -> list[Path]:
    """Run the harness once per policy under one seed, then naive and proof with every
    topology knob on, then the proof policy with each decode restart, then the pull direction
    once per pull policy; write out/report.txt, report.json and harness-table.md."""
    from kvlifetime.harness.report import compare_markdown

    reports = []
    plain = topology_faults()
    # Every topology knob on: two prefill ranks per request, a dead initiator's handed-over
    # writes landing after it (the in-process engine models it), re-delivered slices.
    every = topology_faults(tp_ranks=2, land_after_crash=backend == "inproc", p_redeliver=0.02)
    runs = [(policy, "none", "push", plain) for policy in policies]
    runs += [(policy, "none", "push", every) for policy in topology_policies]
    # A decode restart mid-run, naive vs guarded, under the proof policy.
    runs += [("proof", restart, "push", plain) for restart in restarts]
    # vLLM's direction: decode reads prefill's blocks.
    runs += [(policy, "none", "pull", plain) for policy in pulls]
    for policy, restart, direction, topology in runs:
        what = f"{direction}, policy {policy}"
        what += f", decode restart {restart}" if restart != "none" else ""
        what += ", every topology knob on" if topology is every else ""
        stream.write(f"\nsimulating {requests} requests, backend {backend}, {what} ...\n")
        stream.flush()
        r = simulate(
            backend,
            policy,
            requests,
            seed,
            stream,
            restart=restart,
            direction=direction,
            topology=topology,
        )
        stream.write(r.to_text())
        reports.append(r)
    table = compare_markdown(reports)
    stream.write("\n" + table)
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
    return [txt, js, md]
