"""One harness run from plain arguments: ``simulate(backend, policy, requests, seed, ...)``.

What the command line and the demo call (``kvlifetime.cli``); a library caller may as well build
``PushSettings`` / ``PullSettings`` and call ``harness.loop.run``. Light at import: the loop,
numpy, ZeroMQ and the transfer engines are imported when a run starts.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TextIO

import attrs

from kvlifetime.harness.settings import DIRECTIONS, PullSettings, PushSettings, RunSettings

if TYPE_CHECKING:
    from kvlifetime.harness.result import RunResult


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
    from kvlifetime.adapters.engines import require_engine
    from kvlifetime.extras import require

    require("harness", what)
    require_engine(backend, what)


@attrs.frozen(slots=True)
class Narration:
    """Where one harness run says what it does: its event lines.

    ``log`` set: each event line is an ``harness_event`` at info level (the command line shows
    them with ``-v``); unset: the lines are printed to ``stream`` (stderr by default), as a
    library caller who passed neither expects.
    """

    stream: TextIO | None = None
    log: Any = None  # a structlog bound logger, or None
    what: str = "the harness"  # named in a MissingExtra: what needed the extra

    def line(self, run: str) -> Callable[[str], None]:
        if self.log is not None:
            log = self.log
            return lambda line: log.info("harness_event", run=run, message=line)
        err = sys.stderr if self.stream is None else self.stream
        return lambda line: print(line, file=err, flush=True)


def settings_for(
    backend: str,
    policy: str,
    requests: int,
    seed: int,
    *,
    restart: str = "none",
    fence: bool = True,
    direction: str = "push",
    topology: dict[str, object] | None = None,
) -> RunSettings:
    """The settings of one run from the command line's arguments (``UsageError`` naming the
    first that does not fit: an unknown direction, a push-only knob when pulling)."""
    from kvlifetime.errors import UsageError

    if direction == "pull":
        if topology and topology != topology_faults():
            raise UsageError("the topology knobs are push-only")
        if restart != "none":
            raise UsageError("--restart is push-only (the pull harness restarts no owner)")
        return PullSettings(
            backend=backend, policy=policy, requests=requests, seed=seed, fence=fence
        )
    if direction != "push":
        raise UsageError(f"unknown direction {direction!r} ({', '.join(DIRECTIONS)})")
    if topology and topology.get("land_after_crash") and backend != "inproc":
        raise UsageError("--land-after-crash models a transport on the in-process engine only")
    from kvlifetime.harness.faults import FaultConfig

    return PushSettings(
        backend=backend,
        policy=policy,
        requests=requests,
        seed=seed,
        restart=restart,
        fence=fence,
        faults=FaultConfig(**topology) if topology else FaultConfig(),  # type: ignore[arg-type]
    )


def run_narrated(
    settings: RunSettings,
    narration: Narration | None = None,
    *,
    on_tick: Callable[[int], None] | None = None,
) -> RunResult:
    """Run ``settings`` (``require_backend`` first), saying what it does as ``narration``
    says; ``on_tick`` takes the number of requests admitted so far."""
    from kvlifetime.harness.loop import run

    narration = Narration() if narration is None else narration
    return run(settings, progress=narration.line(settings.name), on_tick=on_tick)


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
    on_tick: Callable[[int], None] | None = None,
) -> RunResult:
    """One harness run; its event lines go to ``stream`` (stderr by default) unless
    ``narration`` says otherwise."""
    narration = Narration(stream) if narration is None else narration
    require_backend(backend, narration.what)
    settings = settings_for(
        backend,
        policy,
        requests,
        seed,
        restart=restart,
        fence=fence,
        direction=direction,
        topology=topology,
    )
    return run_narrated(settings, narration, on_tick=on_tick)
