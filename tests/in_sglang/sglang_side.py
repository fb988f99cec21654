"""What both sides of the SGLang rig share (``sglang_rig`` serves one side a process): the
process-wide set-up (SGLang's runtime context, the gloo groups, Mooncake's transfer engine), the
KV pool and its byte counts, the requests, the stand-in scheduler, and ``Side``, the base of
``sglang_decode_side.DecodeSide`` and ``sglang_prefill_side.PrefillSide``: the pools each side
builds the same way, the later owners of freed pages.

Imported through ``sglang_rig``, which sets the environment SGLang reads when it loads.
"""

from __future__ import annotations

import os
import sys
import time
import types
from array import array
from types import SimpleNamespace
from typing import Any

import torch
import torch.distributed as dist
from sglang.srt.disaggregation.base.conn import KVPoll
from sglang.srt.disaggregation.utils import (
    DisaggregationMode,
    MetadataBuffers,
    ReqToMetadataIdxAllocator,
)
from sglang.srt.managers.schedule_batch import Req
from sglang.srt.managers.scheduler import Scheduler
from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator
from sglang.srt.mem_cache.cache_init_params import CacheInitParams
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
from sglang.srt.sampling.sampling_params import SamplingParams
from sglang.srt.server_args import ServerArgs
from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

LAYERS = 2
HEADS = 8
HEAD_DIM = 128
DTYPE = torch.float16
VOCAB = 1000


def _phase(what: str, since: float) -> float:
    now = time.monotonic()
    if os.environ.get("KVLIFETIME_RIG_TIMING"):
        print(f"[rig {os.getpid()}] {what}: {now - since:.2f}s", file=sys.stderr, flush=True)
    return now


def _group(rank: int, size: int, store_port: int | None) -> Any:
    """A gloo group standing for the TP / attention-TP group (one rank, or the ``size``
    ranks of one prefill instance in as many processes): the queues all-reduce their polls and
    hold flags over it. The CP and PP groups are this process alone."""
    if not dist.is_initialized():
        if size == 1:
            dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        else:
            dist.init_process_group(
                "gloo", init_method=f"tcp://127.0.0.1:{store_port}", rank=rank, world_size=size
            )
    return SimpleNamespace(
        cpu_group=dist.group.WORLD,
        device_group=dist.group.WORLD,
        rank_in_group=rank,
        world_size=size,
        is_first_rank=rank == 0,
        is_last_rank=rank == size - 1,
        rank=rank,
        ranks=list(range(size)),
    )


def _single(group: Any) -> Any:
    if group.world_size == 1:
        return group
    return SimpleNamespace(
        cpu_group=dist.new_group([group.rank], backend="gloo"),
        device_group=None,
        rank_in_group=0,
        world_size=1,
        is_first_rank=True,
        is_last_rank=True,
        rank=0,
        ranks=[group.rank],
    )


def _publish(
    mode: str, bootstrap_port: int, rank: int = 0, size: int = 1, store_port: int | None = None
) -> ServerArgs:
    from sglang.srt.runtime_context import SpawnRanks, get_parallel, publish

    sa = ServerArgs(
        model_path="dummy",
        device="cpu",
        disaggregation_mode=mode,
        disaggregation_transfer_backend="mooncake",
        disaggregation_bootstrap_port=bootstrap_port,
        host="127.0.0.1",
        tp_size=size,
    )
    publish(sa, role="scheduler", ranks=SpawnRanks(world_rank=rank, gpu_id=rank))
    tp = _group(rank, size, store_port)
    alone = _single(tp)
    get_parallel().override_permanently(
        tp_group=tp, attn_tp_group=tp, attn_cp_group=alone, pp_group=alone
    )
    from sglang.srt.distributed.device_communicators.mooncake_transfer_engine import (
        init_mooncake_transfer_engine,
    )

    from kvlifetime.adapters.sockets import listening_ports

    before = listening_ports()
    init_mooncake_transfer_engine(hostname="127.0.0.1", gpu_id=0)
    # The engine's handshake (rpc) and data ports: a fence is observed when they close.
    ENGINE_PORTS.update(listening_ports() - before)
    return sa


ENGINE_PORTS: set[int] = set()
FENCE_NAME = "mooncake_decode_engine_recreated"


def _parallel() -> Any:
    from sglang.srt.runtime_context import get_parallel

    return get_parallel()


def _kv_pool(tokens: int, heads: int = HEADS) -> MHATokenToKVPool:
    return MHATokenToKVPool(
        tokens,
        page_size=1,
        dtype=DTYPE,
        head_num=heads,
        head_dim=HEAD_DIM,
        layer_num=LAYERS,
        device="cpu",
        enable_memory_saver=False,
        enable_alt_stream=False,
    )


def _count(pool: MHATokenToKVPool, pages: list[int], value: float) -> int:
    """Elements equal to ``value`` in the K and V buffers of every layer, at ``pages``."""
    idx = torch.tensor(pages, dtype=torch.int64)
    marker = torch.tensor(value, dtype=DTYPE)
    total = 0
    for buf in (*pool.k_buffer, *pool.v_buffer):
        total += int((buf[idx] == marker).sum())
    return total


def _fill(pool: MHATokenToKVPool, pages: list[int], value: float) -> None:
    idx = torch.tensor(pages, dtype=torch.int64)
    for buf in (*pool.k_buffer, *pool.v_buffer):
        buf[idx] = value


_POLL_NAMES = {
    getattr(KVPoll, n): n
    for n in ("Failed", "Bootstrapping", "WaitingForInput", "Transferring", "Success")
}


def _poll_name(value: int) -> str:
    return _POLL_NAMES.get(int(value), f"unknown({value})")


def elements_per_page(heads: int = HEADS) -> int:
    return 2 * LAYERS * heads * HEAD_DIM


def _request(rid: str, room: int, tokens: int, port: int, seed: int | None) -> Req:
    base = room if seed is None else seed  # the prompt's token ids start here
    return Req(
        rid,
        "",
        array("q", [(base + i) % VOCAB for i in range(tokens)]),
        SamplingParams(max_new_tokens=4),
        bootstrap_host="127.0.0.1",
        bootstrap_port=port,
        bootstrap_room=room,
        vocab_size=VOCAB,
    )


class StandInScheduler(SimpleNamespace):
    """Stands for SGLang's ``Scheduler``: carries the attributes its queue code reads; a
    method it lacks is the Scheduler's own (with its disaggregation mixins), run on it."""

    def __getattr__(self, name: str) -> Any:
        method = getattr(Scheduler, name, None)
        if name.startswith("__") or not callable(method):
            raise AttributeError(name)
        return types.MethodType(method, self)


def _stand_in(sa: ServerArgs, **extra: Any) -> StandInScheduler:
    """The attributes SGLang's queue code and the Scheduler methods it runs unbound read."""
    return StandInScheduler(
        server_args=sa,
        spec_algorithm=SpeculativeAlgorithm.NONE,
        random_seed=0,
        enable_decode_hicache=False,
        enable_hisparse=False,
        enable_lora=False,
        enable_priority_scheduling=False,
        kv_checksum_computer=None,
        output_streamer=SimpleNamespace(stream_output=lambda *a, **k: None),
        metrics_reporter=SimpleNamespace(enable_metrics=False),
        running_batch=SimpleNamespace(reqs=[]),
        waiting_queue=[],
        last_batch=None,
        chunked_req=None,
        mm_receiver=None,
        dllm_config=None,
        scheduler_stage_metrics=None,
        model_config=SimpleNamespace(
            num_hidden_layers=LAYERS,
            hf_text_config=SimpleNamespace(),
            get_total_num_kv_heads=lambda: HEADS,
        ),
        batch_result_processor=SimpleNamespace(_maybe_update_reasoning_tokens=lambda *a, **k: None),
        grammar_manager=SimpleNamespace(abort_requests=lambda *a, **k: None),
        **extra,
    )


class Side:
    """One side's SGLang objects; the commands both sides answer."""

    def __init__(self, options: dict[str, Any], guard: Any) -> None:
        self.guard = guard
        self.port = int(options["bootstrap_port"])
        self.reqs: dict[str, Req] = {}
        self.pages: dict[str, list[int]] = {}
        self.owners: dict[str, list[int]] = {}

    def _build_pools(
        self,
        sa: ServerArgs,
        tokens: int,
        reqs: int,
        req_pool: Any,
        *,
        heads: int = HEADS,
        radix_cache: bool,
    ) -> None:
        """The side's KV pool, its allocator, ``req_pool`` (each side has its own kind), the
        radix cache (the prefill's disabled) and the metadata slots with their allocator."""
        from sglang.srt.mem_cache.unified_cache.component_type import ComponentType
        from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

        self.kv = _kv_pool(tokens, heads)
        self.allocator = TokenToKVPoolAllocator(
            tokens, dtype=DTYPE, device="cpu", kvcache=self.kv, need_sort=False
        )
        self.req_pool = req_pool
        self.tree = UnifiedRadixCache(
            CacheInitParams(
                disable=not radix_cache,
                req_to_token_pool=self.req_pool,
                token_to_kv_pool_allocator=self.allocator,
                page_size=1,
                tree_components=(ComponentType.FULL,),
            )
        )
        self.meta_alloc = ReqToMetadataIdxAllocator(2 * reqs)
        self.meta = MetadataBuffers(
            2 * reqs,
            hidden_size=16,
            hidden_states_dtype=torch.float32,
            max_sampling_mask_tokens=sa.sampling_mask_max_tokens,
        )

    def _scheduler(
        self,
        sa: ServerArgs,
        mode: DisaggregationMode,
        model_runner: dict[str, Any],
        **extra: Any,
    ) -> StandInScheduler:
        """The stand-in scheduler over the pools ``_build_pools`` made."""
        return _stand_in(
            sa,
            disaggregation_mode=mode,
            tree_cache=self.tree,
            req_to_token_pool=self.req_pool,
            token_to_kv_pool_allocator=self.allocator,
            tp_worker=SimpleNamespace(
                is_hybrid_swa=False,
                model_runner=SimpleNamespace(kv_cache_dtype_str="auto", **model_runner),
            ),
            **extra,
        )

    def guard_stats(self) -> Any:
        if self.guard is None:
            return None
        return _plain(self.guard.stats())

    def finished(self, rid: str) -> dict[str, Any] | None:
        """How SGLang finished request ``rid`` (its ``finished_reason``), if it did."""
        reason = self.reqs[rid].finished_reason
        if reason is None:
            return None
        return {
            "type": type(reason).__name__,
            "status_code": int(getattr(reason, "status_code", 0) or 0),
            "message": str(getattr(reason, "message", "")),
        }

    def ping(self) -> str:
        return "pong"

    def new_owner(self, name: str, value: float) -> dict[str, Any]:
        """A later request takes every free page (the pool is sized so that it must take the
        freed ones) and writes its own pattern into them."""
        n = int(self.allocator.available_size())
        got = self.allocator.alloc(n) if n else None
        pages = [] if got is None else [int(x) for x in got]
        _fill(self.kv, pages, value)
        self.owners[name] = pages
        return {"pages": pages}

    def count(self, pages: list[int], value: float) -> int:
        return _count(self.kv, pages, value)


def _plain(value: Any) -> Any:
    """A picklable rendering of the guard's stats (dataclasses, enums, mappings)."""
    import dataclasses
    import enum

    import attrs

    if attrs.has(type(value)):
        return {a.name: _plain(getattr(value, a.name)) for a in attrs.fields(type(value))}
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        return [_plain(v) for v in value]
    if isinstance(value, enum.Enum):
        return value.name
    if isinstance(value, (int, float, str, bool)) or value is None:
        return value
    return repr(value)
