"""Engine facts of vLLM 0.33: every private detail of vLLM the guard depends on, in one place.

The guard (``connector.py``) is a KV connector, and the connector hooks are vLLM's public
contract (``KVConnectorBase_V1``). To keep the blocks vLLM would free, and to hand them back
later, it needs more than the hooks show: vLLM's scheduler's request table, its free path, the
sets its receive path fills, its request statuses, where a step's new block ids are, NIXL's lease
reaper. Each such detail is one function here, and ``FACTS`` lists what each relies on, with the
vLLM 0.33 code it mirrors. ``check()`` verifies every row on the installed vLLM's classes, once,
when the guard is installed (``facts.installed``): a vLLM where one has moved is refused with
``UnsupportedEngineVersion`` naming it, rather than guarded wrongly. ``facts.py`` picks this
module for vLLM 0.33.x; another version gets a module of its own beside this one
(``facts_v0_34.py``), with the same functions.

Importable without vLLM: vLLM is imported when a fact is first used or checked. Where vLLM calls
from (the scheduler's ``__init__``, ``schedule``, ``update_from_output``) is vLLM's engine core
thread: nothing here takes a lock.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import Any, NamedTuple

from kvlifetime.errors import InvalidField
from kvlifetime.integrations import engine_facts
from kvlifetime.integrations.engine_facts import CALLS, FIELD, MEMBER, Fact, holds
from kvlifetime.integrations.hooks import Hook
from kvlifetime.integrations.vllm.errors import UnsupportedEngineVersion

VERSION = "0.33"
"""The vLLM release series these facts describe (``vllm.__version__`` 0.33.x)."""

# --------------------------------------------------------------------------- the hooks

_BASE = "vllm.distributed.kv_transfer.kv_connector.v1.base:KVConnectorBase_V1"
_HMA = "vllm.distributed.kv_transfer.kv_connector.v1.base:SupportsHMA"

HOOKS: tuple[Hook, ...] = (
    Hook(_BASE, "bind_kv_cache_manager", "after",
         "the scheduler's request table and free path bound (scheduler_hooks)", "_kvl_bind"),
    Hook(_BASE, "on_new_request", "after", "admitted", "_kvl_admitted"),
    Hook(_BASE, "update_state_after_alloc", "around",
         "a load held for the step's grant (the inner told once granted)", "_kvl_alloc"),
    Hook(_BASE, "build_connector_meta", "around",
         "the step begins: fences applied, the step's loads granted (WRITE) or refused, "
         "released blocks handed back", "_kvl_step"),
    Hook(_BASE, "request_finished", "after",
         "finished / aborted (a delayed free: READ granted, into the step's journal)",
         "_kvl_finished"),
    Hook(_HMA, "request_finished_all_groups", "after",
         "as request_finished (a connector that supports the hybrid allocator)",
         "_kvl_finished"),
    Hook(_BASE, "update_connector_output", "around",
         "proofs in (finished_sending / finished_recving, failed loads, reaped leases); "
         "hand-backs out, each id on one channel", "_kvl_output"),
    Hook(_BASE, "get_kv_connector_stats", "before",
         "the step ends: the journal into the ledger, the step's exposures gone",
         "_kvl_step_end"),
    Hook(_BASE, "build_connector_worker_meta", "after",
         "(worker: the lease reaps of the step, to the scheduler)", "_kvl_worker_meta"),
)  # fmt: skip
"""Where the guard sits in a vLLM 0.33 connector: each row's method of the guarded class is the
inner connector's own, wrapped (``connector.guarded_class``; a row whose method the inner
connector's class does not have, as ``request_finished_all_groups`` of a connector without
``SupportsHMA``, is not wrapped: vLLM never calls it)."""

# --------------------------------------------------------------------------- what is relied on

_SCHED = "vllm.v1.core.sched.scheduler:Scheduler"
_STATUS = "vllm.v1.request:RequestStatus"
_OUTPUT = "vllm.v1.core.sched.output"
_NIXL = "vllm.distributed.kv_transfer.kv_connector.v1.nixl"


FACTS: tuple[Fact, ...] = (
    Fact(_SCHED, "bind_kv_cache_manager", CALLS,
         "scheduler.py, Scheduler.__init__ ends with connector.bind_kv_cache_manager("
         "self.kv_cache_manager), from its own frame: scheduler_hooks finds the Scheduler there",
         method="__init__"),
    Fact(_SCHED, "connector", FIELD,
         "Scheduler.connector: the connector the Scheduler binds (scheduler_hooks: a nested "
         "connector is not the scheduler's)"),
    Fact(_SCHED, "kv_cache_manager", FIELD,
         "Scheduler.kv_cache_manager: scheduler_hooks tells the binding Scheduler by it"),
    Fact(_SCHED, "requests", FIELD,
         "Scheduler.requests (request id -> Request): which ids vLLM holds, and in which "
         "status (scheduler_hooks: holds, phase)"),
    Fact(_SCHED, "_free_blocks", MEMBER,
         "Scheduler._free_blocks(request): frees a finished request's blocks and forgets it, as "
         "_update_from_kv_xfer_finished does on finished_sending (scheduler_hooks: free)"),
    Fact(_SCHED, "finished_recving_kv_req_ids", FIELD,
         "the set _update_from_kv_xfer_finished adds a received id to; the next schedule() "
         "moves its request on (scheduler_hooks: received, refuse_load)"),
    Fact(_SCHED, "failed_recving_kv_req_ids", FIELD,
         "the set _handle_failed_recving adds a failed load to under "
         "kv_load_failure_policy='recompute' (scheduler_hooks: refuse_load)"),
    Fact(_SCHED, "_set_kv_fetch_stage", MEMBER,
         "Scheduler._set_kv_fetch_stage(request, stage): the fetch-stage metric "
         "_update_from_kv_xfer_finished moves on a receive (scheduler_hooks: received)"),
    Fact("vllm.v1.metrics.stats", "KV_FETCH_COMPLETED_WAITING", MEMBER,
         "the stage a received request waits in (scheduler_hooks: received)"),
    Fact(_SCHED, "get_kv_connector_stats", CALLS,
         "update_from_output calls connector.get_kv_connector_stats() once, at its end, after "
         "the step's request_finished and update_connector_output: the guard's step end",
         method="update_from_output"),
    Fact(_SCHED, "pause_state", MEMBER,
         "Scheduler.pause_state: UNPAUSED unless the engine is pausing or paused (its pause and "
         "sleep step the scheduler while it has requests; scheduler_hooks: paused)"),
    Fact("vllm.v1.core.sched.interface:PauseState", "UNPAUSED", MEMBER,
         "the pause state of a scheduler that is not paused (scheduler_hooks: paused)"),
    Fact(_STATUS, "WAITING_FOR_REMOTE_KVS", MEMBER,
         "a request whose asynchronous load is in flight (statuses, scheduler_hooks)"),
    Fact(_STATUS, "FINISHED_ABORTED", MEMBER, "a request ended by abort (statuses)"),
    Fact(_STATUS, "FINISHED_ERROR", MEMBER, "a request ended by an error (statuses)"),
    Fact(_STATUS, "is_finished", MEMBER,
         "RequestStatus.is_finished(status): ended, whichever way (scheduler_hooks: phase)"),
    Fact("vllm.v1.request:Request", "num_computed_tokens", FIELD,
         "set to 0 by _handle_failed_recving: the load loaded nothing (scheduler_hooks: "
         "refuse_load)"),
    Fact(f"{_OUTPUT}:SchedulerOutput", "scheduled_new_reqs", FIELD,
         "the step's new requests, each with its block ids (new_blocks)"),
    Fact(f"{_OUTPUT}:SchedulerOutput", "scheduled_cached_reqs", FIELD,
         "the step's running requests (new_blocks)"),
    Fact(f"{_OUTPUT}:NewRequestData", "block_ids", FIELD,
         "a new request's block ids, one list per KV-cache group (new_blocks)"),
    Fact(f"{_OUTPUT}:CachedRequestData", "new_block_ids", FIELD,
         "the block ids a running request got this step, per request, or None (new_blocks)"),
    Fact("vllm.v1.kv_cache_interface:KVCacheConfig", "num_blocks", FIELD,
         "the KV cache's size in blocks, as the connector is built with it (num_blocks)"),
    Fact("vllm.config.cache:CacheConfig", "num_gpu_blocks", FIELD,
         "the same size, when the connector is built without a KVCacheConfig (num_blocks)"),
    Fact("vllm.v1.core.kv_cache_manager:KVCacheManager", "block_pool", FIELD,
         "the manager's BlockPool (null_block_id)"),
    Fact("vllm.v1.core.block_pool:BlockPool", "null_block", FIELD,
         "block_pool.py: the placeholder block sliding-window and mamba lists repeat, never "
         "handed to a request (null_block_id)"),
    Fact("vllm.v1.core.kv_cache_utils:KVCacheBlock", "block_id", FIELD,
         "a block's id (null_block_id)"),
    Fact(f"{_NIXL}.connector:NixlBaseConnector", "connector_worker", FIELD,
         "nixl/connector.py: the worker half of a NIXL connector (watch_reaper)"),
    Fact(f"{_NIXL}.base_worker:NixlBaseConnectorWorker", "_reap_expired_send_leases", MEMBER,
         "nixl/base_worker.py: get_transfer_results calls it with the step's finished_sending "
         "set; it adds the ids whose send lease expired (watch_reaper)"),
)  # fmt: skip
"""Every private detail of vLLM 0.33 the functions below rely on: ``check()`` looks for each."""


# --------------------------------------------------------------------------- the facts


def flat(block_ids: Any) -> list[int]:
    """vLLM passes block ids as a list, or one list per KV-cache group (one block pool)."""
    if block_ids and isinstance(block_ids[0], (list, tuple)):
        return [b for group in block_ids for b in group]
    return list(block_ids)


def null_block_id(kv_cache_manager: Any) -> int:
    """The id of vLLM's placeholder block (``BlockPool.null_block``): sliding-window and mamba
    block lists repeat it; it is never a request's, so never exposed."""
    return int(kv_cache_manager.block_pool.null_block.block_id)


class Statuses(NamedTuple):
    """The ``RequestStatus`` values the guard tells apart."""

    waiting_for_remote_kvs: Any
    """An asynchronous load in flight: vLLM waits for its ``finished_recving``."""
    ended_by_abort: frozenset[Any]
    """Ended by an abort or an error (``FINISHED_ABORTED``, ``FINISHED_ERROR``)."""


@functools.cache
def statuses() -> Statuses:
    """vLLM 0.33's ``RequestStatus`` members the guard compares a request's status with."""
    from vllm.v1.request import RequestStatus

    return Statuses(
        RequestStatus.WAITING_FOR_REMOTE_KVS,
        frozenset((RequestStatus.FINISHED_ABORTED, RequestStatus.FINISHED_ERROR)),
    )


class SchedulerHooks(NamedTuple):
    """What the guard uses of the vLLM ``Scheduler`` that bound it."""

    requests: dict[str, Any]
    """``Scheduler.requests``: the truth about which ids vLLM holds (an id it does not hold
    would trip its asserts; one it holds, even one the guard never saw, is vLLM's business)."""
    phase: Callable[[str], str | None]
    """Where the scheduler has a request, as the guard names it (``ConnectorGuard.phase``)."""
    free: Callable[[Any], Any] | None
    """``Scheduler._free_blocks``: give a finished request's blocks back to vLLM."""
    received: Callable[[Any], None] | None
    """Tell vLLM a request waiting for remote KVs received them (None: no such set)."""
    refuse_load: Callable[[Any], None] | None
    """Tell vLLM a load loaded nothing, as its recompute policy does (None: no such sets; the
    inner connector is then told of every load at once)."""
    load_over: Callable[[str], None] | None = None
    """Tell vLLM an ended request's load is over, for an id the guard hands back on
    ``finished_sending`` (vLLM 0.34's load cap, ``facts_v0_34``; None: nothing to tell)."""
    paused: Callable[[], bool] | None = None
    """Whether the engine is pausing or paused (``Scheduler.pause_state``): its pause and sleep
    step the scheduler until it holds no request, so a request the guard delays keeps them
    waiting (``connector``: the guard then says what for)."""


def scheduler_hooks(kv_cache_manager: Any, connector: Any = None) -> SchedulerHooks | None:
    """The ``Scheduler`` binding ``kv_cache_manager``, as hooks; None when the caller is no
    such scheduler (a connector driven by hand). Called from the connector's
    ``bind_kv_cache_manager``, which vLLM 0.33's ``Scheduler.__init__`` calls from its own frame:
    the scheduler is the ``self`` of the nearest such frame (no hook passes it)."""
    owner = _binding_scheduler(kv_cache_manager, connector)
    return None if owner is None else hooks_of(owner)


def hooks_of(owner: Any) -> SchedulerHooks:
    """The hooks of the ``Scheduler`` ``owner`` (``scheduler_hooks`` found it)."""
    requests = owner.requests
    return SchedulerHooks(
        requests=requests,
        phase=_phase_in(requests),
        free=getattr(owner, "_free_blocks", None),
        received=_receive_in(owner),
        refuse_load=_refuse_load_in(owner),
        paused=_paused_in(owner),
    )


def _binding_scheduler(kv_cache_manager: Any, connector: Any = None, depth: int = 8) -> Any:
    """The ``self`` of the nearest calling frame (within ``depth``) that has ``kv_cache_manager``
    as its ``kv_cache_manager`` and a ``requests`` dict, and ``connector`` (when given) as its
    own ``connector``: vLLM's ``Scheduler`` binding this very connector. A connector nested in
    another (a ``MultiConnector``'s child) is not the scheduler's: None, as for one driven by
    hand (its request table and free path are the outer connector's business)."""
    frame = sys._getframe(1)
    for _ in range(depth):
        frame = frame.f_back  # type: ignore[assignment]
        if frame is None:
            return None
        owner = frame.f_locals.get("self")
        if getattr(owner, "kv_cache_manager", None) is kv_cache_manager and isinstance(
            getattr(owner, "requests", None), dict
        ):
            if connector is not None and getattr(owner, "connector", None) is not connector:
                return None
            return owner
    return None


def _paused_in(scheduler: Any) -> Callable[[], bool]:
    from vllm.v1.core.sched.interface import PauseState

    unpaused = PauseState.UNPAUSED
    return lambda: bool(scheduler.pause_state != unpaused)


def _phase_in(requests: dict[str, Any]) -> Callable[[str], str | None]:
    from vllm.v1.request import RequestStatus

    waiting = RequestStatus.WAITING_FOR_REMOTE_KVS
    is_finished = RequestStatus.is_finished

    def phase(request: str) -> str | None:
        req = requests.get(request)
        if req is None:
            return None
        if is_finished(req.status):
            return "finished"
        if req.status == waiting:
            return "waiting_for_remote_kvs"
        return "running"

    return phase


def _receive_in(scheduler: Any) -> Callable[[Any], None] | None:
    """What ``_update_from_kv_xfer_finished`` does with a ``finished_recving`` id of a request
    waiting for remote KVs: the id joins ``finished_recving_kv_req_ids`` (the next
    ``schedule()`` moves the request on) and its fetch stage becomes
    ``KV_FETCH_COMPLETED_WAITING``."""
    done = getattr(scheduler, "finished_recving_kv_req_ids", None)
    if not isinstance(done, set):
        return None
    from vllm.v1.metrics.stats import KV_FETCH_COMPLETED_WAITING

    stage = getattr(scheduler, "_set_kv_fetch_stage", None)
    waiting = statuses().waiting_for_remote_kvs

    def received(req: Any) -> None:
        if req.status == waiting:
            done.add(req.request_id)
            if stage is not None:
                stage(req, KV_FETCH_COMPLETED_WAITING)

    return received


def _refuse_load_in(scheduler: Any) -> Callable[[Any], None] | None:
    """How vLLM's scheduler marks a failed load under ``kv_load_failure_policy="recompute"``
    (``_handle_failed_recving``: no computed tokens, the id in ``failed_recving_kv_req_ids``),
    with the receive it waits for (``finished_recving_kv_req_ids``): at its next step vLLM frees
    the blocks and schedules the request again."""
    failed = getattr(scheduler, "failed_recving_kv_req_ids", None)
    done = getattr(scheduler, "finished_recving_kv_req_ids", None)
    if not isinstance(failed, set) or not isinstance(done, set):
        return None
    waiting = statuses().waiting_for_remote_kvs

    def refused(req: Any) -> None:
        if req.status == waiting:
            req.num_computed_tokens = 0
            failed.add(req.request_id)
            done.add(req.request_id)

    return refused


def new_blocks(scheduler_output: Any) -> list[int]:
    """Every block id vLLM gave a request in this step: new requests'
    (``scheduled_new_reqs[i].block_ids``) and running ones'
    (``scheduled_cached_reqs.new_block_ids``)."""
    out: list[int] = []
    for new in scheduler_output.scheduled_new_reqs:
        out.extend(flat(new.block_ids))
    for ids in scheduler_output.scheduled_cached_reqs.new_block_ids:
        if ids:
            out.extend(flat(ids))
    return out


def num_blocks(vllm_config: Any, kv_cache_config: Any) -> int:
    """The KV cache's size in blocks: ``KVCacheConfig.num_blocks``, else
    ``CacheConfig.num_gpu_blocks``; ``InvalidField`` when neither is known."""
    n = getattr(kv_cache_config, "num_blocks", None)
    if not n:
        n = getattr(vllm_config.cache_config, "num_gpu_blocks", None)
    if not n:
        raise InvalidField("GuardedConnector: the KV cache's number of blocks is unknown")
    return int(n)


SIZED_AT_BIND = False
"""Whether a scheduler-side connector built without its KV cache's size is sized when bound
(vLLM 0.34 builds one with ``num_blocks=0`` to ask it things); in 0.33 the size is known at
construction, and an unknown one is refused (``num_blocks``)."""


def num_blocks_of(kv_cache_manager: Any) -> int:
    """The size of the block pool the guard is bound to (``BlockPool.num_gpu_blocks``)."""
    return int(kv_cache_manager.block_pool.num_gpu_blocks)


def check_transfer_mode(connector_cls: type[Any], kv_transfer_config: Any) -> None:
    """vLLM 0.33 has one NIXL connector class: nothing to check (``facts_v0_34``)."""


def kv_cache_access(connector_cls: type[Any], kv_transfer_config: Any) -> int | None:
    """How the connector's workers reach the KV cache, as vLLM's flags: vLLM 0.33 has no such
    query (None: not asked; ``inner_connectors`` then goes by the class alone)."""
    return None


def watch_reaper(connector: Any, reaped: set[str]) -> bool:
    """Watch the worker-side connector's lease reaper (NIXL's
    ``connector_worker._reap_expired_send_leases(done_sending)``, which adds the ids whose send
    lease expired to the step's ``finished_sending``): each id it adds is put in ``reaped``
    too. False when the connector has no such reaper."""
    worker = getattr(connector, "connector_worker", None)
    reap = getattr(worker, "_reap_expired_send_leases", None)
    if worker is None or reap is None:
        return False

    def watched(done_sending: set[str]) -> None:
        before = set(done_sending)
        reap(done_sending)
        reaped.update(done_sending - before)

    worker._reap_expired_send_leases = watched
    return True


# --------------------------------------------------------------------------- the check


def check() -> None:
    """Every row of ``FACTS`` on the installed vLLM's classes; ``UnsupportedEngineVersion``
    naming those not found. Imports vLLM."""
    refuse_missing(VERSION, [row.fact for row in HOOKS] + list(FACTS))


def refuse_missing(version: str, rows: list[Fact]) -> None:
    """``UnsupportedEngineVersion`` naming the rows the installed vLLM does not have (the
    facts module of release series ``version`` relies on them)."""
    missing = engine_facts.missing(rows)
    if missing:
        import vllm

        raise UnsupportedEngineVersion(
            f"kvlifetime's vLLM guard relies on private details of vLLM {version}.x "
            f"(kvlifetime/integrations/vllm/facts_v{version.replace('.', '_')}.py) that "
            f"vLLM {getattr(vllm, '__version__', '?')} does not have: {', '.join(missing)}; "
            "nothing was guarded"
        )


__all__ = [
    "CALLS",
    "FACTS",
    "FIELD",
    "HOOKS",
    "MEMBER",
    "SIZED_AT_BIND",
    "VERSION",
    "Fact",
    "SchedulerHooks",
    "Statuses",
    "check",
    "check_transfer_mode",
    "flat",
    "holds",
    "hooks_of",
    "kv_cache_access",
    "new_blocks",
    "null_block_id",
    "num_blocks",
    "num_blocks_of",
    "refuse_missing",
    "scheduler_hooks",
    "statuses",
    "watch_reaper",
]
