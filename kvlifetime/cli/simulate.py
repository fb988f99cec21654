"""``simulate``: one harness run, its report on stdout (or its JSON with ``--json``)."""

from __future__ import annotations

import argparse
import contextlib
import sys
from pathlib import Path


def add_arguments(p: argparse.ArgumentParser) -> None:
    from kvlifetime.adapters.engines import BACKENDS
    from kvlifetime.cli.output import bounded_int, probability
    from kvlifetime.harness.settings import DIRECTIONS, POLICIES, RESTARTS

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
        "prefill's source blocks (vLLM's NIXL path)",
    )
    p.add_argument(
        "--policy",
        choices=POLICIES,
        default="proof",
        help="when the memory owner frees blocks: naive (when the request ends), timeout (at a "
        "deadline, as a lease reaper does), proof (only what the evidence proves)",
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


def run(args: argparse.Namespace) -> int:
    """The text report on stdout, or with ``--json`` on stderr and the report as the one JSON
    document on stdout."""
    from kvlifetime.cli.eventlog import event_log
    from kvlifetime.cli.output import progress
    from kvlifetime.harness.simulate import (
        Narration,
        require_backend,
        run_narrated,
        settings_for,
        topology_faults,
    )

    narration = Narration(log=args.log, what="kvlifetime simulate")
    require_backend(args.backend, narration.what)
    settings = settings_for(
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
    )
    with contextlib.ExitStack() as stack:
        if args.log_json is not None:
            stack.enter_context(event_log(args.log_json))  # once the run's arguments are good
        bar = stack.enter_context(
            progress(settings.requests, settings.name, "requests", show=args.progress)
        )
        result = run_narrated(settings, narration, on_tick=bar.set)
    if args.json:
        sys.stderr.write(result.to_text())
        sys.stdout.write(result.to_json() + "\n")
    else:
        sys.stdout.write(result.to_text())
    return 0
