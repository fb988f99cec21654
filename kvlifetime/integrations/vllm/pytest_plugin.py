"""pytest plugin: every connector vLLM's factory creates is guarded (``-p`` this module).

Used by ``make test-vllm`` to run vLLM's own tests with the guard installed: the class vLLM's
``KVConnectorFactory.create_connector`` instantiates is replaced by ``guarded_class`` of it (the
same class with the guard in front), for the top-level connector only - a MultiConnector's
children are reached through the guarded parent. With ``KVLIFETIME_VLLM_WRAPPED_LOG`` set, one
line per guarded connector (class and role) is appended to that file.

Installing it checks the installed vLLM against the guard's engine facts first
(``facts.installed``): a vLLM the guard does not know fails the plugin's import with
``UnsupportedEngineVersion``, and nothing is patched.
"""

from __future__ import annotations

import contextvars
import os
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

from kvlifetime.integrations.vllm import facts
from kvlifetime.integrations.vllm.connector import guarded_class

facts.installed()

_TARGET: contextvars.ContextVar[Any] = contextvars.ContextVar("kvlifetime_target", default=None)
_get_class = KVConnectorFactory.get_connector_class.__func__
_create = KVConnectorFactory.create_connector.__func__


def _get_connector_class(cls: Any, kv_transfer_config: Any) -> Any:
    found = _get_class(cls, kv_transfer_config)
    if kv_transfer_config is not None and kv_transfer_config is _TARGET.get():
        return guarded_class(found)
    return found


def _create_connector(cls: Any, config: Any, role: Any, kv_cache_config: Any) -> Any:
    token = _TARGET.set(config.kv_transfer_config)
    try:
        connector = _create(cls, config, role, kv_cache_config)
    finally:
        _TARGET.reset(token)
    log = os.environ.get("KVLIFETIME_VLLM_WRAPPED_LOG")
    if log:
        with open(log, "a", encoding="utf-8") as f:
            f.write(f"{type(connector).__name__}\t{getattr(role, 'name', role)}\n")
    return connector


KVConnectorFactory.get_connector_class = classmethod(_get_connector_class)
KVConnectorFactory.create_connector = classmethod(_create_connector)
