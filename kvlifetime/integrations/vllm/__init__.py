"""kvlifetime inside vLLM (extra ``kvlifetime[vllm]``): README "Embedding in vLLM".

``GuardedConnector`` is what a vLLM user names in ``kv_transfer_config``; ``ConnectorGuard`` is
its sans-IO core (importable without vLLM); ``PROFILE`` says what each vLLM signal proves.
"""

from __future__ import annotations

from typing import Any

from kvlifetime.integrations.vllm.errors import UnsupportedEngineVersion
from kvlifetime.integrations.vllm.guard import (
    ConnectorGuard,
    GuardStats,
    Handback,
    RequestView,
)
from kvlifetime.integrations.vllm.signals import PROFILE

__all__ = [
    "PROFILE",
    "ConnectorGuard",
    "GuardStats",
    "GuardedConnector",
    "Handback",
    "RequestView",
    "UnsupportedEngineVersion",
    "guarded_class",
]


def __getattr__(name: str) -> Any:
    # The connector imports vLLM; the guard and the signal table do not.
    from kvlifetime.extras import needs

    if name in ("GuardedConnector", "GuardWorkerMeta", "guarded_class"):
        with needs("vllm", f"kvlifetime.integrations.vllm.{name}"):
            from kvlifetime.integrations.vllm import connector

        return getattr(connector, name)
    if name.startswith("Guarded") and len(name) > len("Guarded"):
        # "kv_connector": "GuardedNixlConnector" with this module as kv_connector_module_path:
        # the guarded class of a connector vLLM has registered under that name (it keeps the
        # inner class's HMA support, which vLLM's factory checks on the class it is named).
        with needs("vllm", f"kvlifetime.integrations.vllm.{name}"):
            from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

            from kvlifetime.integrations.vllm.connector import guarded_class

        try:
            inner = KVConnectorFactory.get_connector_class_by_name(name[len("Guarded") :])
        except ValueError as e:
            raise AttributeError(name) from e
        return guarded_class(inner)
    raise AttributeError(name)
