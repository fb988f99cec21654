"""Which engine-facts module describes the installed vLLM, checked once.

Every private detail of vLLM the guard depends on lives in one module per vLLM release series,
beside this one: ``facts_v0_33.py`` for vLLM 0.33.x (its module doc lists them),
``facts_v0_34.py`` for 0.34.x (what differs). They are found
by their file name, ``facts_v<major>_<minor>.py``, so supporting another vLLM is a one-file
addition: a module with the same functions (``EngineFacts``) and its own ``check()``.

``installed()`` picks the module for ``vllm.__version__`` and runs its ``check()``, once per
process: the connector runs it when its class is first built (``guarded_class``), the pytest
plugin when it installs. A vLLM with no facts module, or one where a fact is not found, is
refused with ``UnsupportedEngineVersion`` before anything is built or patched. Importable
without vLLM.
"""

from __future__ import annotations

import importlib
import re
import threading
from pathlib import Path
from typing import Any, Protocol

from kvlifetime.integrations.hooks import Hook
from kvlifetime.integrations.vllm.errors import UnsupportedEngineVersion

_PACKAGE = __name__.rpartition(".")[0]
_HERE = Path(__file__).resolve().parent
_MODULE = re.compile(r"facts_v(\d+)_(\d+)")
_SERIES = re.compile(r"(\d+)\.(\d+)(?!\d)")


class EngineFacts(Protocol):
    """What a ``facts_v<major>_<minor>`` module provides (``facts_v0_33`` documents each)."""

    VERSION: str
    HOOKS: tuple[Hook, ...]

    def check(self) -> None: ...
    def flat(self, block_ids: Any) -> list[int]: ...
    def null_block_id(self, kv_cache_manager: Any) -> int: ...
    def statuses(self) -> tuple[Any, frozenset[Any]]: ...
    def scheduler_hooks(self, kv_cache_manager: Any, connector: Any = None) -> Any: ...
    def new_blocks(self, scheduler_output: Any) -> list[int]: ...
    def num_blocks(self, vllm_config: Any, kv_cache_config: Any) -> int: ...
    def watch_reaper(self, connector: Any, reaped: set[str]) -> bool: ...

    SIZED_AT_BIND: bool

    def num_blocks_of(self, kv_cache_manager: Any) -> int: ...
    def check_transfer_mode(self, connector_cls: type[Any], kv_transfer_config: Any) -> None: ...
    def kv_cache_access(self, connector_cls: type[Any], kv_transfer_config: Any) -> int | None: ...


def supported_versions(directory: Path = _HERE) -> dict[str, str]:
    """The vLLM release series with a facts module in ``directory`` (``"0.33"`` -> its module
    name), oldest first."""
    found = {}
    for path in directory.glob("facts_v*.py"):
        m = _MODULE.fullmatch(path.stem)
        if m:
            found[(int(m[1]), int(m[2]))] = f"{_PACKAGE}.{path.stem}"
    return {f"{major}.{minor}": found[major, minor] for major, minor in sorted(found)}


def series(version: str) -> str | None:
    """The release series of a vLLM version string (``"0.33.1.dev4+g1a2b"`` -> ``"0.33"``);
    None when it has none."""
    m = _SERIES.match(version.strip().removeprefix("v"))
    return f"{int(m[1])}.{int(m[2])}" if m else None


def for_version(version: str) -> EngineFacts:
    """The facts module for vLLM ``version`` (not checked); ``UnsupportedEngineVersion`` when
    there is none. Imports no vLLM."""
    supported = supported_versions()
    module = supported.get(series(version) or "")
    if module is None:
        names = ", ".join(f"{s}.x" for s in supported)
        raise UnsupportedEngineVersion(
            f"kvlifetime's vLLM guard supports vLLM {names}; this is vLLM {version!r}: the "
            "private details of vLLM it relies on are known only for those, so nothing was "
            "guarded (kvlifetime/integrations/vllm/facts.py)"
        )
    facts: EngineFacts = importlib.import_module(module)
    return facts


_lock = threading.Lock()
_INSTALLED: EngineFacts | None = None


def installed() -> EngineFacts:
    """The facts module of the installed vLLM (``vllm.__version__``), its ``check()`` passed:
    checked once per process (a refusal is not remembered: the next call checks again).
    ``UnsupportedEngineVersion`` for a vLLM with no facts module or with a fact not found;
    ``MissingExtra`` without vLLM."""
    global _INSTALLED
    facts = _INSTALLED
    if facts is not None:
        return facts
    with _lock:
        if _INSTALLED is None:
            facts = for_version(_vllm_version())
            facts.check()
            _INSTALLED = facts
        return _INSTALLED


def _vllm_version() -> str:
    from kvlifetime.extras import needs

    with needs("vllm", "kvlifetime.integrations.vllm"):
        import vllm
    return str(getattr(vllm, "__version__", "unknown"))


__all__ = ["EngineFacts", "UnsupportedEngineVersion", "for_version", "installed", "series",
           "supported_versions"]  # fmt: skip
