"""The transfer engine a backend names: checked before anything starts, then opened.

Both sides of ``kvlifetime.adapters.transfer``: the owner's memory (``open_memory``) and, in
the peer's process, the initiator that reaches it through the descriptor the memory gave
(``open_initiator``). The real engines are imported only when named.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvlifetime.adapters.transfer import ReadEngine, TargetMemory

BACKENDS: tuple[str, ...] = ("inproc", "mooncake", "nixl")
"""``inproc`` (in-process threads, nothing installed), ``mooncake`` (Mooncake TCP), ``nixl``
(NIXL over UCX/TCP). Each has an asynchronous batch WRITE and READ."""


def require_engine(backend: str, what: str) -> None:
    """Refuse (``MissingExtra`` or ``UsageError``) when ``backend``'s engine is not installed
    or does not import; ``what`` names who needs it. ``inproc`` needs nothing."""
    from kvlifetime.errors import UsageError
    from kvlifetime.extras import require

    if backend not in BACKENDS:
        raise UsageError(f"unknown backend {backend!r} ({', '.join(BACKENDS)})")
    if backend == "nixl":
        from kvlifetime.adapters.nixl import nixl_available, require_tcp

        require("nixl", f"{what} --backend nixl")
        if not nixl_available():
            raise UsageError(
                "backend nixl: NIXL is installed but its engine does not import (reinstall "
                "it lean: pip install --no-deps nixl==1.5.1 nixl-cu13==1.5.1)"
            )
        require_tcp()  # UCX_TLS other than tcp: the initiator would reach the memory itself
    if backend == "mooncake":
        from kvlifetime.adapters.mooncake import mooncake_available

        require("mooncake", f"{what} --backend mooncake")
        if not mooncake_available():
            raise UsageError(
                "backend mooncake: mooncake-transfer-engine-non-cuda is installed but its "
                "engine does not import (it needs Debian's libibverbs1: apt-get install "
                "libibverbs1)"
            )


def open_memory(backend: str, nbytes: int, *, name: str | None = None) -> TargetMemory:
    """The owner's arena of ``nbytes``, registered with ``backend``'s engine so that a peer
    may reach it (``name``: the NIXL agent's name prefix, to tell the arenas apart)."""
    if backend == "inproc":
        from kvlifetime.adapters.inproc import InprocTarget

        return InprocTarget(nbytes)
    if backend == "nixl":
        from kvlifetime.adapters.nixl_engine import NixlTarget

        return NixlTarget(nbytes) if name is None else NixlTarget(nbytes, name=name)
    if backend == "mooncake":
        from kvlifetime.adapters.mooncake import MooncakeTarget

        return MooncakeTarget(nbytes)
    raise ValueError(f"unknown backend {backend!r} ({', '.join(BACKENDS)})")


def open_initiator(
    memory: Mapping[str, Any],
    staging_bytes: int,
    *,
    straggle_ticks: int = 4,
    handover_region: int | None = None,
) -> ReadEngine:
    """The initiator that reaches the memory ``memory`` describes (``TargetMemory.descriptor``),
    with ``staging_bytes`` of its own. The in-process engine's knobs: ``straggle_ticks`` (how
    late a FAILED batch's other slices still land) and ``handover_region`` (its slices are
    handed to the target at once, to land even if this process dies)."""
    kind = memory.get("kind")
    if kind == "inproc":
        from kvlifetime.adapters.inproc import InprocEngine

        return InprocEngine(
            memory, staging_bytes, straggle_ticks=straggle_ticks, handover_region=handover_region
        )
    if kind == "mooncake":
        from kvlifetime.adapters.mooncake import MooncakeEngine

        return MooncakeEngine(memory, staging_bytes)
    if kind == "nixl":
        from kvlifetime.adapters.nixl_engine import NixlEngine

        return NixlEngine(memory, staging_bytes)
    raise ValueError(f"unknown transfer engine {kind!r}")
