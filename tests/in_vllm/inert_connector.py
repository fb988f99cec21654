"""What the test connectors leave as no-ops: vLLM's ``KVConnectorBase_V1`` declares these
abstract, and neither scenario loads external KV (no token matched, nothing to do after an
allocation) or moves bytes from the worker's forward pass (nothing loaded, nothing saved)."""

from __future__ import annotations

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
)


class Meta(KVConnectorMetadata):
    pass


class InertConnector(KVConnectorBase_V1):
    # scheduler side: no external KV to load
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> Any:
        return 0, False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        pass

    # worker side: the forward pass loads and saves nothing
    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        pass

    def wait_for_layer_load(self, layer_name: str) -> None:
        pass

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kw: Any) -> None:
        pass

    def wait_for_save(self) -> None:
        pass
