"""What vLLM 0.34 changed for a guard in its KV connector, on 0.34's real classes (issue 33):
the class-level queries answered by the inner connector's class, a connector built with
``num_blocks=0`` sized from the block pool it is bound to, an aborted load the guard hands back
leaving the load cap's count, and a NIXL pull class under ``transfer_mode=push`` refused.

These are vLLM 0.34's API: they run in the 0.34 venv (``make test-vllm-034``) and are not
collected against 0.33, which has none of it (its own facts are tested by
``test_vllm_engine_facts.py`` in both)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import vllm

from kvlifetime.integrations.vllm import facts

if facts.series(vllm.__version__) != "0.34":
    pytest.skip("vLLM 0.34's API: run in the 0.34 venv", allow_module_level=True)

from vllm.distributed.kv_transfer.kv_connector.factory import (
    KVConnectorFactory,
)
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

from kvlifetime.errors import InvalidField
from kvlifetime.integrations.vllm import facts_v0_34, testing
from kvlifetime.integrations.vllm.connector import (
    GuardedConnector,
    guarded_class,
    inner_transfer_config,
)


def _ktc(inner: str = "NixlConnector", **inner_extra: Any) -> Any:
    ktc = testing.config(guarded=True, inner=inner).kv_transfer_config
    ktc.kv_connector_extra_config["inner"]["kv_connector_extra_config"] = inner_extra
    return ktc


@pytest.mark.parametrize("mode", ["pull", "push"])
def test_class_level_queries_are_the_inner_connectors(mode: str) -> None:
    ktc = _ktc(transfer_mode=mode)
    inner_cls, inner_ktc = inner_transfer_config(ktc)
    assert inner_cls.__name__ == f"Nixl{mode.capitalize()}Connector"
    for name in ("kv_cache_access", "supports_lookahead_block_hashes", "supports_sleep_mode"):
        assert getattr(GuardedConnector, name)(ktc) == getattr(inner_cls, name)(inner_ktc), name
    # The factory's own answer for the guarded config is the inner connector's.
    assert KVConnectorFactory.kv_cache_access(ktc) == KVConnectorFactory.kv_cache_access(inner_ktc)
    # A guarded class answers with its inner class's answer (by its MRO).
    assert guarded_class(inner_cls).kv_cache_access(inner_ktc) == inner_cls.kv_cache_access(
        inner_ktc
    )


def test_a_connector_built_with_no_blocks_is_sized_when_bound() -> None:
    cfg = testing.config(guarded=True, inner="NixlConnector")
    cfg.cache_config.num_gpu_blocks = None  # as vLLM 0.34 builds one to ask about lookahead
    conn: Any = KVConnectorFactory.create_connector(
        cfg, KVConnectorRole.SCHEDULER, testing.kv_cache_config(0)
    )
    assert conn.guard is None  # vLLM asks such a connector things; nothing to guard yet
    pool = SimpleNamespace(num_gpu_blocks=96, null_block=SimpleNamespace(block_id=0))
    conn.bind_kv_cache_manager(SimpleNamespace(block_pool=pool))
    assert conn.guard is not None
    assert conn.guard.ledger.num_blocks == 96


def test_an_aborted_load_the_guard_frees_leaves_the_load_cap() -> None:
    s = testing.scheduler(guarded=True, inner="InertConnector", inner_module="inert_connector")
    conn: Any = s.connector
    req = testing.request(remote_prefill=True)
    s.add_request(req)
    s._aborted_kv_loads.add(req.request_id)
    req.status = facts_v0_34.statuses().ended_by_abort.__iter__().__next__()
    conn._kvl_free(req)  # the guard's hand-back path (a fence released it)
    assert req.request_id not in s._aborted_kv_loads
    s._aborted_kv_loads.add("sent-back")
    conn._kvl_load_over("sent-back")  # the finished_sending path
    assert "sent-back" not in s._aborted_kv_loads


def test_a_pull_class_under_push_mode_is_refused() -> None:
    pull = KVConnectorFactory.get_connector_class_by_name("NixlPullConnector")
    push = KVConnectorFactory.get_connector_class_by_name("NixlPushConnector")
    push_cfg = SimpleNamespace(kv_connector_extra_config={"transfer_mode": "push"})
    pull_cfg = SimpleNamespace(kv_connector_extra_config={"transfer_mode": "pull"})
    with pytest.raises(InvalidField, match="transfer_mode='push'"):
        facts_v0_34.check_transfer_mode(guarded_class(pull), push_cfg)
    facts_v0_34.check_transfer_mode(guarded_class(push), push_cfg)
    facts_v0_34.check_transfer_mode(guarded_class(pull), pull_cfg)
    facts_v0_34.check_transfer_mode(guarded_class(pull), SimpleNamespace())
