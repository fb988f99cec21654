"""The hooks on SGLang 0.5.23's real classes (run in the SGLang venv): what ``install`` wraps and
``uninstall`` restores, what it refuses, and one abort through the whole decode path - SGLang's
receiver publishing the pages, the ABORT, the prefill's ABORT_ACK over ZeroMQ, the deferred
release - alone and guarded, with the same outcome. (The hazards, alone and guarded, are the
scenario tests beside this file.)"""

from __future__ import annotations

import importlib
import re
from collections.abc import Iterator
from typing import Any, Literal

import pytest
import sglang
from sglang_driver import Rig

import kvlifetime.integrations.sglang as kv_sglang
from kvlifetime.guard import accepted
from kvlifetime.integrations.sglang import hooks
from kvlifetime.integrations.sglang.prefill_hooks import PrefillHooks

Point = tuple[str, str | None, str]  # module, class (None: the module itself), attribute
POINTS: dict[str, list[Point]] = {
    "decode": [
        ("sglang.srt.disaggregation.decode", "DecodePreallocQueue", "__init__"),
        ("sglang.srt.disaggregation.decode", "DecodePreallocQueue", "add"),
        ("sglang.srt.disaggregation.common.conn", "CommonKVReceiver", "send_metadata"),
        ("sglang.srt.disaggregation.common.conn", "CommonKVReceiver", "_send_abort_notification"),
        (
            "sglang.srt.disaggregation.common.conn",
            "CommonKVReceiver",
            "_connect_to_bootstrap_server",
        ),
        ("sglang.srt.disaggregation.common.conn", "AbortNotification", "to_zmq"),
        ("sglang.srt.disaggregation.common.conn", "CommonKVManager", "handle_abort_ack_message"),
        (
            "sglang.srt.disaggregation.common.conn",
            "CommonKVManager",
            "register_deferred_abort_room",
        ),
        ("sglang.srt.disaggregation.common.conn", "CommonKVManager", "note_abort_ack"),
        ("sglang.srt.disaggregation.common.conn", "CommonKVManager", "is_abort_release_safe"),
        ("sglang.srt.disaggregation.common.conn", "CommonKVManager", "_handle_node_failure"),
        ("sglang.srt.disaggregation.decode", "DecodeTransferQueue", "_commit_transfer_to_req"),
        ("sglang.srt.disaggregation.decode", "DecodeTransferQueue", "_defer_release"),
        ("sglang.srt.disaggregation.decode", "DecodeTransferQueue", "resolve_deferred_releases"),
        ("sglang.srt.disaggregation.decode", "DecodeTransferQueue", "_do_release"),
        ("sglang.srt.disaggregation.decode", "DecodeTransferQueue", "_release_request"),
        (
            "sglang.srt.disaggregation.decode",
            "DecodeTransferQueue",
            "has_pending_deferred_releases",
        ),
        (
            "sglang.srt.disaggregation.decode",
            "DecodeTransferQueue",
            "num_pending_deferred_releases",
        ),
    ],
    "prefill": [
        ("sglang.srt.disaggregation.prefill", "PrefillBootstrapQueue", "__init__"),
        ("sglang.srt.disaggregation.prefill", "PrefillBootstrapQueue", "add"),
        ("sglang.srt.disaggregation.common.conn", "CommonKVSender", "send"),
        (
            "sglang.srt.disaggregation.mooncake.conn",
            "MooncakeKVManager",
            "_handle_abort_notification",
        ),
        ("sglang.srt.disaggregation.common.conn", "CommonKVManager", "_send_abort_ack"),
        ("sglang.srt.disaggregation.common.conn", "AbortAck", "to_zmq"),
        ("sglang.srt.disaggregation.prefill", None, "release_kv_cache"),
        (
            "sglang.srt.disaggregation.prefill",
            "SchedulerDisaggregationPrefillMixin",
            "process_disagg_prefill_inflight_queue",
        ),
        ("sglang.srt.managers.scheduler", "Scheduler", "is_fully_idle"),
    ],
}


def _owner(module: str, cls: str | None) -> Any:
    mod = importlib.import_module(module)
    return mod if cls is None else getattr(mod, cls)


def _current() -> dict[Point, Any]:
    out: dict[Point, Any] = {}
    for points in POINTS.values():
        for module, cls, name in points:
            owner = _owner(module, cls)
            out[(module, cls, name)] = getattr(owner, name) if cls is None else owner.__dict__[name]
    return out


@pytest.fixture
def clean() -> Iterator[None]:
    kv_sglang.uninstall()
    yield
    kv_sglang.uninstall()


@pytest.mark.parametrize("role", ["decode", "prefill"])
def test_install_wraps_each_release_point_and_uninstall_restores_it(clean: None, role: str) -> None:
    before = _current()
    guard: kv_sglang.SGLangGuard = kv_sglang.install(role=role)  # type: ignore[call-overload]
    assert kv_sglang.installed() is guard and guard.role == role
    after = _current()
    changed = {k for k in before if before[k] is not after[k]}
    assert changed == set(POINTS[role])
    assert sorted(name for _, name in hooks.wrapped_points()) == sorted(
        name for _, _, name in POINTS[role]
    )
    with pytest.raises(kv_sglang.AlreadyInstalled):
        kv_sglang.install(role="decode")
    assert _current() == after  # the refused second install changed nothing
    kv_sglang.uninstall()
    assert kv_sglang.installed() is None
    restored = _current()
    assert all(restored[k] is before[k] for k in before)


def test_a_prefill_holding_a_free_is_not_idle(clean: None) -> None:
    from sglang.srt.managers.scheduler import Scheduler

    kv_sglang.install(role="prefill")
    inst = hooks._installed
    assert isinstance(inst, PrefillHooks)
    inst.pending["sglang:1#1"] = (object(), object(), True)
    assert Scheduler.is_fully_idle(object()) is False  # SGLang's own check never runs
    inst.pending.clear()
    with pytest.raises(AttributeError):  # SGLang's own check, on an object that is no scheduler
        Scheduler.is_fully_idle(object())


def test_another_sglang_version_is_refused_and_nothing_is_wrapped(
    clean: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    before = _current()
    monkeypatch.setattr(sglang, "__version__", "0.5.24")
    with pytest.raises(kv_sglang.UnsupportedEngineVersion, match=r"0\.5\.23.*'0\.5\.24'"):
        kv_sglang.install(role="decode")
    assert kv_sglang.installed() is None and list(hooks.wrapped_points()) == []
    assert _current() == before


@pytest.mark.parametrize(
    ("role", "gone", "named"),
    [
        ("decode", ("sglang.srt.disaggregation.decode", "DecodeTransferQueue", "_defer_release"),
         "DecodeTransferQueue._defer_release"),
        ("prefill", ("sglang.srt.disaggregation.common.conn", "CommonKVManager",
                     "_deferred_ack_poisoned_rooms"),
         "CommonKVManager._deferred_ack_poisoned_rooms"),
    ],
)  # fmt: skip
def test_a_release_point_or_fact_that_moved_is_refused_and_nothing_is_wrapped(
    clean: None,
    monkeypatch: pytest.MonkeyPatch,
    role: Literal["decode", "prefill"],
    gone: Point,
    named: str,
) -> None:
    """An SGLang where a row's target (a method) or a private detail a handler reads (a field
    its manager sets) has moved: ``install`` names it, wraps nothing."""
    module, cls, name = gone
    owner = _owner(module, cls)
    if name in vars(owner):
        monkeypatch.delattr(owner, name)
    else:  # a field: the constructor that sets it, replaced by one that does not
        init = owner.__init__

        def without(self: Any, *a: Any, **kw: Any) -> None:
            init(self, *a, **kw)

        monkeypatch.setattr(owner, "__init__", without)
    before = {k: v for k, v in _current_or_none().items() if k != gone}
    with pytest.raises(kv_sglang.UnsupportedEngineVersion, match=re.escape(named)):
        kv_sglang.install(role=role)
    assert kv_sglang.installed() is None and list(hooks.wrapped_points()) == []
    assert {k: v for k, v in _current_or_none().items() if k != gone} == before


def _current_or_none() -> dict[Point, Any]:
    out: dict[Point, Any] = {}
    for points in POINTS.values():
        for module, cls, name in points:
            out[(module, cls, name)] = vars(_owner(module, cls)).get(name)
    return out


def test_deferred_release_turned_off_is_refused(
    clean: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    before = _current()
    monkeypatch.setenv("SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE", "false")
    role: Literal["decode", "prefill"]
    for role in ("decode", "prefill"):
        with pytest.raises(kv_sglang.UnsupportedEngineSetting):
            kv_sglang.install(role=role)
    assert _current() == before


def _abort_with_a_prompt_ack(rig: Rig, rid: str, room: int) -> dict[str, Any]:
    rig.start(rid, room=room, tokens=256)
    rig.bootstrap_prefill(rid)  # the decode published its pages; nothing is in flight
    pages = rig.decode.call("request_pages", rid=rid)
    free_before = rig.tick()["free_pages"]
    rig.decode.call("abort", rid=rid)
    state = rig.tick_until(rid, {"gone"}, timeout=20.0)
    return {"pages": len(pages), "freed": state["free_pages"] - free_before}


def test_an_abort_with_a_prompt_ack_is_released_alone_and_guarded(rigs: list[Rig]) -> None:
    outcomes = {}
    for guarded in (False, True):
        rig = Rig(guarded=guarded, pool_tokens=1024)
        rigs.append(rig)
        outcomes[guarded] = _abort_with_a_prompt_ack(rig, "r1", room=4242)
        if guarded:
            # The guard released it on the prefill's ACK, as SGLang did: nothing quarantined.
            st = rig.decode.call("guard_stats")
            assert (st["live"], st["held"], st["quarantined"], st["freed"]) == (0, 0, 0, 1), st
            assert st["refused"] == {} and st["ledger"]["blocks_by_state"]["exposed"] == 0
    assert outcomes[False] == outcomes[True]
    assert outcomes[True]["pages"] == 256 and outcomes[True]["freed"] == 256


def _receiver(room: int) -> Any:
    """What the decode hooks read of an SGLang receiver (one prefill, one rank)."""
    from types import SimpleNamespace

    return SimpleNamespace(
        bootstrap_infos=[{}],
        bootstrap_room=room,
        bootstrap_addr="127.0.0.1:8998",
        prefill_info=SimpleNamespace(pp_size=1, attn_cp_size=1),
        target_cp_ranks=[0],
        target_tp_ranks=[0],
        target_pp_ranks=[0],
    )


def _publish_through_the_hooks(receiver: Any, pages: list[int], slot: int) -> None:
    from sglang.srt.disaggregation.common.conn import CommonKVReceiver

    with pytest.raises(AttributeError):  # SGLang's own send, on an object that is no receiver
        CommonKVReceiver.send_metadata(receiver, pages, slot)


def _success_through_the_hooks(receiver: Any) -> None:
    from types import SimpleNamespace

    from sglang.srt.disaggregation.decode import DecodeTransferQueue

    with pytest.raises(AttributeError):  # SGLang's own commit, on an object that is no queue
        DecodeTransferQueue._commit_transfer_to_req(object(), SimpleNamespace(kv_receiver=receiver))


def test_a_key_left_by_an_earlier_installation_names_nothing(clean: None) -> None:
    # The guard's keys ("sglang:<room>#<n>") start again with each guard: an SGLang receiver
    # keyed by an earlier installation must not act on the lifecycle of the same name now.
    first = kv_sglang.install(role="decode")
    first.bind(64)
    old = _receiver(7)
    _publish_through_the_hooks(old, [1, 2], slot=1)
    assert first.lifecycles() == ["sglang:7#1"]
    kv_sglang.uninstall()
    guard = kv_sglang.install(role="decode")
    guard.bind(64)
    key = accepted(guard.published(7, [3, 4], slot=2, ranks=[0], prefill="127.0.0.1:8998"))
    assert key == "sglang:7#1"
    _success_through_the_hooks(old)  # the earlier installation's receiver: not this lifecycle
    assert guard.lifecycle(key)["phase"] == "live" and guard.stats().completed == 0


def test_a_refused_republish_keeps_the_receivers_lifecycle(clean: None) -> None:
    guard = kv_sglang.install(role="decode")
    guard.bind(64)
    receiver = _receiver(7)
    _publish_through_the_hooks(receiver, [1, 2], slot=1)
    _publish_through_the_hooks(receiver, [1, 2], slot=1)  # refused: the pages are exposed
    assert guard.stats().refused == {"exposed_page_reused": 1}
    _success_through_the_hooks(receiver)  # the receiver's lifecycle still ends through it
    assert guard.lifecycles() == [] and guard.stats().completed == 1


def test_the_readmes_install_call_runs_as_written(clean: None) -> None:
    """README, "In SGLang 0.5.23": its code block, run as written in the SGLang venv, installs
    the decode hooks."""
    import re
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text(encoding="utf-8")
    (block,) = [
        b for b in re.findall(r"```python\n(.*?)```", readme, flags=re.S) if "kv_sglang" in b
    ]
    space: dict[str, Any] = {}
    exec(block, space)
    guard = kv_sglang.installed()
    assert guard is not None and space["guard"] is guard and guard.role == "decode"
    assert sorted(name for _, name in hooks.wrapped_points()) == sorted(
        name for _, _, name in POINTS["decode"]
    )


# ========================================================= the values the hooks read from SGLang

BAD_ROOMS: list[Any] = [None, "7", 7.0, True, -1, 2**64]


def _bad_rooms() -> list[Any]:
    import numpy as np

    return [*BAD_ROOMS, np.float64(7.0)]


@pytest.mark.parametrize("bad", range(len(BAD_ROOMS) + 1))
def test_a_malformed_room_is_never_published_and_the_transfer_fails(clean: None, bad: int) -> None:
    from sglang.srt.disaggregation.base import KVPoll
    from sglang.srt.disaggregation.common.conn import CommonKVReceiver

    guard = kv_sglang.install(role="decode")
    guard.bind(64)
    receiver = _receiver(_bad_rooms()[bad])
    # SGLang's own send is not reached (it would raise AttributeError on this stand-in):
    # nothing leaves the process, and the receiver reports Failed for SGLang's queue to fail.
    assert CommonKVReceiver.send_metadata(receiver, [1, 2], 1) is None
    assert receiver.conclude_state == KVPoll.Failed
    assert guard.stats().refused == {"malformed_room": 1}
    assert guard.lifecycles() == []


def test_the_deferred_release_entry_carries_the_guards_deadline(clean: None) -> None:
    """SGLang's rule is ``ready = drained or now >= deadline``: a held, guarded entry must
    carry no deadline of SGLang's (the guard quarantines at it), or SGLang releases it there."""
    import math
    from types import SimpleNamespace

    from sglang.srt.disaggregation.decode import DecodeTransferQueue

    guard = kv_sglang.install(role="decode")
    guard.bind(64)
    receiver = _receiver(7)
    _publish_through_the_hooks(receiver, [1, 2], slot=1)
    (key,) = guard.lifecycles()
    receiver.abort_notified = True
    queue = SimpleNamespace(
        deferred_kv_release_timeout=30.0,
        _deferred_releases=[],
        _is_host_destination=lambda decode_req: False,
    )
    DecodeTransferQueue._defer_release(
        queue, SimpleNamespace(kv_receiver=receiver, metadata_buffer_index=1)
    )
    ((_, start, deadline, idx, required),) = queue._deferred_releases
    assert deadline == math.inf and (idx, required) == (1, 1)
    assert guard.lifecycle(key)["phase"] == "held"
    # The guard keeps SGLang's deadline: quarantined there, not released.
    assert guard.tick(start + 29.0) == []
    assert guard.tick(start + 30.5) == [key] and not guard.releasable(key)
    assert guard.stats().refused == {}


def test_malformed_rooms_are_failed_at_admission_as_sglang_fails_a_bad_request(
    rigs: list[Rig],
) -> None:
    """Requests whose ``bootstrap_room`` is not an int in [0, 2**64), admitted on both sides of
    a guarded rig through SGLang's own queues: each refused at the door (typed, counted,
    logged), failed as SGLang fails a bad request (``FINISH_ABORT``, 400, streamed), never
    queued; the decode's ticks (``process_decode_queue``) raise nothing and no page is lost;
    a good request afterwards is served."""
    rig = Rig(guarded=True, pool_tokens=1024)
    rigs.append(rig)
    bad = _bad_rooms()
    for i, room in enumerate(bad):
        rid = f"bad{i}"
        rig.prefill.call("admit", rid=rid, room=room, tokens=16, seed=1)
        rig.decode.call("admit", rid=rid, room=room, tokens=16, seed=1)
    for _ in range(3):
        state = rig.tick()
        assert state["free_pages"] == 1024
        assert set(state["places"].values()) == {"gone"}
    for i in range(len(bad)):
        for side in (rig.decode, rig.prefill):
            finished = side.call("finished", rid=f"bad{i}")
            assert finished is not None and finished["type"] == "FINISH_ABORT"
            assert finished["status_code"] == 400 and "bootstrap_room" in finished["message"]
    rig.expected_refusals = {
        "decode": {"malformed_room": len(bad)},
        "prefill0": {"malformed_room": len(bad)},
    }
    assert rig.prefill.call("inflight") == [] and rig.prefill.call("bootstrap") == []
    assert _abort_with_a_prompt_ack(rig, "good", room=4343) == {"pages": 256, "freed": 256}
