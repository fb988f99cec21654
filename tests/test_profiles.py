"""Evidence profiles (``kvlifetime.profiles``): every row consistent with the evidence it names
and pinned by a test that exists; the CLI and the generated docs; and the in-process engine's
rows pinned by experiment (Mooncake's are pinned in tests/test_mooncake_adapter.py and
tests/test_mooncake_fence.py).
"""

from __future__ import annotations

import ast
import json
import signal
import subprocess
import sys
import textwrap
import time
import types
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from kvlifetime import profiles
from kvlifetime.adapters.inproc import InprocEngine, InprocTarget
from kvlifetime.adapters.transfer import Status
from kvlifetime.cli import main
from kvlifetime.errors import FenceUnavailable, InvalidField
from kvlifetime.evidence import Claim
from kvlifetime.pages import docs_files, engine_markdown, evidence_markdown
from kvlifetime.profiles import (
    ENGINES,
    NOTHING,
    PROFILES,
    EngineProfile,
    ProfileUnavailable,
    StatusRow,
    profile,
)
from kvlifetime.provenance import RESTS_ON_PEER

ROOT = Path(__file__).resolve().parent.parent
Capsys = pytest.CaptureFixture[str]
ALL = [PROFILES[name] for name in PROFILES]
ids = [p.name for p in ALL]


def _test_functions(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    return {
        n.name
        for n in tree.body
        if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef) and n.name.startswith("test_")
    }


# --------------------------------------------------------------------------- the registry


def test_the_registry() -> None:
    assert ENGINES == ("inproc", "mooncake-tcp", "nixl-ucx", "vllm", "sglang")
    assert {"inproc", "mooncake-tcp"} <= set(PROFILES)
    assert list(PROFILES) == [e for e in ENGINES if e in PROFILES]  # a fixed order
    for name in PROFILES:
        assert PROFILES[name].name == name
    from kvlifetime.adapters import mooncake

    assert PROFILES["mooncake-tcp"] is mooncake.PROFILE
    assert PROFILES["inproc"] is profiles.INPROC_PROFILE
    with pytest.raises(ProfileUnavailable, match="unknown engine"):
        profile("rdma")


@pytest.mark.parametrize("prof", ALL, ids=ids)
def test_every_row_is_pinned_by_a_test_that_exists(prof: EngineProfile) -> None:
    for row in prof.rows:
        assert row.test, f"{prof.name}: {row.status!r} names no test (a draft profile?)"
        file, func = row.test.split("::")
        path = ROOT / file
        assert path.is_file(), f"{prof.name}: {row.status!r}: no file {file}"
        assert func in _test_functions(path), f"{prof.name}: {row.status!r}: no {row.test}"


@pytest.mark.parametrize("prof", ALL, ids=ids)
def test_claims_are_what_the_named_evidence_proves(prof: EngineProfile) -> None:
    for row in prof.rows:
        classes = row.evidence_classes
        if row.evidence == NOTHING:
            assert classes == () and row.claims == frozenset(), row.status
            continue
        assert classes and row.claims, f"{row.status!r}: evidence without claims"
        for cls in classes:
            assert row.claims <= cls.PROVES, f"{row.status!r}: {cls.__name__}"
        assert row.established in ("code", "measured", "code and measured")


@pytest.mark.parametrize("prof", ALL, ids=ids)
def test_the_fence_row_exists_iff_there_is_a_fence(prof: EngineProfile) -> None:
    revoking = [r for r in prof.rows if Claim.ACCESS_REVOKED in r.claims]
    if prof.fence is None:
        assert revoking == []
    else:
        assert len(revoking) == 1
        assert prof.fence in revoking[0].status
        assert revoking[0].evidence == "AccessRevoked"


@pytest.mark.parametrize("prof", ALL, ids=ids)
def test_peer_word_names_what_rests_on_the_peer(prof: EngineProfile) -> None:
    claimed = frozenset().union(*(r.claims for r in prof.rows)) & RESTS_ON_PEER
    for c in claimed:
        assert c.value in prof.peer_word, f"{prof.name}: peer_word omits {c.value}"
    assert prof.to_dict()["rests_on_peer_word"] == [c.value for c in Claim if c in RESTS_ON_PEER]


def test_known_profiles_say_what_their_engines_do() -> None:
    moon = PROFILES["mooncake-tcp"]
    assert moon.fence == "mooncake_target_recreated"
    by_status = {r.status: r for r in moon.rows}
    unreg = next(r for s, r in by_status.items() if "unregister_memory" in s)
    assert unreg.evidence == NOTHING and "NOT AccessRevoked" in unreg.does_not_prove
    fence = moon.fence_rows[0]
    assert "MooncakeTarget.fence()" in fence.status and fence.established == "code and measured"
    assert fence.test.startswith("tests/test_mooncake_fence.py::")
    inproc = PROFILES["inproc"]
    assert inproc.fence == "inproc_initiator_reaped"
    failed = next(r for r in inproc.rows if "FAILED" in r.status)
    assert failed.evidence == NOTHING and "straggle_ticks" in failed.does_not_prove


# --------------------------------------------------------------------------- the types


def _row(**kw: object) -> StatusRow:
    args: dict[str, object] = {
        "status": "s",
        "evidence": NOTHING,
        "claims": frozenset(),
        "does_not_prove": "x",
        "established": "code",
        "test": "tests/test_profiles.py::test_the_registry",
    }
    args.update(kw)
    return StatusRow(**args)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"claims": {Claim.TRANSFERS_ENDED}}, "does not prove"),
        ({"evidence": "PeerLost", "claims": {Claim.TRANSFERS_ENDED}}, "does not prove"),
        (
            {
                "evidence": "TransferQuiesced or TransferCompleted",
                "claims": {Claim.CANCEL_RECEIVED},
            },
            "does not prove",
        ),
        ({"evidence": "Completed"}, "unknown: Completed"),
        ({"established": "believed"}, "established"),
        ({"test": "test_x"}, "tests/<file>.py"),
        ({"status": ""}, "status"),
        ({"claims": {"transfers_ended"}}, "Claim members"),
    ],
)
def test_a_row_that_claims_too_much_is_refused(kw: dict[str, object], match: str) -> None:
    with pytest.raises(InvalidField, match=match):
        _row(**kw)


def test_a_row_may_claim_less_than_its_evidence() -> None:
    r = _row(evidence="TransferCompleted", claims={Claim.TRANSFERS_ENDED})
    assert r.claims == frozenset({Claim.TRANSFERS_ENDED})


def _profile(rows: tuple[StatusRow, ...], fence: str | None) -> EngineProfile:
    return EngineProfile("e", "pkg", "1", "tcp", rows, fence, "note", "word")


def test_a_profile_and_its_fence_row_agree() -> None:
    revoke = _row(status="fence() -> f", evidence="AccessRevoked", claims={Claim.ACCESS_REVOKED})
    assert _profile((_row(), revoke), "f").fence_rows == (revoke,)
    with pytest.raises(InvalidField, match="no fence"):
        _profile((revoke,), None)
    with pytest.raises(InvalidField, match="exactly one"):
        _profile((_row(),), "f")
    with pytest.raises(InvalidField, match="must name"):
        _profile((revoke,), "g")
    with pytest.raises(InvalidField, match="rows"):
        _profile((), None)


# --------------------------------------------------------------------------- NIXL, lazily


def test_a_missing_adapter_is_reported_not_raised(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "kvlifetime.adapters.nixl", None)  # import fails
    assert "nixl-ucx" not in PROFILES and "nixl-ucx" not in list(PROFILES)
    with pytest.raises(KeyError):
        PROFILES["nixl-ucx"]
    with pytest.raises(ProfileUnavailable, match="nixl-ucx: no evidence profile yet"):
        profile("nixl-ucx")
    monkeypatch.setitem(sys.modules, "kvlifetime.adapters.nixl", types.ModuleType("nixl"))
    with pytest.raises(ProfileUnavailable, match="defines no PROFILE"):
        profile("nixl-ucx")


def test_a_tuple_profile_is_adapted(monkeypatch: pytest.MonkeyPatch) -> None:
    mod = types.ModuleType("kvlifetime.adapters.nixl")
    mod.PROFILE = (  # type: ignore[attr-defined]
        ("DONE", "TransferQuiesced / TransferCompleted", "landed", "other xfers", "measured"),
        ("release handle", "nothing", "", "that the transfer stopped", "code and measured"),
        ("notification", "TransferCompleted (via the notif)", "landed", "", "read the source"),
    )
    monkeypatch.setitem(sys.modules, "kvlifetime.adapters.nixl", mod)
    p = profile("nixl-ucx")
    assert [r.evidence for r in p.rows] == [
        "TransferQuiesced or TransferCompleted",
        NOTHING,
        "TransferCompleted",
    ]
    assert p.rows[0].claims == frozenset({Claim.TRANSFERS_ENDED})
    assert p.rows[2].established == "code"
    assert all(r.test == "" for r in p.rows)  # a draft: the test-id check above refuses it
    assert "(none yet)" in engine_markdown(p)


def test_an_engine_profile_in_the_adapter_is_used_as_is(monkeypatch: pytest.MonkeyPatch) -> None:
    mod = types.ModuleType("kvlifetime.adapters.nixl")
    mod.PROFILE = _profile((_row(),), None)  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "kvlifetime.adapters.nixl", mod)
    with pytest.raises(InvalidField, match="expected 'nixl-ucx'"):
        profile("nixl-ucx")


def test_profiles_load_without_the_engines_installed() -> None:
    code = textwrap.dedent(
        """
        import sys
        sys.modules["mooncake"] = None  # as if not installed
        sys.modules["nixl"] = None
        from kvlifetime.profiles import PROFILES
        from kvlifetime.pages import docs_files
        names = list(PROFILES)
        docs_files(include_svg=False)
        assert not [m for m in sys.modules if m.startswith("mooncake.") or m == "nixl._api"]
        print(" ".join(names))
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    )
    assert done.stdout.split()[:2] == ["inproc", "mooncake-tcp"]


# --------------------------------------------------------------------------- CLI and docs


def run(capsys: Capsys, *argv: str) -> tuple[int, str, str]:
    status = main(list(argv))
    out, err = capsys.readouterr()
    return status, out, err


@pytest.mark.parametrize("name", ["inproc", "mooncake-tcp"])
def test_evidence_engine_md(capsys: Capsys, name: str) -> None:
    status, out, _ = run(capsys, "evidence", "--engine", name)
    assert status == 0
    assert out == engine_markdown(PROFILES[name])
    assert out.startswith("# ") and "Do not edit." in out
    rows = [ln for ln in out.split("\n") if ln.startswith("| ") and "---" not in ln][1:]
    assert len(rows) == len(PROFILES[name].rows)
    assert f"**`{PROFILES[name].fence}`**" in out


@pytest.mark.parametrize("name", ["inproc", "mooncake-tcp", "vllm"])
def test_evidence_engine_json(capsys: Capsys, name: str, tmp_path: Path) -> None:
    status, out, _ = run(capsys, "evidence", "--engine", name, "--format", "json")
    assert status == 0
    doc = json.loads(out)
    assert doc == PROFILES[name].to_dict()
    assert [r["status"] for r in doc["rows"]] == [r.status for r in PROFILES[name].rows]
    dest = tmp_path / "p.json"
    assert run(capsys, "evidence", "--engine", name, "--format", "json", "-o", str(dest))[0] == 0
    assert dest.read_text(encoding="utf-8") == out


def test_evidence_without_engine_is_unchanged(capsys: Capsys) -> None:
    assert run(capsys, "evidence")[1] == evidence_markdown()


def test_evidence_engine_not_available_yet(capsys: Capsys, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "kvlifetime.adapters.nixl", None)
    status, out, err = run(capsys, "evidence", "--engine", "nixl-ucx")
    assert status == 2 and out == ""
    assert "nixl-ucx: no evidence profile yet" in err
    status, _, err = run(capsys, "evidence", "--engine", "rdma")
    assert status == 2 and "invalid choice" in err


def test_docs_have_a_page_per_engine() -> None:
    files = docs_files(include_svg=False)
    for name in PROFILES:
        assert files[f"engine-{name}.md"] == engine_markdown(PROFILES[name])
    assert {"engine-inproc.md", "engine-mooncake-tcp.md"} <= set(files)
    for name in ("engine-inproc.md", "engine-mooncake-tcp.md"):  # committed (drift: test_diagrams)
        assert (ROOT / "docs" / name).is_file()


# --------------------------------------------------------------------------- Mooncake, by code


def test_mooncake_adapter_never_calls_transfer_check_status() -> None:
    # The row says transfer_check_status proves nothing the harness uses: it is never called.
    tree = ast.parse((ROOT / "kvlifetime" / "adapters" / "mooncake.py").read_text())
    called = [
        n
        for n in ast.walk(tree)
        if isinstance(n, ast.Call)
        and isinstance(n.func, ast.Attribute)
        and n.func.attr == "transfer_check_status"
    ]
    assert called == []
    assert any("transfer_check_status" in r.status for r in PROFILES["mooncake-tcp"].rows)


# --------------------------------------------------------------------------- inproc, measured


def test_inproc_completed_means_landed(inproc: tuple[InprocTarget, InprocEngine]) -> None:
    target, engine = inproc
    for i in range(1, 50):
        engine.staging[: 8 * 4096] = i
        h = engine.submit(
            [(0, target.address(0), 4 * 4096), (4 * 4096, target.address(8 * 4096), 4 * 4096)]
        )
        assert engine.wait(h, 5.0) is Status.COMPLETED
        # Landed when the status is read, before the tick ends: nothing of it is still to come.
        assert (target.array[: 4 * 4096] == i).all() and (
            target.array[8 * 4096 : 12 * 4096] == i
        ).all()
        before = target.array.copy()
        engine.advance(i)
        assert (target.array == before).all()


def test_inproc_target_has_no_fence(inproc: tuple[InprocTarget, InprocEngine]) -> None:
    target, _ = inproc
    with pytest.raises(FenceUnavailable, match="initiator"):
        target.fence()


# An initiator in its own process, writing into the arena as fast as it can until killed.
_WRITER = """
import json, sys, time
from kvlifetime.adapters.inproc import InprocEngine
from kvlifetime.adapters.transfer import Status
desc = json.loads(sys.argv[1])
n = desc["nbytes"]
engine = InprocEngine(desc, n)
i = 0
while True:
    i += 1
    engine.staging[:] = i % 251 + 1
    assert engine.wait(engine.submit([(0, desc["base"], n)]), 5.0) is Status.COMPLETED
    engine.advance(i)
    if i == 1:
        print("ready", flush=True)
"""


@pytest.fixture
def writer() -> Iterator[tuple[InprocTarget, subprocess.Popen[str]]]:
    target = InprocTarget(64 * 1024)
    p = subprocess.Popen(
        [sys.executable, "-c", _WRITER, json.dumps(target.descriptor())],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert p.stdout is not None and p.stdout.readline().strip() == "ready"
        yield target, p
    finally:
        if p.poll() is None:
            p.send_signal(signal.SIGCONT)
            p.kill()
        p.wait(10)
        target.close()


def _changes(arena: np.ndarray[tuple[int], np.dtype[np.uint8]], within: float) -> bool:
    """Whether the arena changes within ``within`` seconds (a write landed)."""
    before = arena.copy()
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if not (arena == before).all():
            return True
        time.sleep(0.005)
    return False


def test_inproc_reaping_the_initiator_ends_its_writes(
    writer: tuple[InprocTarget, subprocess.Popen[str]],
) -> None:
    target, p = writer
    assert _changes(target.array, 5.0)  # writes are landing
    p.kill()
    assert p.wait(10) == -signal.SIGKILL  # reaped: its exit status is collected
    assert not _changes(target.array, 0.5)  # nothing lands any more


def test_inproc_a_stopped_initiator_writes_again(
    writer: tuple[InprocTarget, subprocess.Popen[str]],
) -> None:
    target, p = writer
    assert _changes(target.array, 5.0)
    p.send_signal(signal.SIGSTOP)  # hung: its heartbeat would fail
    time.sleep(0.1)
    assert not _changes(target.array, 0.3)
    assert p.poll() is None  # not dead, not reaped
    p.send_signal(signal.SIGCONT)
    assert _changes(target.array, 5.0)  # ... and it writes again: PeerLost proves nothing more
