"""Install and uninstall the guard in an SGLang 0.5.23 process.

SGLang has no connector plugin API (its transfer backends are a closed enum), so the guard
replaces functions on SGLang's own classes and one module attribute. The places are rows
(``facts_v0_5_23.DECODE_HOOKS`` / ``PREFILL_HOOKS``: engine class, attribute, when, core event,
handler), each put there by the one generic wrapper of ``integrations.hooks``; the handlers are
``decode_hooks.DecodeHooks`` and ``prefill_hooks.PrefillHooks``. ``install`` first checks every
row's target and every private detail the handlers read (``facts_v0_5_23.check``), then applies
all rows or none; ``uninstall`` puts every original back. These modules and the facts module are
the only ones of kvlifetime that import SGLang, and only inside ``install`` or a handler.

Every value a handler reads from SGLang passes one check at the entry (a room:
``SGLangGuard.engine_room``, at admission on both sides; a malformed one fails the request as
SGLang fails a bad request, before anything is allocated). ``install`` must run before the
scheduler (or a driver) builds its disaggregation queues: the queues' constructors bind the
guard's ledger to the KV pool's size, and receivers and senders made before it are not guarded.
The rows, as a table: docs/sglang.md.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Literal

import structlog

from kvlifetime.integrations.sglang import facts_v0_5_23 as facts
from kvlifetime.integrations.sglang.decode_hooks import DecodeHooks
from kvlifetime.integrations.sglang.errors import AlreadyInstalled
from kvlifetime.integrations.sglang.guard import DecodeGuard, PrefillGuard, SGLangGuard
from kvlifetime.integrations.sglang.installation import Installation
from kvlifetime.integrations.sglang.prefill_hooks import PrefillHooks

_log = structlog.get_logger("kvlifetime.sglang")

_lock = threading.Lock()
_installed: Installation | None = None


def current() -> SGLangGuard | None:
    inst = _installed
    return None if inst is None else inst.guard


def install(
    *,
    role: Literal["decode", "prefill"],
    ledger_blocks: int | None = None,
    drain_timeout: float = 30.0,
    incarnation: str | None = None,
    prefill_guarded: bool = False,
) -> SGLangGuard:
    """Check SGLang's version, settings and private details, build the guard, put the role's
    handlers at its rows.

    Refused, with nothing wrapped: another SGLang version, or one where a row's target or a
    fact is not found (``UnsupportedEngineVersion``), deferred decode KV release turned off
    (``UnsupportedEngineSetting``), a second install (``AlreadyInstalled``), a bad argument
    (``InvalidField``)."""
    global _installed
    guard = SGLangGuard(
        role=role,
        ledger_blocks=ledger_blocks,
        incarnation=incarnation,
        drain_timeout=drain_timeout,
        prefill_guarded=prefill_guarded,
    )
    with _lock:
        if _installed is not None:
            raise AlreadyInstalled(f"the {_installed.guard.role} guard is installed")
        facts.check(role)
        if isinstance(guard, DecodeGuard):
            inst: Installation = DecodeHooks(guard)
        else:
            assert isinstance(guard, PrefillGuard)
            inst = PrefillHooks(guard)
        inst.apply()  # all or none
        _installed = inst
    if structlog.is_configured():
        _log.info("sglang_guard_installed", role=role, version=facts.VERSION)
    return guard


def uninstall() -> None:
    global _installed
    with _lock:
        inst, _installed = _installed, None
    if inst is not None:
        inst.restore()
        if structlog.is_configured():
            _log.info("sglang_guard_uninstalled", role=inst.guard.role)


def wrapped_points() -> Iterator[tuple[object, str]]:
    """Every (class or module, attribute) the installed hooks replaced (tests check that
    ``uninstall`` puts each original back)."""
    inst = _installed
    if inst is not None:
        yield from inst.patches.points()
