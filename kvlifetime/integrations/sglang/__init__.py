"""kvlifetime inside SGLang 0.5.23's PD disaggregation (extra ``kvlifetime[sglang]``):
docs/sglang.md "Embedding in SGLang".

SGLang has no connector plugin API: ``install(role=...)``, called once per process before the
scheduler builds its disaggregation queues, wraps the functions where SGLang decides that a page
may be reused (``hooks.py``, the only module that imports SGLang, lazily) and returns the
process's ``SGLangGuard`` (``guard.py``, sans-IO); ``uninstall()`` restores them. ``PROFILE``
(``signals.py``) says what each SGLang signal proves.
"""

from __future__ import annotations

from typing import Any, Literal, overload

from kvlifetime.errors import InvalidField
from kvlifetime.integrations.sglang.errors import (
    AlreadyInstalled,
    GuardNotBound,
    MalformedEngineValue,
    UnsupportedEngineSetting,
    UnsupportedEngineVersion,
)
from kvlifetime.integrations.sglang.guard import (
    DecodeGuard,
    PrefillGuard,
    SGLangGuard,
    SGLangGuardStats,
)
from kvlifetime.integrations.sglang.signals import PROFILE, SUPPORTED_VERSION

__all__ = [
    "PROFILE",
    "SUPPORTED_VERSION",
    "AlreadyInstalled",
    "DecodeGuard",
    "GuardNotBound",
    "MalformedEngineValue",
    "PrefillGuard",
    "SGLangGuard",
    "SGLangGuardStats",
    "UnsupportedEngineSetting",
    "UnsupportedEngineVersion",
    "install",
    "installed",
    "uninstall",
]

# hooks.install's keyword options
_OPTIONS = frozenset({"drain_timeout", "incarnation", "prefill_guarded"})


@overload
def install(
    *, role: Literal["decode"], ledger_blocks: int | None = None, **options: Any
) -> DecodeGuard: ...
@overload
def install(
    *, role: Literal["prefill"], ledger_blocks: int | None = None, **options: Any
) -> PrefillGuard: ...
def install(
    *, role: Literal["decode", "prefill"], ledger_blocks: int | None = None, **options: Any
) -> SGLangGuard:
    """Guard this SGLang process (``role``): see ``hooks.install``. ``options``:
    ``drain_timeout``, ``incarnation``, ``prefill_guarded`` (decode: every prefill it serves
    runs the guard too, so an ABORT_ACK must echo its rank's token); any other is
    ``InvalidField`` (nothing installed)."""
    unknown = sorted(set(options) - _OPTIONS)
    if unknown:
        raise InvalidField(
            f"install() has no option {', '.join(map(repr, unknown))} "
            f"(options: {', '.join(sorted(_OPTIONS))})"
        )
    from kvlifetime.integrations.sglang import hooks

    return hooks.install(role=role, ledger_blocks=ledger_blocks, **options)


def uninstall() -> None:
    """Restore every function ``install`` wrapped (a no-op when nothing is installed)."""
    from kvlifetime.integrations.sglang import hooks

    hooks.uninstall()


def installed() -> SGLangGuard | None:
    """The guard ``install`` returned, while the hooks are installed."""
    from kvlifetime.integrations.sglang import hooks

    return hooks.current()
