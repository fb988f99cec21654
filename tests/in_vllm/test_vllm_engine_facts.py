"""The guard's engine facts on the real vLLM (0.33 or 0.34, whichever the venv has: the facts
module of its series): every private detail it relies on is found,
and a vLLM where one has moved (here: monkeypatched away) is refused when the guard is installed
- by the connector's class being built, or by the pytest plugin - with
``UnsupportedEngineVersion`` naming it, nothing built or patched."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Iterator
from typing import Any

import pytest
import vllm
from inert_connector import InertConnector
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.v1.core.sched.scheduler import Scheduler

from kvlifetime.integrations.vllm import facts, facts_v0_33, facts_v0_34, testing
from kvlifetime.integrations.vllm.connector import guarded_class
from kvlifetime.integrations.vllm.errors import UnsupportedEngineVersion

PLUGIN = "kvlifetime.integrations.vllm.pytest_plugin"
SERIES = facts.series(vllm.__version__) or ""
FACTS: Any = {"0.33": facts_v0_33, "0.34": facts_v0_34}[SERIES]


@pytest.fixture
def unchecked(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The process as before the guard's first install (the check not yet run); the cached
    result is put back afterwards."""
    monkeypatch.setattr(facts, "_INSTALLED", None)
    yield


def test_the_installed_vllm_is_supported_and_every_fact_holds() -> None:
    assert SERIES in ("0.33", "0.34")
    missing = [f.label for f in FACTS.FACTS if not facts_v0_33.holds(f)]
    assert missing == []
    FACTS.check()


def test_install_picks_the_facts_of_the_installed_series(unchecked: None) -> None:
    assert facts.installed() is FACTS
    assert facts.installed() is FACTS  # once: cached
    assert guarded_class(InertConnector).__name__ == "GuardedInertConnector"


def test_the_statuses_are_vllms(unchecked: None) -> None:
    from vllm.v1.request import RequestStatus

    waiting, aborted = FACTS.statuses()
    assert waiting is RequestStatus.WAITING_FOR_REMOTE_KVS
    assert aborted == {RequestStatus.FINISHED_ABORTED, RequestStatus.FINISHED_ERROR}


def test_the_guard_finds_the_scheduler_that_binds_it() -> None:
    s = testing.scheduler(guarded=True, inner="InertConnector", inner_module="inert_connector")
    connector: Any = s.connector
    assert connector.guard is not None
    assert connector._kvl_requests is s.requests
    if SERIES == "0.33":
        assert connector._kvl_free == s._free_blocks
    else:  # 0.34: vLLM's free, after the id leaves _aborted_kv_loads (the load cap)
        assert connector._kvl_free != s._free_blocks and callable(connector._kvl_free)
        s._aborted_kv_loads.add("aborted-load")
        connector._kvl_load_over("aborted-load")
        assert "aborted-load" not in s._aborted_kv_loads
    assert connector._kvl_null == s.kv_cache_manager.block_pool.null_block.block_id


def test_a_scheduler_without_free_blocks_refuses_the_install(
    unchecked: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delattr(Scheduler, "_free_blocks")

    class Fresh(InertConnector):
        pass

    with pytest.raises(UnsupportedEngineVersion, match=r"Scheduler\._free_blocks") as e:
        guarded_class(Fresh)
    assert f"vLLM {vllm.__version__} does not have" in str(e.value)
    assert f"facts_v{SERIES.replace('.', '_')}.py" in str(e.value)
    with pytest.raises(UnsupportedEngineVersion, match=r"Scheduler\._free_blocks"):
        testing.scheduler(guarded=True, inner="InertConnector", inner_module="inert_connector")
    assert facts._INSTALLED is None  # refused: checked again at the next install


def test_the_pytest_plugin_refuses_to_install_and_patches_nothing(
    unchecked: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delattr(Scheduler, "_free_blocks")
    monkeypatch.delitem(sys.modules, PLUGIN, raising=False)
    before = (
        KVConnectorFactory.__dict__["get_connector_class"],
        KVConnectorFactory.__dict__["create_connector"],
    )
    with pytest.raises(UnsupportedEngineVersion, match=r"Scheduler\._free_blocks"):
        importlib.import_module(PLUGIN)
    assert PLUGIN not in sys.modules
    after = (
        KVConnectorFactory.__dict__["get_connector_class"],
        KVConnectorFactory.__dict__["create_connector"],
    )
    assert after == before


def test_an_init_that_no_longer_keeps_the_request_table_is_refused(
    unchecked: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An instance attribute is looked for where vLLM assigns it (``Scheduler.__init__``)."""
    original = Scheduler.__init__

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:  # not functools.wraps: opaque
        original(self, *args, **kwargs)

    monkeypatch.setattr(Scheduler, "__init__", __init__)
    with pytest.raises(UnsupportedEngineVersion) as e:
        facts.installed()
    assert "Scheduler.requests" in str(e.value)
    assert "Scheduler.__init__ calls bind_kv_cache_manager" in str(e.value)
    assert "Scheduler._free_blocks" not in str(e.value)


def test_another_vllm_version_refuses_the_install(
    unchecked: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(vllm, "__version__", "0.35.0")
    with pytest.raises(UnsupportedEngineVersion, match=r"0\.33\.x, 0\.34\.x.*'0\.35\.0'"):
        guarded_class(InertConnector)


def test_the_guarded_class_wraps_exactly_the_rows_the_inner_class_has() -> None:
    """Hooks as data: each row of ``facts_v0_33.HOOKS`` is the inner connector's own method,
    wrapped by the one generic wrapper around a handler of ``GuardedConnector``; a row the inner
    class does not have (``request_finished_all_groups`` without ``SupportsHMA``) is not."""
    from kvlifetime.integrations.vllm.connector import GuardedConnector

    cls = guarded_class(InertConnector)
    rows = {row.name: row for row in FACTS.HOOKS}
    wrapped = {name for name in rows if name in cls.__dict__}
    assert wrapped == {name for name in rows if hasattr(InertConnector, name)}
    assert "request_finished_all_groups" not in wrapped
    for name in wrapped:
        assert callable(getattr(GuardedConnector, rows[name].handler))
        assert name not in GuardedConnector.__dict__  # only the rows put it there
