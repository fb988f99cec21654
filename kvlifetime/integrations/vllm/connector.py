"""GuardedConnector: any vLLM v1 KV connector, with its exposures guarded by a ledger.

Selected the way vLLM selects connectors::

    --kv-transfer-config '{"kv_connector": "GuardedConnector",
                           "kv_connector_module_path": "kvlifetime.integrations.vllm",
                           "kv_role": "kv_both",
                           "kv_connector_extra_config": {
                               "inner": {"kv_connector": "NixlConnector",
                                         "kv_connector_extra_config": {...}}}}'

``inner`` is the connector being guarded, in the same keys as ``kv_transfer_config``
(``kv_connector``, optionally ``kv_connector_module_path`` and ``kv_connector_extra_config``;
``kv_role`` and the rest are inherited). The object vLLM gets is an instance of a class derived
from the inner connector's own class (``guarded_class``): the inner connector runs unchanged,
``isinstance`` checks against its class hold, and the guard overrides only the hooks on vLLM's
block-freeing path:

- scheduler role: ``on_new_request`` (which ids vLLM holds), ``update_state_after_alloc`` /
  ``build_connector_meta`` (WRITE grants for asynchronous loads, the step's in one batch; the
  inner connector is told of a load only once it is granted, so a refused one never reaches
  the worker; at every step the step boundary: the fences ``revoke`` recorded, from any thread,
  take effect, and what they released goes back: ended requests freed, held failed loads
  handed on as the receive vLLM waits for), ``request_finished`` (a READ exposure into the
  step's journal when the inner delays the free; a delay for anything unproven),
  ``update_connector_output`` (evidence in, ids out: ``guard.py``), ``get_kv_connector_stats``
  (the step's end: the journal into the ledger, the step's exposures counted as gone; a
  refused READ grant's block ids are emptied from the request's transfer parameters before its
  output leaves the scheduler);
- worker role: the connector's lease reaper is watched (NIXL's ``_reap_expired_send_leases``) and
  the ids it reaped travel to the scheduler in the worker metadata (``GuardWorkerMeta``), so a
  reaped lease is told apart from a completed read where that is known.

Every private detail of vLLM this relies on (the scheduler that binds the connector, its request
table and free path, request statuses, a step's new block ids, NIXL's lease reaper) is a call
into the engine-facts module of the installed vLLM (``facts.installed()``: ``facts_v0_33``),
checked when the first guarded class is built.

The scheduler-side guard is ``connector.guard`` (``ConnectorGuard``): ``guard.stats()``,
``LedgerCollector(connector.guard.ledger)`` for Prometheus, ``guard.revoke(fence)`` once peers
are fenced (from any thread: the threading contract is ``ConnectorGuard``'s).
"""

from __future__ import annotations

import copy
import threading
from typing import Any, ClassVar

import structlog
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
)

from kvlifetime.errors import InvalidField, KVLifetimeError
from kvlifetime.integrations.hooks import PROCEED, wrapper
from kvlifetime.integrations.vllm import facts
from kvlifetime.integrations.vllm.guard import ConnectorGuard
from kvlifetime.integrations.vllm.inner_connectors import InnerEvidence, class_name, evidence_of
from kvlifetime.integrations.vllm.pause import PauseWatch

_log = structlog.get_logger("kvlifetime.guard")


class GuardWorkerMeta(KVConnectorWorkerMetadata):
    """Worker -> scheduler: the ids the worker's lease reaper put in ``finished_sending`` this
    step (and the inner connector's own worker metadata, carried unchanged)."""

    def __init__(
        self, inner: KVConnectorWorkerMetadata | None, lease_reaped: frozenset[str]
    ) -> None:
        self.inner = inner
        self.lease_reaped = lease_reaped

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        # Tensor-parallel ranks: a lease reaped on any rank leaves that rank's reads unproven.
        if not isinstance(other, GuardWorkerMeta):
            inner = other if self.inner is None else self.inner.aggregate(other)
            return GuardWorkerMeta(inner, self.lease_reaped)
        if self.inner is None or other.inner is None:
            inner = self.inner or other.inner
        else:
            inner = self.inner.aggregate(other.inner)
        return GuardWorkerMeta(inner, self.lease_reaped | other.lease_reaped)


def inner_transfer_config(ktc: Any) -> tuple[type[KVConnectorBase_V1], Any]:
    """The inner connector's class and a copy of the transfer config ``ktc`` naming it."""
    extra = dict(ktc.kv_connector_extra_config or {})
    inner = extra.get("inner")
    if not isinstance(inner, dict) or not isinstance(inner.get("kv_connector"), str):
        raise InvalidField(
            "GuardedConnector needs kv_connector_extra_config.inner = {'kv_connector': "
            f"<the connector to guard>, ...}}, got {inner!r}"
        )
    return _named(ktc, inner)


def _named(ktc: Any, fields: dict[str, Any]) -> tuple[type[KVConnectorBase_V1], Any]:
    """The class a connector entry (``kv_connector``, optionally ``kv_connector_module_path``
    and ``kv_connector_extra_config``) names, and a copy of ``ktc`` naming it."""
    named = copy.copy(ktc)
    named.kv_connector = fields["kv_connector"]
    named.kv_connector_module_path = fields.get("kv_connector_module_path")
    named.kv_connector_extra_config = dict(fields.get("kv_connector_extra_config") or {})
    return KVConnectorFactory.get_connector_class(named), named


def _unguarded(cls: type[Any], ktc: Any) -> tuple[type[Any], Any]:
    """The connector a (possibly guarded) class and config stand for: the inner one. Only a
    class ``guarded_class`` built stands for its inner class; any other subclass (a guarded
    class subclassed by hand) is its own class, which may report differently."""
    if cls is GuardedConnector:
        return inner_transfer_config(ktc)
    inner = cls.__dict__.get("_kvl_inner")
    if inner is not None and _CLASSES.get(inner) is cls:
        return inner, ktc
    return cls, ktc


def _children(ktc: Any) -> list[tuple[type[Any], Any]]:
    """A ``MultiConnector``'s children (``kv_connector_extra_config["connectors"]``), each as
    the connector it stands for. ``InvalidField`` for anything but a list of entries each
    naming a connector (an empty list is one: no child, no failure proven over)."""
    entries = (ktc.kv_connector_extra_config or {}).get("connectors")
    if not isinstance(entries, list):  # (an empty list is vLLM's: a MultiConnector of none)
        raise InvalidField(f"a MultiConnector needs a list of connectors, got {entries!r}")
    for e in entries:
        if not isinstance(e, dict) or not isinstance(e.get("kv_connector"), str):
            raise InvalidField(f"a MultiConnector's connector entry must name one, got {e!r}")
    return [_unguarded(*_named(ktc, e)) for e in entries]


def inner_evidence(cls: type[Any], ktc: Any) -> InnerEvidence:
    """What a failed load of the connector ``cls`` stands for proves (``inner_connectors``),
    logged (``guard_inner_evidence``). A class whose flags cannot be read (its class-level
    query raised) proves nothing by its failures; a malformed config is ``InvalidField``."""
    engine = facts.installed()
    inner, inner_ktc = _unguarded(cls, ktc)
    log = _log.info
    try:
        found = evidence_of(inner, inner_ktc, access=engine.kv_cache_access, children=_children)
    except KVLifetimeError:
        raise
    except Exception as e:  # (the inner connector's own class-level query raised)
        why = f"its profile could not be read: {e!r}"
        found = InnerEvidence((class_name(inner),), (None,), None, False, why)
        log = _log.warning
    log(
        "guard_inner_evidence",
        engine="vllm",
        connector=class_name(inner),
        rows=list(found.rows),
        access=found.access,
        failed_load_is_over=found.failed_load_is_over,
        why=found.why,
    )
    return found


def inner_config(vllm_config: Any) -> tuple[type[KVConnectorBase_V1], Any]:
    """The inner connector's class and a copy of ``vllm_config`` naming it."""
    inner_cls, inner_ktc = inner_transfer_config(vllm_config.kv_transfer_config)
    cfg = copy.copy(vllm_config)
    cfg.kv_transfer_config = inner_ktc
    return inner_cls, cfg


def _class_query(name: str) -> Any:
    """A class-level query of vLLM's connector API (vLLM 0.34: ``kv_cache_access``,
    ``supports_lookahead_block_hashes``, ``supports_sleep_mode``) answered by the inner
    connector's class: vLLM asks it of the class it selected by name, ``GuardedConnector``,
    whose own base-class answer would be wrong for the connector it builds (a guarded class
    has the inner's answer by its MRO)."""

    def query(cls: type[Any], kv_transfer_config: Any, *args: Any, **kwargs: Any) -> Any:
        if cls is GuardedConnector:
            inner, inner_ktc = inner_transfer_config(kv_transfer_config)
            return getattr(inner, name)(inner_ktc, *args, **kwargs)
        return getattr(super(GuardedConnector, cls), name)(kv_transfer_config, *args, **kwargs)

    query.__name__ = query.__qualname__ = name
    return classmethod(query)


class GuardedConnector(KVConnectorBase_V1):
    """The guard, placed before the inner connector's class in the MRO (see module doc)."""

    _kvl_guarded: ClassVar[bool] = True
    guard: ConnectorGuard | None
    inner_evidence: InnerEvidence | None  # what the inner's failed loads prove (scheduler role)

    kv_cache_access = _class_query("kv_cache_access")
    supports_lookahead_block_hashes = _class_query("supports_lookahead_block_hashes")
    supports_sleep_mode = _class_query("supports_sleep_mode")

    def __new__(cls, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None) -> Any:
        if cls is GuardedConnector:
            # Selected by name in kv_transfer_config: build the guarded inner connector.
            inner_cls, cfg = inner_config(vllm_config)
            obj = super().__new__(guarded_class(inner_cls))
            obj._kvl_config = cfg
            return obj
        return super().__new__(cls)

    def __init__(
        self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None
    ) -> None:
        cfg = self.__dict__.pop("_kvl_config", vllm_config)
        super().__init__(cfg, role, kv_cache_config)
        self._kvl_facts = engine = facts.installed()
        self._kvl_waiting, self._kvl_aborted = engine.statuses()
        self.guard = None
        self._kvl_reaped: set[str] = set()
        # The step's loads, held until build_connector_meta: (request, vLLM's blocks, their ids,
        # external tokens); the inner connector is told of them once the guard granted them.
        self._kvl_pending: list[tuple[Any, Any, list[int], int]] = []
        # Transfer parameters of the requests the guard delayed this step (request id -> the
        # dict vLLM puts in the request's output): emptied if their READ grant is refused.
        self._kvl_params: dict[str, dict[str, Any]] = {}
        self._kvl_refuse_load: Any = None
        self._kvl_null: int | None = None
        self._kvl_requests: dict[str, Any] | None = None
        self._kvl_free: Any = None
        self._kvl_received: Any = None
        self._kvl_load_over: Any = None
        self._kvl_paused: Any = None
        self._kvl_pause = PauseWatch()
        # Sized when bound (vLLM 0.34 builds a connector with num_blocks=0 to ask it things).
        self._kvl_unsized = False
        extra = (vllm_config.kv_transfer_config.kv_connector_extra_config or {}).get(
            "kvlifetime", {}
        )
        self._kvl_peer = str(extra.get("peer", "vllm-kv-peer"))
        self.inner_evidence = None
        engine.check_transfer_mode(type(self), cfg.kv_transfer_config)
        if role == KVConnectorRole.SCHEDULER:
            # What the inner connector's failed loads prove (its class, its flags).
            self.inner_evidence = inner_evidence(type(self), cfg.kv_transfer_config)
            try:
                num_blocks = engine.num_blocks(cfg, kv_cache_config)
            except InvalidField:
                if not engine.SIZED_AT_BIND:
                    raise
                self._kvl_unsized = True  # guarded from bind_kv_cache_manager on
            else:
                self.guard = self._kvl_new_guard(num_blocks)
        else:
            # NIXL's worker reaps expired send leases into finished_sending: watch what it adds.
            engine.watch_reaper(self, self._kvl_reaped)

    # ------------------------------------------------------------------ scheduler role

    # The handlers of the facts module's ``HOOKS`` rows (``guarded_class`` puts each in the
    # guarded class over the inner connector's method, by the rows' one generic wrapper).

    def _kvl_bind(self, result: None, kv_cache_manager: Any) -> None:
        if self._kvl_unsized:
            self._kvl_unsized = False
            self.guard = self._kvl_new_guard(self._kvl_facts.num_blocks_of(kv_cache_manager))
        # vLLM's placeholder block (sliding-window and mamba lists repeat it): never exposed.
        self._kvl_null = self._kvl_facts.null_block_id(kv_cache_manager)
        # The Scheduler binding its cache manager (None: a connector driven by hand): its
        # request table is the truth about which ids vLLM holds.
        hooks = self._kvl_facts.scheduler_hooks(kv_cache_manager, self)
        if self.guard is not None and hooks is not None:
            self.guard.holds = hooks.requests.__contains__
            self.guard.phase = hooks.phase
            self._kvl_requests = hooks.requests
            self._kvl_free = hooks.free
            self._kvl_received = hooks.received
            self._kvl_refuse_load = hooks.refuse_load
            self._kvl_load_over = hooks.load_over
            self._kvl_paused = hooks.paused

    def _kvl_new_guard(self, num_blocks: int) -> ConnectorGuard:
        return ConnectorGuard(
            num_blocks,
            peer=self._kvl_peer,
            failed_load_is_over=self.inner_evidence is not None
            and self.inner_evidence.failed_load_is_over,
        )

    def _kvl_admitted(self, result: None, request: Any) -> None:
        if self.guard is not None:
            self.guard.admitted(request.request_id)

    def _kvl_alloc(
        self, original: Any, request: Any, blocks: Any, num_external_tokens: int
    ) -> None:
        if self.guard is None or num_external_tokens <= 0:
            original(self, request, blocks, num_external_tokens)
            return
        # Whether the load is asynchronous is vLLM's decision, made after this hook: the guard
        # grants it at build_connector_meta, and only then is the inner connector told of it
        # (so a refused grant's blocks never reach the worker as a load target). Without vLLM's
        # scheduler bound (a connector driven by hand) the inner is told now, as vLLM calls.
        ids = self._kvl_ids(blocks.get_unhashed_block_ids_all_groups())
        if self._kvl_refuse_load is None:
            original(self, request, blocks, num_external_tokens)
            blocks = None
        self._kvl_pending.append((request, blocks, ids, num_external_tokens))

    def _kvl_step(self, original: Any, scheduler_output: Any) -> Any:
        guard = self.guard
        if guard is not None:
            # The step boundary: the fences revoke recorded (from any thread) take effect now,
            # each covering the exposures of the steps that had ended when it was recorded.
            guard.begin_step()
            self._kvl_flush()
            if guard.loads_tracked:
                guard.handed_out(self._kvl_ids(self._kvl_facts.new_blocks(scheduler_output)))
        if guard is not None and self._kvl_pending:
            pending, self._kvl_pending = self._kvl_pending, []
            waiting = self._kvl_waiting
            refused = guard.allocated_many(
                [(req.request_id, ids) for req, _, ids, _ in pending if req.status == waiting]
            )
            for req, blocks, _, n in pending:
                if blocks is None:
                    continue  # the inner was told at the hook (no scheduler bound)
                if req.request_id in refused:
                    # Withheld: the inner connector never learns of this load, so no metadata
                    # carries its blocks to the worker; vLLM takes it as a failed load that
                    # loaded nothing and computes the prompt itself.
                    self._kvl_refuse_load(req)
                else:
                    super().update_state_after_alloc(req, blocks, n)  # the inner's
        meta = original(self, scheduler_output)
        if guard is not None and self._kvl_requests is not None and self._kvl_free:
            # Every step, whatever the model runner returns: what a fence released (revoke)
            # goes back to vLLM's pool now, not at a step that carries connector output (an
            # idle single-worker engine returns EMPTY_MODEL_RUNNER_OUTPUT and none comes).
            for request_id in guard.take_released():
                req = self._kvl_requests.get(request_id)
                if req is not None and req.is_finished():
                    self._kvl_free(req)
            # A fence ended a held failed load: vLLM gets the receive it waits for, as its
            # own _update_from_kv_xfer_finished would take it, and recovers at its next step.
            fenced = guard.take_fenced_loads()
            if fenced and self._kvl_received is not None:
                for request_id in fenced:
                    req = self._kvl_requests.get(request_id)
                    if req is None:
                        continue
                    if req.is_finished():
                        self._kvl_free(req)  # aborted while held: vLLM waited for this
                    else:
                        self._kvl_received(req)
        if guard is not None and self._kvl_paused is not None:
            # A pausing vLLM steps until it holds no request: say what the guard keeps it for.
            self._kvl_pause.step(self._kvl_paused(), guard.core.holds)
        return meta

    def _kvl_step_end(self) -> Any:
        # vLLM calls this once at the end of every update_from_output, after the step's
        # request_finished calls and its update_connector_output, before the step's outputs
        # leave the scheduler: the step's end, where the guard's journal goes into the ledger
        # and the step's exposures are counted as gone (ConnectorGuard.end_step).
        if self.guard is not None:
            self._kvl_flush(end_step=True)
        return PROCEED

    def _kvl_flush(self, *, end_step: bool = False) -> None:
        """The guard's journal into its ledger (``end_step``: and the step ends); the block ids
        of a refused READ grant are kept from the request's output (its transfer parameters
        emptied: no remote reader learns them; vLLM still keeps the blocks until the inner
        connector's id frees them)."""
        guard = self.guard
        if guard is None:
            return
        if end_step:
            guard.end_step()
        else:
            guard.flush()
        for request_id in guard.take_refused_reads():
            params = self._kvl_params.get(request_id)
            if params:
                params.clear()
        if self._kvl_params:
            self._kvl_params.clear()

    def _kvl_finished(
        self, result: tuple[bool, dict[str, Any] | None], request: Any, block_ids: Any
    ) -> tuple[bool, dict[str, Any] | None]:
        delay, params = result
        if self.guard is None:
            return result
        rid = request.request_id
        out = self.guard.finished(
            rid,
            self._kvl_ids(block_ids) if delay else (),
            bool(delay),
            request.status in self._kvl_aborted,
        )
        if delay and params and type(params) is dict:
            self._kvl_params[rid] = params
        return out, params

    def _kvl_ids(self, block_ids: Any) -> list[int]:
        """The distinct real blocks of vLLM's block-id list(s): one list per KV-cache group
        (one pool: a block shared by groups is counted once), without the null block."""
        ids = dict.fromkeys(self._kvl_facts.flat(block_ids))
        ids.pop(self._kvl_null, None)  # type: ignore[arg-type]
        return list(ids)

    def _kvl_output(self, original: Any, connector_output: Any) -> None:
        meta = connector_output.kv_connector_worker_meta
        reaped: frozenset[str] = frozenset()
        if isinstance(meta, GuardWorkerMeta):
            reaped = meta.lease_reaped
            connector_output.kv_connector_worker_meta = meta.inner
        # The inner connector sees its worker's report unchanged (it keeps its own books).
        original(self, connector_output)
        if self.guard is None:
            return
        back = self.guard.output(
            connector_output.finished_sending,
            connector_output.finished_recving,
            failed_recving=connector_output.failed_recving or (),
            invalid_block_ids=connector_output.invalid_block_ids or (),
            lease_reaped=reaped,
        )
        connector_output.finished_sending = back.finished_sending
        connector_output.finished_recving = back.finished_recving
        if self._kvl_load_over is not None and back.finished_sending:
            # vLLM frees these without counting an aborted load as over (0.34's load cap).
            for request_id in back.finished_sending:
                self._kvl_load_over(request_id)

    # ------------------------------------------------------------------ worker role

    def _kvl_worker_meta(
        self, inner: KVConnectorWorkerMetadata | None
    ) -> KVConnectorWorkerMetadata | None:
        if not self._kvl_reaped:
            return inner
        meta = GuardWorkerMeta(inner, frozenset(self._kvl_reaped))
        self._kvl_reaped.clear()
        return meta


_CLASSES: dict[type[Any], type[Any]] = {}
_CLASSES_LOCK = threading.Lock()


def guarded_class(inner: type[Any]) -> type[Any]:
    """The class of ``inner`` with the guard in front (one class per inner class).
    ``UnsupportedEngineVersion`` when the installed vLLM is not one the guard knows
    (``facts.installed``, checked once)."""
    engine = facts.installed()
    if getattr(inner, "_kvl_guarded", False):
        return inner
    with _CLASSES_LOCK:
        cls = _CLASSES.get(inner)
        if cls is None:
            hooked = {
                row.name: wrapper(
                    row.when, getattr(inner, row.name), getattr(GuardedConnector, row.handler)
                )
                for row in engine.HOOKS
                if hasattr(inner, row.name)  # (vLLM calls no method a connector does not have)
            }
            hooked["_kvl_inner"] = inner
            cls = type(f"Guarded{inner.__name__}", (GuardedConnector, inner), hooked)
            _CLASSES[inner] = cls
        return cls


__all__ = [
    "GuardWorkerMeta",
    "GuardedConnector",
    "guarded_class",
    "inner_config",
    "inner_evidence",
    "inner_transfer_config",
]
