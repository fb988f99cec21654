"""The README's ``vllm serve`` example, as vLLM 0.33 reads it: its ``--kv-transfer-config`` JSON
becomes a ``KVTransferConfig``, and vLLM's real scheduler built from it runs the guard around the
named inner connector (NixlConnector), as the README says."""

from __future__ import annotations

import json
import re
from pathlib import Path

from vllm.config import KVTransferConfig
from vllm.distributed.kv_transfer.kv_connector.v1.nixl import NixlConnector
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.structured_output import StructuredOutputManager

from kvlifetime.integrations.vllm import testing as vt
from kvlifetime.integrations.vllm.connector import GuardedConnector

README = (Path(__file__).resolve().parents[2] / "README.md").read_text(encoding="utf-8")


def test_the_readmes_kv_transfer_config_builds_a_guarded_nixl_connector() -> None:
    (block,) = [b for b in re.findall(r"```sh\n(.*?)```", README, flags=re.S) if "vllm serve" in b]
    match = re.search(r"--kv-transfer-config '(.*)'", block, flags=re.S)
    assert match is not None
    ktc = KVTransferConfig(**json.loads(match.group(1)))
    cfg = vt.config(guarded=False)
    cfg.kv_transfer_config = ktc
    sched = Scheduler(
        vllm_config=cfg,
        kv_cache_config=vt.kv_cache_config(),
        log_stats=True,
        structured_output_manager=StructuredOutputManager(cfg),
        block_size=vt.BLOCK,
    )
    connector = sched.connector
    assert isinstance(connector, GuardedConnector) and isinstance(connector, NixlConnector)
    assert connector.guard is not None
