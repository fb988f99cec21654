"""What a pausing vLLM waits for while the guard delays a free.

vLLM pauses and sleeps by stepping its scheduler until it holds no request: 0.34's
``EngineCore.pause_scheduler(clear_cache=True, reset_connector=False)`` (and ``sleep(level >=
1, reset_connector=False)``, which calls it) loops ``while scheduler.has_requests()``, so that
connector work still reading the KV cache ends before the cache is discarded. A request whose
free the guard delays (an ended request with an exposure not yet proven over, or quarantined)
is one vLLM still holds: the pause waits for it. It should: the pause then clears the cache and
may release its memory, and a peer still writing into it is the hazard the guard exists for.

So the guard never lets the pause return early. It says what the pause waits for:
``delayed_frees`` lists each request it delays and what would end the wait, and while the
scheduler is paused the connector logs ``guard_pause_waits`` (a warning) whenever that list
changes: the request ids, their states, and the way out. The wait ends by itself when the proof
comes (the inner connector's ``finished_sending`` / ``finished_recving``), or when the deployment
fences the peer and calls ``connector.guard.revoke(name)``: the next step hands the requests
back and the pause returns (``tests/in_vllm/test_vllm_pause.py`` runs vLLM 0.34's own
``pause_scheduler`` both ways).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import attrs
import structlog

_log = structlog.get_logger("kvlifetime.guard")

WAITS_FOR: dict[str, str] = {
    "withheld": "the inner connector's report that the peer's access is over (finished_sending "
    "for reads of its blocks, finished_recving for a load into them), or a fence: fence the "
    "peer, then connector.guard.revoke(name)",
    "quarantined": "a fence: no report can prove it over any more (a lease was reaped, a load "
    "failed or a deadline passed): fence the peer, then connector.guard.revoke(name)",
    "releasable": "the next scheduler step, which hands it back to vLLM",
    "receive_held": "a fence (its load failed: what still lands is unknown): fence the peer, "
    "then connector.guard.revoke(name); vLLM then gets the receive and recovers",
}
"""For each state in which the guard keeps a request vLLM would otherwise let go: what ends it."""


@attrs.frozen(slots=True)
class DelayedFree:
    """One request vLLM still holds because the guard delays it, and what would end that."""

    request: str
    state: str  # its state of the engine-side lifecycle (docs/engine.md)
    waits_for: str  # WAITS_FOR[state]


def delayed_frees(holds: Iterable[tuple[str, Any]]) -> tuple[DelayedFree, ...]:
    """The guard's holds (``(request, hold)`` pairs, oldest first) that keep vLLM holding the
    request: each with what it waits for. From any thread: ``Holds`` iterates a snapshot of
    its table (each state as read at that moment)."""
    return tuple(
        DelayedFree(request, hold.state, WAITS_FOR[hold.state])
        for request, hold in holds
        if hold.state in WAITS_FOR
    )


LISTED = 32
"""At most this many requests are named in one ``guard_pause_waits`` event (``count`` says
how many there are)."""


class PauseWatch:
    """While the scheduler is paused: a ``guard_pause_waits`` warning each time the delayed
    requests or their states change (once per change, not once per step; a request gone from
    withheld to quarantined changes what it waits for). Scheduler thread only."""

    def __init__(self) -> None:
        self._last: frozenset[tuple[str, str]] = frozenset()

    def step(self, paused: bool, holds: Iterable[tuple[str, Any]]) -> tuple[DelayedFree, ...]:
        """One scheduler step: what a paused engine waits for (empty when not paused)."""
        if not paused:
            self._last = frozenset()
            return ()
        frees = delayed_frees(holds)
        now = frozenset((f.request, f.state) for f in frees)
        if now and now != self._last:
            _log.warning(
                "guard_pause_waits",
                engine="vllm",
                count=len(frees),
                requests=[f.request for f in frees[:LISTED]],
                states=[f.state for f in frees[:LISTED]],
                waits_for=sorted({f.waits_for for f in frees}),
                why="vLLM's pause steps until it holds no request; the guard keeps these until "
                "their peers' access is proven over or fenced",
            )
        self._last = now
        return frees


__all__ = ["LISTED", "WAITS_FOR", "DelayedFree", "PauseWatch", "delayed_frees"]
