"""What an inner connector's failure report proves, per connector class, as data.

vLLM's signals (``signals.py``) are the same sets of request ids for every connector, but what a
*failed load* (``failed_recving``, or ``invalid_block_ids`` under a load) proves depends on who
moves the bytes:

- a connector whose transfers another process or a remote peer makes (NIXL and Mooncake
  register the KV cache for RDMA or UCX; LMCache's multi-process connector shares it over CUDA
  IPC): the failure is the local side giving up. A READ the peer posted may still land, so the
  load's WRITE grant stays open until a proof or a fence (``LeaseExpired``, the default);
- a connector whose loads are this process's own jobs and which reports a failure only once its
  job has ended (vLLM 0.34's ``OffloadingConnector`` with its built-in CPU backend:
  ``offloading/worker.py`` puts a failed load's request in ``failed_recving`` *and*
  ``finished_recving`` when the job's result comes back, and ``kv_offload/cpu/gpu_worker.py``
  gives a result only once the copy's end event has completed, or on a CUDA error): the report
  says the job is over. Its receive proves the WRITE grant closed, and vLLM recovers
  (recompute, or the request ends) at once. The offloading connector's backend (its
  ``spec_name``) does the copies, so the row names the backends it was read for: any other
  (``TieringOffloadingSpec``, whose tiers include a peer-to-peer one; a backend loaded from
  ``spec_module_path``) proves nothing by a failure.

``PROFILES`` holds a row per connector family, each with where it was established and the test
that pins it. ``evidence_of`` resolves a connector class: by its exact class (a subclass may
report differently: it gets no row) and, for a row that names backends, its configured one; a
``MultiConnector`` by every child (a failure report does not say which child made it: it
proves the job over only if every child's does); and against the class's own
``kv_cache_access`` flags, which vLLM 0.34 asks of every connector: a failure is taken as over
only where the flags were read and say no peer reaches the KV cache (so never on 0.33, which
has no such query; its offloading worker reports no failure anyway). Any class without a row:
a failure proves nothing (the default). Importable without vLLM.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import attrs

from kvlifetime.errors import InvalidField

_V1 = "vllm.distributed.kv_transfer.kv_connector.v1"
_MULTI = f"{_V1}.multi_connector.MultiConnector"
_PINNED = "tests/in_vllm/test_vllm_inner_connectors.py"


def _names(value: Iterable[str]) -> frozenset[str]:
    names = frozenset(value)
    if not names or not all(isinstance(n, str) and n.count(".") >= 1 for n in names):
        raise InvalidField(f"classes must be dotted class names, got {value!r}")
    return names


@attrs.frozen
class InnerProfile:
    """One connector family: whether peers reach its KV cache, and whether its failure report
    comes only once its own load job is over (which then proves the transfer ended)."""

    name: str
    classes: frozenset[str] = attrs.field(converter=_names)  # module.QualName, exact
    peers_reach_memory: bool  # another process or a remote peer moves the bytes
    failure_means_over: bool  # a failed load is reported only once its own job ended
    established: str  # how we know (what was read, in which release)
    pinned_by: str  # the test that pins the row
    # The backends (kv_connector_extra_config["spec_name"], built in: no spec_module_path) the
    # row holds for; None: any. The first is the connector's default.
    backends: tuple[str, ...] | None = None

    def __attrs_post_init__(self) -> None:
        if self.failure_means_over and self.peers_reach_memory:
            raise InvalidField(
                f"{self.name}: a connector whose peers reach its memory cannot prove a failed "
                "load over by its own report"
            )


PROFILES: tuple[InnerProfile, ...] = (
    InnerProfile(
        "offloading",
        {f"{_V1}.offloading_connector.OffloadingConnector"},
        peers_reach_memory=False,
        failure_means_over=True,
        established="vLLM 0.34 offloading/worker.py get_finished: a failed job's request goes in "
        "failed_recving and finished_recving when the worker's job result arrives; "
        "kv_offload/cpu/gpu_worker.py gives a result only once the copy's end event completed "
        "(or on a CUDA error); kv_cache_access: IN_PROCESS. 0.33 asserts every job succeeded",
        pinned_by=f"{_PINNED}::test_an_offloading_load_failure_ends_at_once",
        backends=("CPUOffloadingSpec",),
    ),
    InnerProfile(
        "nixl",
        {f"{_V1}.nixl.connector.NixlPullConnector", f"{_V1}.nixl.connector.NixlPushConnector"},
        peers_reach_memory=True,
        failure_means_over=False,
        established="vLLM 0.33/0.34 nixl/: the KV cache is registered with UCX; a load fails on "
        "a timeout or a transfer error while the remote READ may still be posted; "
        "kv_cache_access: REGISTERS (and EXPORTS_FABRIC with a CUDA buffer)",
        pinned_by=f"{_PINNED}::test_a_nixl_load_failure_waits_for_proof_or_a_fence",
    ),
    InnerProfile(
        "mooncake",
        {
            f"{_V1}.mooncake.mooncake_connector.MooncakeConnector",
            f"{_V1}.mooncake.store.connector.MooncakeStoreConnector",
        },
        peers_reach_memory=True,
        failure_means_over=False,
        established="vLLM 0.34 mooncake/: registers the device KV cache with an RDMA engine "
        "(kv_cache_access: REGISTERS); kvlifetime's Mooncake TCP profile: a failed batch "
        "proves nothing about slices already sent",
        pinned_by=f"{_PINNED}::test_every_profiled_class_is_resolved_by_its_own_row",
    ),
    InnerProfile(
        "lmcache",
        {
            f"{_V1}.lmcache_connector.LMCacheConnectorV1",
            f"{_V1}.lmcache_mp_connector.LMCacheMPConnector",
        },
        peers_reach_memory=True,
        failure_means_over=False,
        established="vLLM 0.34 lmcache_mp_connector.py: the KV cache is shared with the "
        "LMCache server over CUDA IPC (kv_cache_access: LEGACY_IPC); LMCacheConnectorV1 hands "
        "loads to the lmcache package, not installed here: not established, so not trusted",
        pinned_by=f"{_PINNED}::test_every_profiled_class_is_resolved_by_its_own_row",
    ),
)
"""One row per connector family (exact classes); every other class: a failure proves nothing."""

_BY_CLASS = {name: p for p in PROFILES for name in p.classes}
if len(_BY_CLASS) != sum(len(p.classes) for p in PROFILES):
    raise InvalidField("a connector class is in two rows of PROFILES")


def class_name(cls: type[Any]) -> str:
    """A class's exact name as ``PROFILES`` spells it (``module.QualName``)."""
    return f"{cls.__module__}.{cls.__qualname__}"


@attrs.frozen
class InnerEvidence:
    """What one inner connector's failure reports prove, resolved for its class and config."""

    classes: tuple[str, ...]  # the class, or a MultiConnector's children, resolved
    rows: tuple[str | None, ...]  # each class's profile name (None: no row)
    access: int | None  # the kv_cache_access flags (vLLM 0.34); None where not asked
    failed_load_is_over: bool  # a failed load's receive proves its WRITE grant closed
    why: str  # one sentence: the reason, for logs and docs


def evidence_of(
    cls: type[Any],
    kv_transfer_config: Any,
    *,
    access: Callable[[type[Any], Any], int | None],
    children: Callable[[Any], list[tuple[type[Any], Any]]],
) -> InnerEvidence:
    """What ``cls`` (built with ``kv_transfer_config``) proves by a failed load. ``access`` asks
    a class its ``kv_cache_access`` flags (None: the release has none); ``children`` lists a
    ``MultiConnector``'s child classes and configs."""
    if class_name(cls) == _MULTI:
        found = children(kv_transfer_config)  # (a malformed list is refused first)
        flags = access(cls, kv_transfer_config)
        kids = [evidence_of(c, k, access=access, children=children) for c, k in found]
        over = bool(kids) and all(k.failed_load_is_over for k in kids)
        why = (
            "every child's failed load is reported once its own job is over"
            if over
            else "a MultiConnector's failure report does not say which child made it, and not "
            "every child's proves its job over"
        )
        return InnerEvidence(
            tuple(c for k in kids for c in k.classes),
            tuple(r for k in kids for r in k.rows),
            flags,
            over and flags == 0,
            why,
        )
    flags = access(cls, kv_transfer_config)
    row = _BY_CLASS.get(class_name(cls))
    backend = _backend(row, kv_transfer_config)
    if row is None:
        over, why = False, f"no profile for {class_name(cls)}: a failed load proves nothing"
    elif backend is not None:
        over, why = False, f"{row.name}: backend {backend} not read: a failed load proves nothing"
    elif flags is None:
        over, why = False, f"{row.name}: no kv_cache_access flags to read (vLLM before 0.34)"
    elif flags:
        over = False
        why = f"{row.name}: its kv_cache_access flags ({flags}) say peers reach the KV cache"
    else:
        over = row.failure_means_over
        why = f"{row.name}: " + (
            "a failed load is reported once its own job is over"
            if over
            else "peers reach the KV cache: a failed load proves nothing about what lands"
        )
    return InnerEvidence((class_name(cls),), (None if row is None else row.name,), flags, over, why)


def _backend(row: InnerProfile | None, kv_transfer_config: Any) -> str | None:
    """The configured backend when the row does not hold for it (None: it does, or the row
    names none)."""
    if row is None or row.backends is None:
        return None
    extra = getattr(kv_transfer_config, "kv_connector_extra_config", None) or {}
    if not isinstance(extra, dict):
        return f"(extra config {type(extra).__name__})"
    name = extra.get("spec_name", row.backends[0])
    module = extra.get("spec_module_path")
    if module is not None:
        return f"{name!r} from {module!r}"
    return None if name in row.backends else repr(name)


__all__ = ["PROFILES", "InnerEvidence", "InnerProfile", "class_name", "evidence_of"]
