"""The vLLM guard's engine facts, without vLLM: the facts module for the installed vLLM is picked
by its version (another version refused with a typed error naming both), the modules import
without vLLM, a new version is one file, and a 0.33 whose private details are gone is refused
naming them. tests/in_vllm/test_vllm_facts.py checks them on the real vLLM 0.33."""

from __future__ import annotations

import subprocess
import sys
import types
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from kvlifetime.errors import InvalidField, UsageError
from kvlifetime.integrations.vllm import facts, facts_v0_33
from kvlifetime.integrations.vllm.errors import UnsupportedEngineVersion
from kvlifetime.integrations.vllm.facts import EngineFacts

# mypy checks here that the 0.33 module provides what the connector calls (the protocol).
_PROVIDES: EngineFacts = facts_v0_33


def test_the_supported_versions_are_the_facts_modules_beside_it() -> None:
    assert facts.supported_versions() == {
        "0.33": "kvlifetime.integrations.vllm.facts_v0_33",
        "0.34": "kvlifetime.integrations.vllm.facts_v0_34",
    }


def test_a_new_vllm_version_is_one_file(tmp_path: Path) -> None:
    for name in ("facts", "facts_v0_33", "facts_v0_34", "facts_v1_2", "facts_vx", "facts_v0_34b"):
        (tmp_path / f"{name}.py").write_text("")
    assert list(facts.supported_versions(tmp_path)) == ["0.33", "0.34", "1.2"]


@pytest.mark.parametrize(
    ("version", "series"),
    [
        ("0.33.0", "0.33"),
        ("0.33.1", "0.33"),
        ("0.33.0rc1", "0.33"),
        ("0.33.1.dev4+g1a2b3c", "0.33"),
        ("v0.34.0", "0.34"),
        ("1.2", "1.2"),
        ("0.330.0", "0.330"),
        ("nonsense", None),
        ("", None),
    ],
)
def test_series_of_a_version_string(version: str, series: str | None) -> None:
    assert facts.series(version) == series


@pytest.mark.parametrize("version", ["0.33.0", "0.33.2", "0.33.1.dev4+g1a2b3c"])
def test_vllm_0_33_gets_the_0_33_facts(version: str) -> None:
    assert facts.for_version(version) is facts_v0_33


@pytest.mark.parametrize("version", ["0.34.0", "0.34.1rc2"])
def test_vllm_0_34_gets_the_0_34_facts(version: str) -> None:
    from kvlifetime.integrations.vllm import facts_v0_34

    assert facts.for_version(version) is facts_v0_34


@pytest.mark.parametrize("version", ["0.35.0", "0.32.9", "0.3.3", "0.330.0", "1.0.0", "main"])
def test_another_vllm_version_is_refused_naming_installed_and_supported(version: str) -> None:
    with pytest.raises(UnsupportedEngineVersion) as e:
        facts.for_version(version)
    assert repr(version) in str(e.value)
    assert "0.33.x, 0.34.x" in str(e.value)
    assert isinstance(e.value, UsageError)
    assert e.value.kind == "unsupported_vllm_version"


def _fake_vllm(monkeypatch: pytest.MonkeyPatch, version: str) -> None:
    """``import vllm`` finds a module of that version and nothing under it."""
    fake = types.ModuleType("vllm")
    fake.__version__ = version  # type: ignore[attr-defined]
    fake.__path__ = []  # a package with no submodules
    for name in [m for m in sys.modules if m.startswith("vllm.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "vllm", fake)
    monkeypatch.setattr(facts, "_INSTALLED", None)


def test_installed_refuses_a_fake_vllm_version(monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_vllm(monkeypatch, "0.35.0")
    with pytest.raises(UnsupportedEngineVersion, match=r"0\.33\.x, 0\.34\.x.*'0\.35\.0'"):
        facts.installed()
    assert facts._INSTALLED is None  # a refusal is not remembered


def test_a_vllm_0_33_without_its_private_details_is_refused_naming_them(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The version matches, the facts do not: check() refuses, listing every one not found."""
    _fake_vllm(monkeypatch, "0.33.0")
    with pytest.raises(UnsupportedEngineVersion) as e:
        facts.installed()
    message = str(e.value)
    for label in (
        "Scheduler._free_blocks",
        "Scheduler.requests",
        "Scheduler.__init__ calls bind_kv_cache_manager",
        "RequestStatus.WAITING_FOR_REMOTE_KVS",
        "NixlBaseConnectorWorker._reap_expired_send_leases",
    ):
        assert label in message
    assert "vLLM 0.33.0 does not have" in message
    assert facts._INSTALLED is None


def test_installed_without_vllm_names_the_extra() -> None:
    if "vllm" in sys.modules or _importable("vllm"):
        pytest.skip("vLLM is installed here")
    from kvlifetime.extras import MissingExtra

    with pytest.raises(MissingExtra):
        facts.installed()


def _importable(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(name) is not None


def test_the_facts_modules_import_without_vllm() -> None:
    code = (
        "import sys\n"
        "import kvlifetime.integrations.vllm.facts, kvlifetime.integrations.vllm.facts_v0_33\n"
        "assert not [m for m in sys.modules if m == 'vllm' or m.startswith('vllm.')]\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_every_fact_names_what_it_mirrors() -> None:
    labels = [f.label for f in facts_v0_33.FACTS]
    assert len(set(labels)) == len(labels)
    for f in facts_v0_33.FACTS:
        assert f.how in (facts_v0_33.MEMBER, facts_v0_33.FIELD, facts_v0_33.CALLS)
        assert f.mirrors
        assert (f.how == facts_v0_33.CALLS) == bool(f.method)
    assert "Scheduler._free_blocks" in labels


class Probed:
    """A class the probes read."""

    kept = 1

    def __init__(self) -> None:
        self.assigned = 2

    def step(self) -> None:
        self.helper()

    def helper(self) -> None:
        pass


@pytest.mark.parametrize(
    ("how", "name", "method", "found"),
    [
        (facts_v0_33.MEMBER, "kept", "", True),
        (facts_v0_33.MEMBER, "helper", "", True),
        (facts_v0_33.MEMBER, "gone", "", False),
        (facts_v0_33.FIELD, "assigned", "", True),
        (facts_v0_33.FIELD, "gone", "", False),
        (facts_v0_33.CALLS, "helper", "step", True),
        (facts_v0_33.CALLS, "gone", "step", False),
        (facts_v0_33.CALLS, "helper", "no_such_method", False),
    ],
)
def test_the_probes(how: str, name: str, method: str, found: bool) -> None:
    fact = facts_v0_33.Fact(f"{__name__}:Probed", name, how, "a test", method)
    assert facts_v0_33.holds(fact) is found


def test_a_fact_in_a_module_that_does_not_import_is_missing() -> None:
    fact = facts_v0_33.Fact("vllm_no_such_module:X", "y", facts_v0_33.MEMBER, "a test")
    assert not facts_v0_33.holds(fact)


# ----------------------------------------------------------------------- facts that need no vLLM


def test_flat_and_new_blocks() -> None:
    assert facts_v0_33.flat([3, 4]) == [3, 4]
    assert facts_v0_33.flat(([3, 4], [5])) == [3, 4, 5]
    assert facts_v0_33.flat([]) == []
    out = SimpleNamespace(
        scheduled_new_reqs=[SimpleNamespace(block_ids=([1, 2],))],
        scheduled_cached_reqs=SimpleNamespace(new_block_ids=[None, ([7],), ()]),
    )
    assert facts_v0_33.new_blocks(out) == [1, 2, 7]


def test_num_blocks() -> None:
    cfg = SimpleNamespace(cache_config=SimpleNamespace(num_gpu_blocks=64))
    assert facts_v0_33.num_blocks(cfg, SimpleNamespace(num_blocks=32)) == 32
    assert facts_v0_33.num_blocks(cfg, None) == 64
    with pytest.raises(InvalidField):
        facts_v0_33.num_blocks(SimpleNamespace(cache_config=SimpleNamespace()), None)


def test_null_block_id() -> None:
    manager = SimpleNamespace(block_pool=SimpleNamespace(null_block=SimpleNamespace(block_id=0)))
    assert facts_v0_33.null_block_id(manager) == 0


def test_watch_reaper_sees_what_the_reaper_adds() -> None:
    class Worker:
        def _reap_expired_send_leases(self, done_sending: set[str]) -> None:
            done_sending.add("expired")

    connector: Any = SimpleNamespace(connector_worker=Worker())
    reaped: set[str] = set()
    assert facts_v0_33.watch_reaper(connector, reaped)
    done = {"read"}
    connector.connector_worker._reap_expired_send_leases(done)
    assert done == {"read", "expired"}
    assert reaped == {"expired"}
    assert not facts_v0_33.watch_reaper(SimpleNamespace(), set())


def test_scheduler_hooks_of_a_caller_that_is_no_scheduler() -> None:
    def bind_kv_cache_manager(kv_cache_manager: Any) -> Any:
        return facts_v0_33.scheduler_hooks(kv_cache_manager)

    assert bind_kv_cache_manager(object()) is None


def test_the_binding_scheduler_is_the_one_whose_connector_binds() -> None:
    """The Scheduler is found from the frames of the bind call; a connector nested in another
    (a MultiConnector's child) is not the scheduler's own and gets none (driven by hand)."""
    kvm, outer, inner = object(), object(), object()

    class Scheduler:
        def __init__(self, connector: object) -> None:
            self.kv_cache_manager = kvm
            self.requests: dict[str, object] = {}
            self.connector = connector

        def bind(self, binding: object) -> object:
            return _wrapper_frame(binding)

    def _wrapper_frame(binding: object) -> object:  # (the hook's wrapper, a frame between)
        return facts_v0_33._binding_scheduler(kvm, binding)

    own = Scheduler(outer)
    assert own.bind(outer) is own
    assert own.bind(inner) is None  # nested: the scheduler binds the outer connector
    assert facts_v0_33._binding_scheduler(kvm, None) is None  # no scheduler in these frames
