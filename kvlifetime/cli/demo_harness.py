"""The harness part of ``kvlifetime demo``: ten runs under one seed, side by side, written to
the demo's folder (report.txt, report.json, harness-table.md)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import attrs

from kvlifetime.harness.settings import POLICIES
from kvlifetime.harness.simulate import topology_faults

if TYPE_CHECKING:
    from kvlifetime.harness.result import RunResult
    from kvlifetime.harness.simulate import Narration

DEMO_REQUESTS = 1_000  # about a minute for the ten runs and the page on 2 cores
FULL_REQUESTS = 10_000  # the acceptance size: make demo DEMO_ARGS="--requests 10000"
DEMO_SEED = 2026


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
    runs += [DemoRun("pull", policy, "none", plain, "") for policy in POLICIES]
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
    show_progress: bool | None = False,
    on_start: Callable[[int, int, DemoRun], None] | None = None,
    on_done: Callable[[int, int, DemoRun, RunResult], None] | None = None,
) -> tuple[list[RunResult], list[Path]]:
    """Run ``demo_runs(backend)`` under one seed; write out/report.txt (every run in full and
    the comparison), report.json (what ``kvlifetime report`` reads) and harness-table.md.
    ``on_start`` / ``on_done`` are told of each run as it starts and ends (a progress line);
    ``show_progress``: each run's requests-admitted bar on stderr (None: when a terminal).

    Ctrl-C ends it with ``Interrupted`` saying how many runs finished; nothing is written to
    ``out`` then."""
    from kvlifetime.cli.output import interrupted, progress
    from kvlifetime.harness import simulate as sim
    from kvlifetime.harness.result import compare_markdown

    narration = sim.Narration() if narration is None else narration
    sim.require_backend(backend, narration.what)
    reports: list[RunResult] = []
    runs = demo_runs(backend)
    try:
        for i, run in enumerate(runs, 1):
            if on_start is not None:
                on_start(i, len(runs), run)
            settings = sim.settings_for(
                backend,
                run.policy,
                requests,
                seed,
                restart=run.restart,
                direction=run.direction,
                topology=run.topology,
            )
            with progress(requests, settings.name, "requests", show=show_progress) as bar:
                r = sim.run_narrated(settings, narration, on_tick=bar.set)
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
