"""kvlifetime inside vLLM (extra ``kvlifetime[vllm]``): README "Embedding in vLLM".

``GuardedConnector`` is what a vLLM user names in ``kv_transfer_config``; ``ConnectorGuard`` is
its sans-IO core (importable without vLLM); ``PROFILE`` says what each vLLM signal proves.
"""

from __future__ import annotations

from typing import Any

from kvlifetime.integrations.vllm.guard import ConnectorGuard, GuardStats, Handback
from kvlifetime.integrations.vllm.signals import PROFILE

__all__ = [
    "PROFILE",
    "ConnectorGuard",
    "GuardStats",
    "GuardedConnector",
    "Handback",
    "guarded_class",
]


def __getattr__(name: str) -> Any:
    # The connector imports vLLM; the guard and the signal table do not.
    if name in ("GuardedConnector", "GuardWorkerMeta", "guarded_class"):
        from kvlifetime.integrations.vllm import connector

        return getattr(connector, name)
    raise AttributeError(name)
