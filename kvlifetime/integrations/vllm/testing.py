"""Testing helpers: drive vLLM's real ``Scheduler`` with the model's output mocked, as vLLM's
own tests do - one engine step is ``schedule()`` then ``update_from_output()`` with what the
worker (here: the test) reports - guarded or not. For an engine's own tests of its connector
configuration, kvlifetime's scenarios (tests/in_vllm/) and its benchmarks; vLLM's own test
utilities are not part of its wheel.

Needs vLLM (and, on a machine without the model, an offline Hugging Face cache holding
facebook/opt-125m's config: ``vllm-tests/write-hf-cache.py`` writes one; set ``HF_HOME``,
``HF_HUB_OFFLINE=1`` and, on a CPU machine, ``VLLM_TARGET_DEVICE=cpu`` before importing this).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from typing import Any

import torch
from vllm.config import (
    CacheConfig,
    DeviceConfig,
    KVTransferConfig,
    ModelConfig,
    SchedulerConfig,
    VllmConfig,
)
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager

from kvlifetime.integrations.vllm.connector import GuardWorkerMeta

BLOCK = 16
EOS = 2
_ids = itertools.count(1)
init_none_hash(sha256)


def config(
    *,
    guarded: bool,
    inner: str = "NixlConnector",
    inner_module: str | None = None,
    num_blocks: int = 256,
    max_num_seqs: int = 16,
    max_num_batched_tokens: int = 1024,
    max_model_len: int = 2048,
    **extra: Any,
) -> VllmConfig:
    """A VllmConfig (facebook/opt-125m's shape, CPU) with ``inner`` as its connector (from
    ``inner_module`` if given), selected guarded (``GuardedConnector`` naming it) or not."""
    if guarded:
        ktc = KVTransferConfig(
            kv_connector="GuardedConnector",
            kv_connector_module_path="kvlifetime.integrations.vllm",
            kv_role="kv_both",
            kv_connector_extra_config={
                "inner": {"kv_connector": inner, "kv_connector_module_path": inner_module}
            },
            **extra,
        )
    else:
        ktc = KVTransferConfig(
            kv_connector=inner, kv_connector_module_path=inner_module, kv_role="kv_both", **extra
        )
    model = ModelConfig(model="facebook/opt-125m", dtype="float16", seed=42)
    cfg = VllmConfig(
        model_config=model,
        scheduler_config=SchedulerConfig(
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=max_model_len,
            is_encoder_decoder=False,
            disable_hybrid_kv_cache_manager=True,
        ),
        cache_config=CacheConfig(block_size=BLOCK, enable_prefix_caching=True),
        kv_transfer_config=ktc,
        device_config=DeviceConfig("cpu"),
    )
    cfg.cache_config.kv_cache_layout = "LBNHC"
    cfg.cache_config.num_gpu_blocks = num_blocks
    return cfg


def kv_cache_config(num_blocks: int = 256) -> KVCacheConfig:
    return KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[
            KVCacheGroupSpec(
                ["layer"],
                FullAttentionSpec(
                    block_size=BLOCK, num_kv_heads=1, head_size=1, dtype=torch.float32
                ),
            )
        ],
    )


def scheduler(
    *,
    guarded: bool,
    inner: str = "NixlConnector",
    inner_module: str | None = None,
    num_blocks: int = 256,
    **kw: Any,
) -> Scheduler:
    """vLLM's scheduler with ``inner`` as its connector, guarded or not (``kw``: ``config``'s
    scheduler limits, or ``KVTransferConfig`` fields)."""
    cfg = config(
        guarded=guarded, inner=inner, inner_module=inner_module, num_blocks=num_blocks, **kw
    )
    return Scheduler(
        vllm_config=cfg,
        kv_cache_config=kv_cache_config(num_blocks),
        log_stats=True,
        structured_output_manager=StructuredOutputManager(cfg),
        block_size=BLOCK,
    )


def request(
    *, tokens: int = 3 * BLOCK, remote_decode: bool = False, remote_prefill: bool = False
) -> Request:
    """A prompt of ``tokens`` distinct tokens. ``remote_decode``: this engine is the prefill
    side, decode will read the KV (one output token). ``remote_prefill``: this engine is the
    decode side and loads the prompt's KV from a remote prefill first."""
    n = next(_ids)
    params = SamplingParams(max_tokens=1 if remote_decode else 8)
    params.update_from_generation_config({}, EOS)
    req = Request(
        request_id=f"req-{n}",
        prompt_token_ids=[1000 * n + i for i in range(tokens)],
        sampling_params=params,
        pooling_params=None,
        mm_features=None,
        block_hasher=get_request_block_hasher(BLOCK, sha256),
    )
    if remote_decode:
        req.kv_transfer_params = {"do_remote_prefill": False, "do_remote_decode": True}
    elif remote_prefill:
        req.kv_transfer_params = {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_engine_id": "prefill-engine",
            "remote_request_id": f"prefill-{n}",
            "remote_block_ids": list(range(tokens // BLOCK)),
            "remote_host": "prefill-host",
            "remote_port": 1234,
            "tp_size": 1,
        }
    return req


def output(
    reqs: Iterable[Request] = (),
    *,
    finished_sending: set[str] | None = None,
    finished_recving: set[str] | None = None,
    failed_recving: set[str] | None = None,
    invalid_block_ids: set[int] | None = None,
    lease_reaped: set[str] | None = None,
) -> ModelRunnerOutput:
    """What the worker reports for one step: one sampled token per request in ``reqs`` and
    the connector's sets; ``lease_reaped`` is what the guard's worker side adds when the
    connector's lease reaper put those ids in ``finished_sending``."""
    ids = [r.request_id for r in reqs]
    kv: KVConnectorOutput | None = None
    if any(
        x is not None
        for x in (finished_sending, finished_recving, failed_recving, invalid_block_ids)
    ):
        kv = KVConnectorOutput(
            finished_sending=finished_sending,
            finished_recving=finished_recving,
            failed_recving=failed_recving or set(),
            invalid_block_ids=invalid_block_ids or set(),
            kv_connector_worker_meta=(
                GuardWorkerMeta(None, frozenset(lease_reaped)) if lease_reaped else None
            ),
        )
    fields: dict[str, Any] = {
        "req_ids": ids,
        "sampled_token_ids": [[0] for _ in ids],
        "logprobs": None,
        "prompt_logprobs_dict": {},
        "pooler_output": None,
        "kv_connector_output": kv,
    }
    if "req_id_to_index" in ModelRunnerOutput.__dataclass_fields__:  # (gone in vLLM 0.34)
        fields["req_id_to_index"] = {r: i for i, r in enumerate(ids)}
    return ModelRunnerOutput(**fields)


def step(s: Scheduler, out: ModelRunnerOutput | None = None) -> None:
    """One engine step: schedule, then the worker's report (default: nothing happened)."""
    so = s.schedule()
    s.update_from_output(so, out if out is not None else output())


def advance(s: Scheduler, *reqs: Request, **sets: Any) -> Any:
    """One engine step in which the worker samples a token for those of ``reqs`` vLLM scheduled
    (``sets``: the connector's sets, as ``output`` takes them). Returns the step's
    ``SchedulerOutput``."""
    so = s.schedule()
    ran = [r for r in reqs if r.request_id in so.num_scheduled_tokens]
    s.update_from_output(so, output(ran, **sets))
    return so


def blocks_of(s: Scheduler, req: Request) -> list[int]:
    (ids,) = s.kv_cache_manager.get_block_ids(req.request_id)
    return list(ids)


def free_in_pool(s: Scheduler, ids: Iterable[int]) -> list[int]:
    """Those of ``ids`` that vLLM's block pool would hand out again (no reference left)."""
    pool = s.kv_cache_manager.block_pool
    return [b for b in ids if pool.blocks[b].ref_cnt == 0]


def moved_on(s: Scheduler, ids: Iterable[int]) -> list[int]:
    """Those of ``ids`` vLLM no longer keeps aside: back in its pool, or held by a request it
    runs (a forward pass writes into them, e.g. a local recompute of a failed load)."""
    pool = s.kv_cache_manager.block_pool
    running = {b for q in s.running for b in blocks_of(s, q)}
    return [b for b in ids if pool.blocks[b].ref_cnt == 0 or b in running]
