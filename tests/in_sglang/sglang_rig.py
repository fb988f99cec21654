"""One side of SGLang 0.5.23's PD disaggregation, in a process of its own (decode or prefill).

Everything that decides where KV bytes go is SGLang's own: the decode's ``DecodePreallocQueue``
and ``DecodeTransferQueue``, the prefill's ``PrefillBootstrapQueue``, ``MHATokenToKVPool`` on
CPU, the token and request allocators, the radix cache, ``MetadataBuffers``, the Mooncake
backend's manager / sender / receiver / bootstrap server, and Mooncake's transfer engine over TCP
on loopback. What cannot run on this machine is a model forward and a whole ``Scheduler`` (it
loads a model); the Scheduler's methods that drive the queues (``process_decode_queue``,
``abort_request``, ``process_disagg_prefill_inflight_queue``, ``send_kv_chunk``) run unbound on
a small stand-in object carrying the attributes they read. "The forward" is the prefill writing a
marker into the request's source pages.

The test talks to each side over a multiprocessing pipe: ``(command, kwargs)`` in, ``("ok",
result)`` or ``("error", traceback)`` out, one at a time, on the process's main thread (the
scheduler's thread in SGLang). SGLang's own threads (bootstrap, transfer workers, heartbeat) run
as they do in a server.

Test instrumentation, the same alone and guarded: ``sglang_transfer_gate.TransferGate`` on the
prefill's transfer engine, which can hold a transfer mid-flight.
"""

from __future__ import annotations

import os
import sys
import time
import traceback
import types
from array import array
from multiprocessing.connection import Connection
from types import SimpleNamespace
from typing import Any, Literal

# SGLang reads these when its modules load or its managers start.
os.environ.setdefault("SGLANG_HOST_IP", "127.0.0.1")
os.environ.setdefault("MOONCAKE_PROTOCOL", "tcp")
os.environ.setdefault("MC_FORCE_TCP", "1")

import torch
import torch.distributed as dist
from sglang.srt.disaggregation.base.conn import KVPoll
from sglang.srt.disaggregation.decode import (
    DecodePreallocQueue,
    DecodeReqToTokenPool,
    DecodeTransferQueue,
    SchedulerDisaggregationDecodeMixin,
)
from sglang.srt.disaggregation.prefill import (
    PrefillBootstrapQueue,
    SchedulerDisaggregationPrefillMixin,
)
from sglang.srt.disaggregation.utils import (
    DisaggregationMode,
    MetadataBuffers,
    ReqToMetadataIdxAllocator,
    TransferBackend,
)
from sglang.srt.managers.io_struct import AbortReq
from sglang.srt.managers.schedule_batch import Req
from sglang.srt.managers.scheduler import Scheduler
from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator
from sglang.srt.mem_cache.cache_init_params import CacheInitParams
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
from sglang.srt.sampling.sampling_params import SamplingParams
from sglang.srt.server_args import ServerArgs
from sglang.srt.speculative.spec_info import SpeculativeAlgorithm
from sglang_transfer_gate import TransferGate

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


def serve(role: Literal["decode", "prefill"], conn: Connection, options: dict[str, Any]) -> None:
    """The child's entry point: build one side, then answer commands until ``close``."""
    for key, value in options.get("env", {}).items():
        os.environ[key] = str(value)
    try:
        guard = None
        if options.get("guarded"):
            from kvlifetime.integrations import sglang as kv_sglang

            guard = kv_sglang.install(role=role, **options.get("guard_options", {}))
        side: Side = (DecodeSide if role == "decode" else PrefillSide)(options, guard)
    except BaseException:
        conn.send(("error", traceback.format_exc()))
        return
    conn.send(("ok", {"pid": os.getpid()}))
    while True:
        try:
            command, kwargs = conn.recv()
        except EOFError:
            return
        if command == "close":
            conn.send(("ok", None))
            os._exit(0)  # SGLang's daemon threads and Mooncake's engine need no orderly exit
        try:
            result = getattr(side, command)(**kwargs)
        except BaseException:
            conn.send(("error", traceback.format_exc()))
        else:
            conn.send(("ok", result))


# ------------------------------------------------------------------- shared set-up


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


# ------------------------------------------------------------------------ the sides


class Side:
    def __init__(self, options: dict[str, Any], guard: Any) -> None:
        self.guard = guard
        self.port = int(options["bootstrap_port"])

    def guard_stats(self) -> Any:
        if self.guard is None:
            return None
        return _plain(self.guard.stats())

    def ping(self) -> str:
        return "pong"


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


class DecodeSide(Side):
    def __init__(self, options: dict[str, Any], guard: Any) -> None:
        super().__init__(options, guard)
        tokens = int(options["pool_tokens"])
        reqs = int(options.get("max_reqs", 8))
        t = time.monotonic()
        sa = _publish("decode", self.port)
        t = _phase("decode publish + engine", t)
        self.kv = _kv_pool(tokens)
        self.allocator = TokenToKVPoolAllocator(
            tokens, dtype=DTYPE, device="cpu", kvcache=self.kv, need_sort=False
        )
        self.req_pool = DecodeReqToTokenPool(
            size=reqs,
            max_context_len=tokens + 8,
            device="cpu",
            enable_memory_saver=False,
            pre_alloc_size=reqs,
        )
        from sglang.srt.mem_cache.unified_cache.component_type import ComponentType
        from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

        self.tree = UnifiedRadixCache(
            CacheInitParams(
                disable=False,
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
        self.sched = _stand_in(
            sa,
            disaggregation_mode=DisaggregationMode.DECODE,
            tree_cache=self.tree,
            req_to_token_pool=self.req_pool,
            token_to_kv_pool_allocator=self.allocator,
            tp_worker=SimpleNamespace(
                is_hybrid_swa=False,
                model_runner=SimpleNamespace(kv_cache_dtype_str="auto"),
            ),
            collect_inflight_reqs=lambda: [],
        )
        self.transfer_queue = DecodeTransferQueue(
            req_to_metadata_buffer_idx_allocator=self.meta_alloc,
            metadata_buffers=self.meta,
            scheduler=self.sched,
            tree_cache=self.tree,
        )
        self.sched.disagg_decode_transfer_queue = self.transfer_queue
        self.prealloc_queue = DecodePreallocQueue(
            req_to_token_pool=self.req_pool,
            token_to_kv_pool_allocator=self.allocator,
            draft_token_to_kv_pool=None,
            req_to_metadata_buffer_idx_allocator=self.meta_alloc,
            metadata_buffers=self.meta,
            scheduler=self.sched,
            transfer_queue=self.transfer_queue,
            tree_cache=self.tree,
            gpu_id=0,
            bootstrap_port=self.port,
            max_total_num_tokens=tokens,
            num_reserved_decode_tokens=0,
            transfer_backend=TransferBackend.MOONCAKE,
        )
        self.sched.disagg_decode_prealloc_queue = self.prealloc_queue
        _phase("decode queues", t)
        self.reqs: dict[str, Req] = {}
        self.pages: dict[str, list[int]] = {}
        self.owners: dict[str, list[int]] = {}

    # -- requests

    def admit(self, rid: str, room: int, tokens: int, seed: int | None = None) -> None:
        req = _request(rid, room, tokens, self.port, seed)
        self.reqs[rid] = req
        self.prealloc_queue.add(req)

    def tick(self) -> dict[str, Any]:
        """One scheduler iteration of the decode's disaggregation queues."""
        SchedulerDisaggregationDecodeMixin.process_decode_queue(self.sched)
        self._note_pages()
        return self.where()

    def _note_pages(self) -> None:
        for decode_req in self.transfer_queue.queue:
            req = decode_req.req
            if req.rid in self.reqs and req.rid not in self.pages:
                n = len(req.origin_input_ids)
                row = self.req_pool.req_to_token[req.kv.req_pool_idx, :n]
                self.pages[req.rid] = [int(x) for x in row]

    def where(self) -> dict[str, Any]:
        """Where each request is: prealloc, transfer, held (deferred release), running
        (transferred, on the waiting queue), or gone (released)."""
        places: dict[str, str] = {rid: "gone" for rid in self.reqs}
        for d in self.prealloc_queue.queue:
            places[d.req.rid] = "prealloc"
        for d in self.transfer_queue.queue:
            places[d.req.rid] = "transfer"
        for entry in self.transfer_queue._deferred_releases:
            places[entry[0].req.rid] = "held"
        for r in self.sched.waiting_queue:
            places[r.rid] = "running"
        return {
            "places": places,
            "free_pages": int(self.allocator.available_size()),
            "free_meta": int(self.meta_alloc.available_size()),
        }

    def abort(self, rid: str) -> None:
        Scheduler.abort_request(self.sched, AbortReq(rid=rid))

    def request_pages(self, rid: str) -> list[int]:
        return self.pages[rid]

    def count(self, pages: list[int], value: float) -> int:
        return _count(self.kv, pages, value)

    def new_owner(self, name: str, value: float) -> dict[str, Any]:
        """A later request takes every free page (the pool is sized so that it must take the
        freed ones) and writes its own pattern into them."""
        n = int(self.allocator.available_size())
        got = self.allocator.alloc(n) if n else None
        pages = [] if got is None else [int(x) for x in got]
        _fill(self.kv, pages, value)
        self.owners[name] = pages
        return {"pages": pages}

    def fill(self, pages: list[int], value: float) -> None:
        _fill(self.kv, pages, value)

    def owner_pages(self, name: str) -> list[int]:
        return self.owners[name]

    def free_owner(self, name: str) -> None:
        pages = self.owners.pop(name)
        if pages:
            self.allocator.free(torch.tensor(pages, dtype=torch.int64))

    def output(self, rid: str) -> dict[str, Any]:
        req = self.reqs[rid]
        return {"output_ids": list(req.output_ids), "finished": repr(req.finished_reason)}

    def deferred_rooms(self) -> list[int]:
        return [int(e[0].req.bootstrap_room) for e in self.transfer_queue._deferred_releases]

    def fence(self) -> dict[str, Any]:
        """End every prefill's access to this decode's KV pages and metadata slots.

        On Mooncake TCP nothing short of destroying the serving engine does (``unregister``
        only refuses requests that have not yet passed their header check). SGLang's decode
        holds one process-wide engine (``MooncakeTransferEngine``, shared by its KV manager):
        a new engine is started and the same buffers registered with it, the wrapper's engine
        and session id swapped, the manager's cached prefill connections dropped (so the next
        request registers the new session with each prefill), then the old engine destroyed
        (its destructor closes every accepted session and joins its copy thread), observed by
        its ports closing. Every in-flight transfer to this decode, of any request, fails."""
        from mooncake.engine import TransferEngine
        from sglang.srt.utils.network import NetworkAddress

        from kvlifetime.adapters.sockets import listening_ports, wait_closed

        mgr = self.prealloc_queue.kv_manager
        wrapper = mgr.engine
        t0 = time.monotonic()
        old, old_session, old_ports = wrapper.engine, wrapper.session_id, set(ENGINE_PORTS)
        before = listening_ports()
        wrapper.engine = TransferEngine()
        wrapper.initialize(hostname=wrapper.hostname, device_name=wrapper.ib_device)
        new_ports = listening_ports() - before
        wrapper.session_id = NetworkAddress(
            wrapper.hostname, wrapper.engine.get_rpc_port()
        ).to_host_port_str()
        mgr.register_buffer_to_engine()
        with mgr.connection_lock:
            mgr.connection_pool.clear()
        t1 = time.monotonic()
        regions = [ptr for ptr, _ in mgr._registerable_regions()]
        old.batch_unregister_memory(regions)  # refuse new requests at once
        del old  # the last reference: the engine is destroyed here
        wait_closed(old_ports, "sglang decode's mooncake engine")
        t2 = time.monotonic()
        ENGINE_PORTS.clear()
        ENGINE_PORTS.update(new_ports)
        revoked = self.guard.revoke(FENCE_NAME) if self.guard is not None else None
        return {
            "old_session": old_session,
            "new_session": wrapper.session_id,
            "new_engine_s": t1 - t0,
            "old_engine_gone_s": t2 - t1,
            "total_s": time.monotonic() - t0,
            "revoked": revoked,
        }

    def reregister(self) -> None:
        """Unregister the decode's buffers from its engine and register them again (what the
        decode would have to do to keep serving later requests after an unregister)."""
        mgr = self.prealloc_queue.kv_manager
        mgr.deregister_buffer_to_engine()
        mgr.register_buffer_to_engine()

    def status(self, room: int) -> str:
        """The receiving manager's status of ``room`` (a read: no poll, no side effect)."""
        mgr = self.prealloc_queue.kv_manager
        if room not in mgr.request_status:
            return "none"
        return _poll_name(mgr.check_status(room))

    def acks(self, room: int) -> dict[str, Any] | None:
        """The ABORT_ACKs recorded for ``room``'s current abort generation (a read)."""
        state = self.prealloc_queue.kv_manager._deferred_abort_ack_tracker.get(room)
        if state is None:
            return None
        return {"generation": int(state.generation), "ranks": sorted(state.prefill_ranks)}


class PrefillSide(Side):
    def __init__(self, options: dict[str, Any], guard: Any) -> None:
        super().__init__(options, guard)
        tokens = int(options["pool_tokens"])
        reqs = int(options.get("max_reqs", 8))
        from sglang.srt.disaggregation.mooncake.conn import MooncakeKVBootstrapServer

        rank, size = int(options.get("tp_rank", 0)), int(options.get("tp_size", 1))
        t = time.monotonic()
        if rank == 0:  # one bootstrap server per prefill instance, on its first rank
            self.bootstrap_server = MooncakeKVBootstrapServer("127.0.0.1", self.port)
        t = _phase("bootstrap server", t)
        sa = _publish("prefill", self.port, rank, size, options.get("store_port"))
        t = _phase("prefill publish + engine", t)
        self.kv = _kv_pool(tokens, HEADS // size)
        self.allocator = TokenToKVPoolAllocator(
            tokens, dtype=DTYPE, device="cpu", kvcache=self.kv, need_sort=False
        )
        self.req_pool = ReqToTokenPool(
            size=reqs, max_context_len=tokens + 8, device="cpu", enable_memory_saver=False
        )
        from sglang.srt.mem_cache.unified_cache.component_type import ComponentType
        from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

        self.tree = UnifiedRadixCache(
            CacheInitParams(
                disable=True,
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
        self.sched = _stand_in(
            sa,
            disaggregation_mode=DisaggregationMode.PREFILL,
            tree_cache=self.tree,
            req_to_token_pool=self.req_pool,
            token_to_kv_pool_allocator=self.allocator,
            rust_server=None,
            kv_shard_widening=1,
            tp_worker=SimpleNamespace(
                is_hybrid_swa=False,
                model_runner=SimpleNamespace(
                    kv_cache_dtype_str="auto",
                    effective_logical_max_total_num_tokens=tokens,
                ),
            ),
            disagg_metadata_buffers=self.meta,
            req_to_metadata_buffer_idx_allocator=self.meta_alloc,
            disagg_prefill_inflight_queue=[],
            disagg_prefill_pending_chunk_rids=set(),
            enable_staging=False,
            attn_cp_cpu_group=_parallel().attn_cp_group.cpu_group,
            attn_tp_cpu_group=_parallel().attn_tp_group.cpu_group,
            processed_tokens_counter=0,
        )
        self.bootstrap_queue = PrefillBootstrapQueue(
            token_to_kv_pool=self.kv,
            draft_token_to_kv_pool=None,
            req_to_metadata_buffer_idx_allocator=self.meta_alloc,
            metadata_buffers=self.meta,
            gpu_id=0,
            bootstrap_port=self.port,
            max_total_num_tokens=tokens,
            scheduler=self.sched,
            scheduler_stage_metrics=None,
            transfer_backend=TransferBackend.MOONCAKE,
        )
        self.sched.disagg_prefill_bootstrap_queue = self.bootstrap_queue
        _phase("prefill queues", t)
        self.mgr = self.bootstrap_queue.kv_manager
        self.reqs: dict[str, Req] = {}
        self.pages: dict[str, list[int]] = {}
        self.owners: dict[str, list[int]] = {}
        # SGLang's MooncakeTransferEngine (the process's one): every batch the worker sends.
        self.gate = TransferGate(self.mgr.engine)

    # -- the gate on the transfer engine (test instrumentation: sglang_transfer_gate)

    def hold_transfers(self, after_batches: int, poison: bool = False) -> None:
        self.gate.hold(after_batches, poison)

    def wait_held(self, seconds: float = 10.0) -> bool:
        return self.gate.wait_held(seconds)

    def release_transfers(self, then_hold_after: int | None = None) -> None:
        self.gate.release(then_hold_after)

    def gate_calls(self) -> list[tuple[float, int | None, int]]:
        return list(self.gate.log)

    def wait_late_writes(self, timeout: float = 10.0) -> None:
        self.gate.wait_late_writes(timeout)

    # -- requests

    def admit(self, rid: str, room: int, tokens: int, seed: int | None = None) -> None:
        req = _request(rid, room, tokens, self.port, seed)
        self.reqs[rid] = req
        self.bootstrap_queue.add(req, HEADS)

    def bootstrap(self) -> list[str]:
        """One poll of the bootstrap queue; the requests it hands to the scheduler."""
        return [r.rid for r in self.bootstrap_queue.pop_bootstrapped()]

    def forward(self, rid: str, value: float) -> list[int]:
        """What a prefill forward leaves: the request's KV row allocated, its pages written
        (with ``value``), its first output token; then SGLang's ``send_kv_chunk`` publishes the
        metadata and hands the pages to the transfer worker, and the request waits on the
        inflight queue."""
        req = self.reqs[rid]
        n = len(req.origin_input_ids)
        self.req_pool.alloc([req])
        loc = self.allocator.alloc(n)
        assert loc is not None, "prefill pool full"
        self.req_pool.write((req.kv.req_pool_idx, slice(0, n)), loc)
        req.kv.kv_committed_len = n
        req.kv.kv_allocated_len = n
        req.full_untruncated_fill_ids = req.origin_input_ids + req.output_ids
        req.prefix_len = 0
        req.extend_end = n
        pages = [int(x) for x in loc]
        _fill(self.kv, pages, value)
        self.pages[rid] = pages
        req.output_ids.append(int(req.origin_input_ids[-1]) % VOCAB)
        # The Mooncake sender's host-tensor path copies page indices through pinned memory
        # and a CUDA event (GPU only); SGLang's other path (kv_to_page_indices) is the one
        # every backend without it takes.
        req.disagg_kv_sender.supports_host_tensor_indices = False
        SchedulerDisaggregationPrefillMixin.send_kv_chunk(self.sched, req, last_chunk=True)
        self.sched.disagg_prefill_inflight_queue.append(req)
        return pages

    def forwarded_pages(self, rid: str) -> list[int]:
        return self.pages[rid]

    def poll_inflight(self) -> list[str]:
        """One poll of the inflight queue (SGLang's own); the requests it concluded."""
        done = SchedulerDisaggregationPrefillMixin.process_disagg_prefill_inflight_queue(self.sched)
        return [r.rid for r in done]

    def inflight(self) -> list[str]:
        return [r.rid for r in self.sched.disagg_prefill_inflight_queue]

    def poll(self, rid: str) -> str:
        return _poll_name(self.reqs[rid].disagg_kv_sender.poll())

    def outstanding(self, room: int) -> int:
        return int(self.mgr._staging_outstanding.get(room, 0))

    def send_stale_ack(self, room: int, generation: int) -> bool:
        """SGLang's own ABORT_ACK send (``_send_abort_ack``) for ``room`` with ``generation``,
        to the decode endpoint the room's current abort registered: a late ACK of an earlier
        abort, delivered after the decode re-armed the room. False if no abort is registered."""
        from sglang.srt.disaggregation.common.conn import AckTarget

        targets = self.mgr._deferred_ack_targets.get(room) or {}
        for target in list(targets.values()):
            self.mgr._send_abort_ack(room, AckTarget(target.ip, target.port, generation))
        return bool(targets)

    def room_status(self, room: int) -> str:
        if room not in self.mgr.request_status:
            return "none"
        return _poll_name(self.mgr.check_status(room))

    def free_pages(self) -> int:
        return int(self.allocator.available_size())

    def new_owner(self, name: str, value: float) -> dict[str, Any]:
        n = int(self.allocator.available_size())
        got = self.allocator.alloc(n) if n else None
        pages = [] if got is None else [int(x) for x in got]
        _fill(self.kv, pages, value)
        self.owners[name] = pages
        return {"pages": pages}

    def count(self, pages: list[int], value: float) -> int:
        return _count(self.kv, pages, value)

    def sleep(self, seconds: float) -> None:
        time.sleep(seconds)
