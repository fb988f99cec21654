"""Engine facts of vLLM 0.34: what differs from 0.33 for the guard, the rest taken as it is.

vLLM 0.34 keeps every private detail of 0.33's ``facts_v0_33`` the guard relies on (``FACTS``
there, checked here too), and adds what a guard must now keep up with:

- **aborted loads count against the load cap.** ``Scheduler._aborted_kv_loads`` holds the id
  of a request aborted while its asynchronous load was in flight; it counts against the new
  ``--max-num-inflight-kv-loads`` cap until vLLM sees the load's ``finished_recving``. Only
  that branch of ``_update_from_kv_xfer_finished`` removes it: an id the guard hands back
  another way (freed at a fence, or on ``finished_sending``) would stay counted, and with a cap
  of 1 no load would ever start again. So every hand-back of an ended request's blocks goes
  through ``SchedulerHooks.free``, which takes the id out of the set first (its
  ``load_over`` also does, for the ids the guard hands back on ``finished_sending``). The set
  is made after ``bind_kv_cache_manager`` runs, so it is looked up at the call, not at the
  bind.
- **the KV cache's size may be unknown at construction** (``num_blocks=0`` in the
  ``KVCacheConfig`` a connector is built with when vLLM asks it about lookahead hashing): the
  guard is then sized from the block pool it is bound to (``num_blocks_of``).
- **class-level queries** (``kv_cache_access``, ``supports_lookahead_block_hashes``,
  ``supports_sleep_mode``) are asked of the connector class vLLM selected by name: the guard
  answers with the inner connector's class (``connector.GuardedConnector``).
- **what peers reach**: ``kv_cache_access`` (the class's flags) says whether a peer or another
  process reaches the KV cache; ``inner_connectors`` reads it beside its rows (an in-process
  connector's failed load is over when reported, vLLM 0.34's offloading connector's).
- **NIXL's push mode**: ``NixlConnector`` is built as the pull or the push class from
  ``transfer_mode`` in its extra config (``factory.py``); ``nixl_push_mode`` says which.

Importable without vLLM.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kvlifetime.errors import InvalidField
from kvlifetime.integrations.engine_facts import FIELD, MEMBER, Fact
from kvlifetime.integrations.vllm import facts_v0_33 as v0_33
from kvlifetime.integrations.vllm.facts_v0_33 import (
    HOOKS,
    SchedulerHooks,
    Statuses,
    flat,
    new_blocks,
    null_block_id,
    num_blocks,
    num_blocks_of,
    statuses,
    watch_reaper,
)

VERSION = "0.34"
"""The vLLM release series these facts describe (``vllm.__version__`` 0.34.x)."""

SIZED_AT_BIND = True
"""A scheduler-side connector built with ``num_blocks=0`` is sized from the block pool it is
bound to (``facts_v0_33.num_blocks_of``)."""

_SCHED = "vllm.v1.core.sched.scheduler:Scheduler"
_BASE = "vllm.distributed.kv_transfer.kv_connector.v1.base:KVConnectorBase_V1"

FACTS: tuple[Fact, ...] = (
    *v0_33.FACTS,
    Fact(_SCHED, "_aborted_kv_loads", FIELD,
         "scheduler.py: the ids of requests aborted with a load in flight, counted against "
         "max_num_inflight_kv_loads until their finished_recving (scheduler_hooks: free, "
         "load_over)"),
    Fact(_SCHED, "_admits_inflight_kv_load", MEMBER,
         "the cap's check: in-progress + completed-waiting + aborted loads < the limit "
         "(why an aborted id must leave _aborted_kv_loads)"),
    Fact(_BASE, "kv_cache_access", MEMBER,
         "the class-level query of how workers reach the KV cache (forwarded to the inner "
         "connector's class)"),
    Fact(_BASE, "supports_lookahead_block_hashes", MEMBER,
         "the class-level query of lookahead hashing (forwarded to the inner connector's "
         "class)"),
    Fact("vllm.v1.core.block_pool:BlockPool", "num_gpu_blocks", FIELD,
         "the pool's size in blocks: the guard's size when it was built with num_blocks=0 "
         "(num_blocks_of)"),
)  # fmt: skip
"""Every private detail of vLLM 0.34 the guard relies on: ``check()`` looks for each."""


def scheduler_hooks(kv_cache_manager: Any, connector: Any = None) -> SchedulerHooks | None:
    """``facts_v0_33.scheduler_hooks``, with ``free`` taking the request's id out of
    ``Scheduler._aborted_kv_loads`` before vLLM's ``_free_blocks`` (an aborted load the guard
    releases stops counting against the load cap)."""
    owner = v0_33._binding_scheduler(kv_cache_manager, connector)
    if owner is None:
        return None
    hooks = v0_33.hooks_of(owner)
    if hooks.free is None:
        return hooks
    free_blocks = hooks.free
    over = _load_over_in(owner)

    def free(req: Any) -> Any:
        over(req.request_id)
        return free_blocks(req)

    return hooks._replace(free=free, load_over=over)


def _load_over_in(scheduler: Any) -> Callable[[str], None]:
    def over(request_id: str) -> None:
        aborted = getattr(scheduler, "_aborted_kv_loads", None)  # (made after the bind)
        if isinstance(aborted, set):
            aborted.discard(request_id)

    return over


def nixl_push_mode(kv_transfer_config: Any) -> bool:
    """Whether vLLM 0.34's factory builds ``NixlConnector`` as its push class
    (``kv_connector_extra_config["transfer_mode"] == "push"``)."""
    extra = getattr(kv_transfer_config, "kv_connector_extra_config", None) or {}
    return str(extra.get("transfer_mode", "pull")).lower() == "push"


def check_transfer_mode(connector_cls: type[Any], kv_transfer_config: Any) -> None:
    """A guarded NIXL pull class built under ``transfer_mode=push`` (``GuardedNixlConnector``
    names the registry's class, not the one vLLM's factory would pick for the mode) is refused:
    it would silently run the other protocol. ``GuardedConnector`` with ``inner:
    NixlConnector`` builds the class the factory picks, and ``GuardedNixlPushConnector`` the
    push class."""
    if not nixl_push_mode(kv_transfer_config):
        return
    names = {c.__name__ for c in connector_cls.__mro__}
    if "NixlPullConnector" in names and "NixlPushConnector" not in names:
        raise InvalidField(
            f"{connector_cls.__name__} is NIXL's pull connector, but kv_connector_extra_config "
            "says transfer_mode='push': name GuardedNixlPushConnector, or GuardedConnector "
            "with inner {'kv_connector': 'NixlConnector', ...} (vLLM's factory then picks the "
            "push class)"
        )


def kv_cache_access(connector_cls: type[Any], kv_transfer_config: Any) -> int | None:
    """The connector class's ``kv_cache_access(kv_transfer_config)`` flags, as an int (0:
    ``IN_PROCESS``, no peer reaches the KV cache; ``REGISTERS``, ``EXPORTS_*``,
    ``LEGACY_IPC``: a peer or another process does). A class that does not declare them answers
    with the base class's ``IN_PROCESS``, which ``inner_connectors`` trusts only beside a row of
    its own for that class."""
    return int(connector_cls.kv_cache_access(kv_transfer_config))


def check() -> None:
    """Every row of ``FACTS`` (and 0.33's hooks) on the installed vLLM's classes;
    ``UnsupportedEngineVersion`` naming those not found. Imports vLLM."""
    v0_33.refuse_missing(VERSION, [row.fact for row in HOOKS] + list(FACTS))


__all__ = [
    "FACTS",
    "HOOKS",
    "MEMBER",
    "SIZED_AT_BIND",
    "VERSION",
    "SchedulerHooks",
    "Statuses",
    "check",
    "check_transfer_mode",
    "flat",
    "kv_cache_access",
    "new_blocks",
    "nixl_push_mode",
    "null_block_id",
    "num_blocks",
    "num_blocks_of",
    "scheduler_hooks",
    "statuses",
    "watch_reaper",
]
