"""A pause or sleep with ``reset_connector=False`` while the guard delays a free (issue 33).

vLLM 0.34's ``EngineCore.pause_scheduler(clear_cache=True, reset_connector=False)`` (which
``sleep(level >= 1, reset_connector=False)`` calls) steps the scheduler ``while
scheduler.has_requests()``. A request the guard delays is one vLLM still holds: the pause waits
for it, and must (the cache it then clears may still be a peer's target). These run vLLM 0.34's
own ``pause_scheduler`` code on its real scheduler, in a thread, with the engine's step being
the scheduler's ``schedule`` and ``update_from_output`` (the model runner's part is what the
test feeds in), and show: it waits, and says what for (``guard_pause_waits``, once per change,
and ``guard.delayed_frees()``); it returns once the proof comes, or once a fence is applied.
"""

from __future__ import annotations

import queue
import threading
import time
from types import SimpleNamespace
from typing import Any

import pytest
import vllm
from structlog.testing import capture_logs

from kvlifetime.integrations.vllm import facts

if facts.series(vllm.__version__) != "0.34":
    pytest.skip("vLLM 0.34's pause loop: run in the 0.34 venv", allow_module_level=True)

from vllm.v1.engine.core import CheckpointState, EngineCore
from vllm.v1.request import RequestStatus

from kvlifetime.integrations.vllm.connector import GuardedConnector
from kvlifetime.integrations.vllm.pause import WAITS_FOR
from kvlifetime.integrations.vllm.testing import (
    blocks_of,
    free_in_pool,
    output,
    request,
    scheduler,
    step,
)


class _Engine:
    """What ``EngineCore.pause_scheduler`` reads of its engine: the scheduler, an empty batch
    queue, one step (the scheduler's own, with the worker's report the test feeds in), and the
    end of the pause (recorded)."""

    # vLLM's own methods, run on this engine: sleep pauses through pause_scheduler.
    pause_scheduler = EngineCore.pause_scheduler
    sleep = EngineCore.sleep

    def __init__(self, s: Any) -> None:
        self.scheduler = s
        self.batch_queue = None
        self._checkpoint_state = CheckpointState.RUNNING
        self.slept: list[int] = []
        self.model_executor = SimpleNamespace(sleep=self.slept.append)
        self.reports: queue.Queue[Any] = queue.Queue()
        self.steps = 0
        self.finished = threading.Event()

    def step_fn(self) -> tuple[Any, bool]:
        try:
            report = self.reports.get_nowait()
        except queue.Empty:
            report = output()
        so = self.scheduler.schedule()
        self.scheduler.update_from_output(so, report)
        self.steps += 1
        return {}, False

    def post_step(self, model_executed: bool) -> None:
        pass

    def _finish_pause(self, clear_cache: bool, reset_connector: bool) -> None:
        assert clear_cache and not reset_connector
        self.finished.set()


def _pause_in_thread(engine: _Engine) -> threading.Thread:
    def run() -> None:
        EngineCore.pause_scheduler(
            engine,
            mode="abort",
            clear_cache=True,
            reset_connector=False,
        )

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def _wait(cond: Any, seconds: float = 10.0) -> None:
    deadline = time.monotonic() + seconds
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError("timed out")
        time.sleep(0.005)


def _delayed(reaped: bool) -> tuple[Any, Any, list[int], Any, _Engine]:
    """A prefill engine whose request finished and whose blocks a remote decoder reads (the
    guard delays the free); ``reaped``: then its send lease was reaped (quarantined). Returns
    the scheduler, the request, its blocks, the guarded connector and the engine around it."""
    s = scheduler(guarded=True)
    r = request(remote_decode=True)
    s.add_request(r)
    step(s, output([r]))
    assert r.status == RequestStatus.FINISHED_LENGTH_CAPPED
    if reaped:
        step(s, output(finished_sending={r.request_id}, lease_reaped={r.request_id}))
    conn = s.connector
    assert isinstance(conn, GuardedConnector) and conn.guard is not None
    return s, r, blocks_of(s, r), conn, _Engine(s)


def _waits(logs: list[Any]) -> list[Any]:
    return [e for e in logs if e["event"] == "guard_pause_waits"]


def test_a_pause_waits_for_the_proof_says_what_for_and_returns_once_it_comes() -> None:
    s, r, ids, conn, engine = _delayed(reaped=False)
    with capture_logs() as logs:
        t = _pause_in_thread(engine)
        _wait(lambda: engine.steps >= 20)
        assert t.is_alive() and not engine.finished.is_set()  # waiting, as it must
        waits = _waits(logs)
        assert len(waits) == 1  # once per change, not once per step
        assert waits[0]["requests"] == [r.request_id]
        assert waits[0]["states"] == ["withheld"]
        assert waits[0]["log_level"] == "warning"
        (delayed,) = conn.guard.delayed_frees()
        assert (delayed.request, delayed.state) == (r.request_id, "withheld")
        assert delayed.waits_for == WAITS_FOR["withheld"]
        assert not free_in_pool(s, ids)
        engine.reports.put(output(finished_sending={r.request_id}))  # the decoder's reads ended
        t.join(10)
    assert not t.is_alive() and engine.finished.is_set()
    assert r.request_id not in s.requests
    assert free_in_pool(s, ids) == ids
    assert conn.guard.delayed_frees() == ()


def test_a_pause_on_a_quarantined_request_returns_once_fenced() -> None:
    s, r, ids, conn, engine = _delayed(reaped=True)
    with capture_logs() as logs:
        t = _pause_in_thread(engine)
        _wait(lambda: bool(_waits(logs)))
        wait = _waits(logs)[0]
        assert wait["states"] == ["quarantined"]
        assert wait["waits_for"] == [WAITS_FOR["quarantined"]]
        assert "revoke" in WAITS_FOR["quarantined"]
        _wait(lambda: engine.steps >= 20)
        assert t.is_alive()
        # A proof can no longer come: a repeated report changes nothing.
        engine.reports.put(output(finished_sending={r.request_id}))
        _wait(lambda: engine.steps >= 40)
        assert t.is_alive() and not free_in_pool(s, ids)
        conn.guard.revoke("nixl_agent_recreated")  # from this (an operator's) thread
        t.join(10)
    assert not t.is_alive() and engine.finished.is_set()
    assert free_in_pool(s, ids) == ids


def test_a_wait_that_changes_what_it_waits_for_is_said_again() -> None:
    # Withheld (waiting for the decoder's proof), then its lease is reaped during the pause:
    # quarantined, only a fence ends it now. The operator is told, not left waiting for a
    # proof that can no longer come.
    s, r, ids, conn, engine = _delayed(reaped=False)
    with capture_logs() as logs:
        t = _pause_in_thread(engine)
        _wait(lambda: len(_waits(logs)) == 1)
        assert _waits(logs)[0]["states"] == ["withheld"] and _waits(logs)[0]["count"] == 1
        engine.reports.put(output(finished_sending={r.request_id}, lease_reaped={r.request_id}))
        _wait(lambda: len(_waits(logs)) == 2)
        assert _waits(logs)[1]["states"] == ["quarantined"]
        assert _waits(logs)[1]["waits_for"] == [WAITS_FOR["quarantined"]]
        _wait(lambda: engine.steps >= 40)
        assert len(_waits(logs)) == 2 and t.is_alive()
        conn.guard.revoke("fenced")
        t.join(10)
    assert not t.is_alive() and free_in_pool(s, ids) == ids


def test_a_sleep_without_resetting_the_connector_waits_the_same_way() -> None:
    # vLLM 0.34's sleep(level=1, reset_connector=False) pauses through pause_scheduler (the same
    # loop), then tells the executor to sleep: only once the guard let the request go.
    s, r, ids, _, engine = _delayed(reaped=False)
    with capture_logs() as logs:
        t = threading.Thread(
            target=lambda: engine.sleep(level=1, mode="abort", reset_connector=False),
            daemon=True,
        )
        t.start()
        _wait(lambda: bool(_waits(logs)))
        _wait(lambda: engine.steps >= 20)
        assert t.is_alive() and engine.slept == []  # the KV cache is not discarded yet
        engine.reports.put(output(finished_sending={r.request_id}))
        t.join(10)
    assert not t.is_alive() and engine.slept == [1]
    assert free_in_pool(s, ids) == ids


def test_no_pause_no_warning() -> None:
    s, r, _, _, _ = _delayed(reaped=False)
    with capture_logs() as logs:
        for _ in range(5):
            step(s)
    assert not _waits(logs)
    assert r.request_id in s.requests
