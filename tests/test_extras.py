"""A missing optional dependency is ``MissingExtra``, naming the install, at the call."""

from __future__ import annotations

import sys

import pytest

from kvlifetime import BlockLedger, KVLifetimeError, MissingExtra
from kvlifetime.extras import EXTRAS, import_optional, missing, needs, require


def test_every_extra_of_the_package_metadata_is_known() -> None:
    import tomllib
    from pathlib import Path

    meta = tomllib.loads((Path(__file__).resolve().parent.parent / "pyproject.toml").read_text())
    declared = set(meta["project"]["optional-dependencies"]) - {"test"}
    # nixl has no extra (its lean install needs --no-deps); every declared one is known here
    assert declared <= set(EXTRAS)
    for name in declared:
        assert EXTRAS[name].command() == f"pip install 'kvlifetime[{name}]'"


def test_require_names_the_install_and_imports_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "msgpack", None)
    assert missing("harness") == ["msgpack"]
    with pytest.raises(MissingExtra) as info:
        require("harness", "the thing")
    e = info.value
    assert isinstance(e, KVLifetimeError) and isinstance(e, ModuleNotFoundError)
    assert e.name == "msgpack" and e.kind == "missing_extra"
    assert str(e) == (
        "the thing needs the optional dependency 'msgpack', which is not installed: "
        "run pip install 'kvlifetime[harness]'"
    )


def test_needs_translates_only_the_extras_own_modules(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "zmq", None)
    pattern = r"pyzmq \(module 'zmq'\).*kvlifetime\[harness\]"
    with pytest.raises(MissingExtra, match=pattern), needs("harness", "x"):
        import zmq  # noqa: F401
    # An unrelated missing module is not blamed on the extra.
    with pytest.raises(ModuleNotFoundError) as info, needs("harness", "x"):
        import_optional("kvlifetime_no_such_module", "harness", "x")
    assert not isinstance(info.value, MissingExtra)
    with pytest.raises(ValueError, match="unknown extra 'nope'"):
        require("nope", "x")


def test_ledger_collector_fails_at_construction_not_at_the_first_scrape(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from kvlifetime.prometheus import LedgerCollector

    monkeypatch.setitem(sys.modules, "prometheus_client", None)
    monkeypatch.setitem(sys.modules, "prometheus_client.core", None)
    with pytest.raises(MissingExtra, match=r"LedgerCollector needs .*kvlifetime\[prometheus\]"):
        LedgerCollector(BlockLedger(4))
    monkeypatch.undo()
    assert list(LedgerCollector(BlockLedger(4)).collect())  # installed: it works


def test_the_adapters_say_which_install_is_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvlifetime.adapters import mooncake, nixl

    monkeypatch.setitem(sys.modules, "nixl", None)
    monkeypatch.setitem(sys.modules, "nixl._api", None)
    monkeypatch.setitem(sys.modules, "mooncake", None)
    monkeypatch.setitem(sys.modules, "mooncake.engine", None)
    assert not nixl.nixl_available() and not mooncake.mooncake_available()
    with pytest.raises(MissingExtra, match=r"pip install --no-deps nixl==1\.5\.1"):
        nixl._api()
    with pytest.raises(MissingExtra, match=r"kvlifetime\[mooncake\].*libibverbs1"):
        mooncake._engine_module()


def test_importing_the_harness_without_its_extra_names_it(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib

    import kvlifetime.harness.push_owner  # noqa: F401  (loaded now, so its removal is undone after)

    monkeypatch.setitem(sys.modules, "msgpack", None)
    for name in (
        "kvlifetime.harness.wire",
        "kvlifetime.harness.faults",
        "kvlifetime.harness.push_owner",
    ):
        monkeypatch.delitem(sys.modules, name)
    with pytest.raises(MissingExtra, match=r"kvlifetime\.harness needs .*kvlifetime\[harness\]"):
        importlib.import_module("kvlifetime.harness.push_owner")
