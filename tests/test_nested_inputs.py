"""Outside data nested without end, or whose ``repr`` raises, gets kvlifetime's own typed error
from every decoder (README, "Strict inputs"; docs/contract.md, "What bad input gets"):
evidence built from plain data (``evidence.from_dict`` / ``from_record``), the harness's wire frames
(``wire.decode``, msgpack's own limits included), the logs ``kvlifetime replay`` reads, and the
results file ``kvlifetime report`` reads (``RunResult.from_dict``, ``FaultConfig.from_dict``).
Python's ``repr``, ``==`` and ``json`` recurse: 1,200 levels used to come out as an untyped
``RecursionError``. One depth check (``inputs.shallow``) bounds them all; a refused input
changes nothing, and where a worker reads it, it is logged and counted as any refusal.
"""

from __future__ import annotations

import io
import json
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import attrs
import msgpack
import pytest
from structlog.testing import capture_logs

from kvlifetime import inputs
from kvlifetime.adapters.inproc import InprocTarget
from kvlifetime.cli import main
from kvlifetime.errors import InvalidField, KVLifetimeError, MalformedEvidence, UsageError
from kvlifetime.evidence import TransferCompleted, from_dict, from_record, to_dict, to_wire
from kvlifetime.grant import GrantId
from kvlifetime.harness import wire
from kvlifetime.harness.faults import FaultConfig
from kvlifetime.harness.push_owner import DecodeWorker
from kvlifetime.harness.result import RunResult
from kvlifetime.harness.settings import PushSettings
from kvlifetime.ledger import BlockLedger
from kvlifetime.source import Source
from kvlifetime.verify.replay import read_log, read_log_file

DEEP = 1_200
PEER = Source.peer("prefill-0")


def nested_list(depth: int, leaf: object = None) -> Any:
    v: Any = leaf
    for _ in range(depth):
        v = [v]
    return v


def nested_dict(depth: int) -> Any:
    v: Any = {}
    for _ in range(depth):
        v = {"a": v}
    return v


def nested_tuple(depth: int) -> Any:
    v: Any = ()
    for _ in range(depth):
        v = (v,)
    return v


class BadRepr:
    def __repr__(self) -> str:
        raise RuntimeError("repr raised")


class SelfRef(list[Any]):
    pass


def _looped() -> list[Any]:
    x: list[Any] = []
    x.append(x)
    return x


def _good() -> dict[str, Any]:
    return to_wire(TransferCompleted(GrantId("inc", 3), "req", "prefill-0", 2))


# ---------------------------------------------------------------- the shared check


@pytest.mark.parametrize(
    "value",
    [nested_list(DEEP), nested_dict(DEEP), nested_tuple(DEEP), {nested_tuple(DEEP): 1}, _looped()],
    ids=["list", "dict", "tuple", "key", "looped"],
)
def test_shallow_refuses_deep_data_with_the_error_asked_for(value: object) -> None:
    with pytest.raises(MalformedEvidence, match=r"nested deeper than 32"):
        inputs.shallow(value, "data", error=MalformedEvidence)
    with pytest.raises(InvalidField):
        inputs.shallow(value, "data")


def test_shallow_takes_data_at_the_limit_and_runs_no_code_of_the_values() -> None:
    inputs.shallow(nested_list(inputs.MAX_NESTING), "data")  # the outer list is level 1
    with pytest.raises(InvalidField):
        inputs.shallow(nested_list(inputs.MAX_NESTING + 1), "data")

    class Hostile(list[Any]):
        def __iter__(self) -> Iterator[Any]:
            raise AssertionError("the walk ran the subclass's code")

        def __len__(self) -> int:
            raise AssertionError("the walk ran the subclass's code")

    inputs.shallow(Hostile([1, [2]]), "data")
    with pytest.raises(InvalidField):
        inputs.shallow(Hostile([nested_list(DEEP)]), "data")
    inputs.shallow([BadRepr(), {"k": BadRepr()}], "data")  # a leaf is never looked into


# ---------------------------------------------------------------- evidence.from_dict


def _with_key(good: dict[str, Any], key: object) -> dict[Any, Any]:
    out: dict[Any, Any] = dict(good)
    out[key] = 1
    return out


def _deep_variants() -> list[Any]:
    good = _good()
    return [
        pytest.param({**good, "grant_id": nested_list(DEEP)}, id="grant_id-list"),
        pytest.param({**good, "grant_id": ["inc", nested_list(DEEP)]}, id="serial-list"),
        pytest.param({**good, "grant_id": [nested_list(DEEP), 3]}, id="incarnation-list"),
        pytest.param({**good, "type": nested_list(DEEP)}, id="type-list"),
        pytest.param({**good, "request": nested_dict(DEEP)}, id="request-dict"),
        pytest.param({**good, "last_seq": nested_list(DEEP)}, id="seq-list"),
        pytest.param({**good, nested_tuple(DEEP): 1}, id="key-tuple"),
        pytest.param({"type": nested_tuple(DEEP)}, id="type-tuple"),
        pytest.param(nested_dict(DEEP), id="dict"),
        pytest.param({**good, "peer": _looped()}, id="looped"),
        pytest.param({**good, "grant_id": [BadRepr(), 3]}, id="incarnation-repr"),
        pytest.param({**good, "grant_id": ["inc", BadRepr()]}, id="serial-repr"),
        pytest.param({**good, "type": BadRepr()}, id="type-repr"),
        pytest.param({**good, "grant_id": BadRepr()}, id="grant_id-repr"),
        pytest.param(_with_key(good, BadRepr()), id="key-repr"),
        pytest.param(
            {
                "type": "AccessRevoked",
                "peer": "p",
                "grant_id": None,
                "request": None,
                "fence": BadRepr(),
            },
            id="fence-repr",
        ),
    ]


@pytest.mark.parametrize("data", _deep_variants())
def test_from_dict_of_deep_or_unprintable_data_is_malformed_evidence(data: Any) -> None:
    with pytest.raises(MalformedEvidence) as info:
        from_dict(data, source=PEER)
    assert len(str(info.value)) < 1_000  # bounded: the value is shown, never dumped
    with pytest.raises(MalformedEvidence):
        from_record(data)


class RaisingMapping(Mapping[str, Any]):
    """A caller's mapping whose walk fails."""

    def __getitem__(self, k: str) -> Any:
        raise RuntimeError("getitem")

    def __iter__(self) -> Iterator[str]:
        raise RuntimeError("iter")

    def __len__(self) -> int:
        return 1


def test_from_dict_of_a_mapping_that_cannot_be_read_is_malformed_evidence() -> None:
    with pytest.raises(MalformedEvidence, match="could not be read"):
        from_dict(RaisingMapping(), source=PEER)


def test_from_dict_still_builds_good_evidence() -> None:
    ev = from_dict(_good(), source=PEER)
    assert ev == TransferCompleted(GrantId("inc", 3), "req", "prefill-0", 2, source=PEER)
    assert from_record(to_dict(ev)) == ev


def test_refused_deep_evidence_changes_no_ledger() -> None:
    L = BlockLedger(8)
    L.acquire("r", [0, 1])
    g = L.grant("r", "prefill-0", [0, 1])
    before = (L.fingerprint(), attrs.asdict(L.stats()))
    data = {**to_wire(TransferCompleted.of(g, 1)), "last_seq": nested_list(DEEP)}
    with pytest.raises(MalformedEvidence):
        L.apply(from_dict(data, source=Source.peer("prefill-0")))
    assert (L.fingerprint(), attrs.asdict(L.stats())) == before


# ---------------------------------------------------------------- wire frames


def _frame(body: object) -> bytes:
    out: bytes = msgpack.packb(body, use_bin_type=True)
    return out


# 1,020 levels: under msgpack's own limit (1,024), so the decoder's own check must refuse it.
MSGPACK_OK = 1_020


def _deep_frames() -> list[Any]:
    d = nested_list(MSGPACK_OK)
    ev = _good()
    return [
        pytest.param(_frame({"v": d, "t": "tick", "n": 1}), id="version"),
        pytest.param(_frame({"v": 1, "t": d}), id="type"),
        pytest.param(_frame({"v": 1, "t": "tick", "n": d}), id="field"),
        pytest.param(
            _frame({"v": 1, "t": "evidence", "evidence": {**ev, "type": d}}), id="ev-type"
        ),
        pytest.param(
            _frame({"v": 1, "t": "evidence", "evidence": {**ev, "grant_id": d}}), id="ev-gid"
        ),
        pytest.param(_frame({"v": 1, "t": "stats", "counters": {"a": d}}), id="counters"),
        pytest.param(b"\x91" * DEEP + b"\xc0", id="msgpack-stack"),  # msgpack's StackError
        pytest.param(b"\x81\xa1v" + b"\x91" * 100_000 + b"\xc0", id="msgpack-stack-map"),
        pytest.param(b"\xdd\xff\xff\xff\xff", id="huge-array"),
        pytest.param(b"\xdf\xff\xff\xff\xff", id="huge-map"),
        pytest.param(b"\xdb\xff\xff\xff\xff" + b"x" * 16, id="huge-str"),
        pytest.param(_frame({"v": "x" * (wire.MAX_FRAME - 64), "t": "tick"}), id="long-version"),
        pytest.param(_frame({"v": 1, "t": "x" * (wire.MAX_FRAME - 64)}), id="long-type"),
        pytest.param(_frame({"v": 1, "t": "tick", "n": "x" * (wire.MAX_FRAME - 64)}), id="long-n"),
    ]


@pytest.mark.parametrize("frame", _deep_frames())
def test_wire_decode_of_deep_or_huge_frames_is_malformed_message(frame: bytes) -> None:
    with pytest.raises(wire.MalformedMessage) as info:
        wire.decode(frame, sender="prefill-0")
    assert len(str(info.value)) < 1_000


@pytest.fixture
def decode() -> Iterator[DecodeWorker]:
    cfg = PushSettings(requests=2, block_bytes=512, num_blocks=64)
    target = InprocTarget(64 * 512)
    try:
        yield DecodeWorker(cfg, target, BlockLedger(64))
    finally:
        target.close()


def test_a_deep_frame_is_refused_by_the_worker_logged_counted_and_changes_nothing(
    decode: DecodeWorker,
) -> None:
    w = decode
    w.tick(0, "prefill-0", True)
    before = (w.ledger.fingerprint(), attrs.asdict(w.ledger.stats()), set(w.reqs))
    frames = [p.values[0] for p in _deep_frames()]
    with capture_logs() as logs:
        w.receive(frames, "prefill-0")
    assert w.count.malformed_refused == len(frames)
    refused = [e for e in logs if e["event"] == "message_refused"]
    assert len(refused) == len(frames) and all(e["log_level"] == "error" for e in refused)
    assert (w.ledger.fingerprint(), attrs.asdict(w.ledger.stats()), set(w.reqs)) == before


# ---------------------------------------------------------------- replay logs


def _line(request: str) -> str:
    """A transition line whose request is the JSON text ``request`` (json.dumps itself
    recurses too deep to write 1,200 levels)."""
    return (
        '{"event": "request_transition", "request": ' + request + ', "from_state": "admitted", '
        '"to_state": "finished", "transition": "finished", "cause": "finish"}'
    )


@pytest.mark.parametrize(
    "line",
    [
        _line("[" * DEEP + "]" * DEEP),  # json itself recurses too deep
        "[" * 100_000 + "]" * 100_000,
        _line("[" * 200 + "]" * 200),  # json reads it; the replay would recurse on it later
        _line('{"a": ' * 200 + "{}" + "}" * 200),
    ],
    ids=["json-1200", "json-100000", "list-200", "dict-200"],
)
def test_replay_refuses_deep_log_lines_with_a_typed_error(tmp_path: Path, line: str) -> None:
    with pytest.raises(InvalidField, match=r"line 1: .*nested"):
        read_log([line])
    with pytest.raises(InvalidField, match=r"line 1: .*nested"):
        read_log_file(io.StringIO(line + "\n"))
    path = tmp_path / "deep.jsonl"
    path.write_text(line + "\n")
    assert main(["replay", str(path)]) == 2


def test_replay_errors_are_kvlifetime_errors_and_still_value_errors() -> None:
    for bad in ["{", "[1]", '{"event": 3}']:
        with pytest.raises(InvalidField) as info:
            read_log([bad])
        assert isinstance(info.value, ValueError) and isinstance(info.value, KVLifetimeError)


# ---------------------------------------------------------------- results files


def _result() -> dict[str, Any]:
    keys = [f.name for f in attrs.fields(RunResult) if f.default is attrs.NOTHING]
    d: dict[str, Any] = dict.fromkeys(keys, 0)
    d.update(backend="inproc", policy="proof", refused_evidence={}, peer_counters={})
    return d


@pytest.mark.parametrize(
    "change",
    [
        {"backend": nested_list(DEEP)},
        {"seed": nested_dict(DEEP)},
        {"refused_evidence": {"stale_evidence": nested_list(DEEP)}},
        {"refused_evidence": {"stale_evidence": [1]}},  # not a count
        {"fences": {"f": "two"}},
        {"reclaimed_blocks": {"f": True}},
        {"topology": {"tp_ranks": nested_dict(DEEP)}},
        {"oracle": {"method": nested_list(DEEP)}},
        {"peer_counters": {"x": BadRepr()}},
        {"backend": BadRepr()},
    ],
    ids=lambda c: next(iter(c)),
)
def test_run_result_from_dict_refuses_deep_or_wrong_values(change: dict[str, Any]) -> None:
    RunResult.from_dict(_result())  # the base is good
    with pytest.raises(UsageError) as info:
        RunResult.from_dict({**_result(), **change})
    assert len(str(info.value)) < 1_000


def test_report_load_results_refuses_deep_runs(tmp_path: Path) -> None:
    from kvlifetime.report import ReportInputError, load_results

    path = tmp_path / "inner.json"
    path.write_text(json.dumps([{**_result(), "backend": nested_list(200)}]))
    with pytest.raises(ReportInputError, match="nested deeper"):
        load_results(path)


@pytest.mark.parametrize(
    "d",
    [
        {"p_abort": nested_list(DEEP)},
        {"no_such_knob": 1},
        {"tp_ranks": "two"},
        {"p_abort": BadRepr()},
        nested_dict(DEEP),
    ],
    ids=["deep", "unknown", "wrong-type", "repr", "dict"],
)
def test_fault_config_from_dict_refuses_with_a_typed_error(d: dict[str, Any]) -> None:
    with pytest.raises(UsageError):
        FaultConfig.from_dict(d)


def test_fault_config_round_trips() -> None:
    cfg = FaultConfig(tp_ranks=2, redeliver_ticks=(2, 5))
    assert FaultConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg


def test_a_results_file_nested_without_end_is_a_report_input_error(tmp_path: Path) -> None:
    from kvlifetime.report import ReportInputError, load_results

    path = tmp_path / "report.json"
    path.write_text("[" * 100_000 + "]" * 100_000, encoding="utf-8")
    with pytest.raises(ReportInputError, match="nested too deep"):
        load_results(path)
