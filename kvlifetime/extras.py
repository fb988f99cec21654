"""Optional dependencies: a missing one is a typed error that names the install to run.

kvlifetime's core needs only attrs, structlog, numpy and python-statemachine. The harness, the
transfer engines, Prometheus, vLLM and the HTML report need more, declared as extras in the
package metadata. Without this module a missing extra surfaces as a ``ModuleNotFoundError``
from deep inside (``No module named 'msgpack'``) after the command has already done work, or
at the first Prometheus scrape. Here it is refused at the call that needs it, before anything
runs, with the ``pip install 'kvlifetime[EXTRA]'`` that fixes it.

    from kvlifetime.extras import require, needs

    require("harness", "kvlifetime simulate")    # checks, imports nothing
    with needs("harness", "the harness"):        # an import inside the block that fails
        import zmq                               # on one of the extra's modules is translated

``MissingExtra`` is a ``KVLifetimeError`` (the command line prints it as one line, exit 2) and
a ``ModuleNotFoundError`` (code that already catches ``ImportError`` keeps working).
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
from collections.abc import Iterator, Mapping
from types import ModuleType

import attrs

from kvlifetime.errors import EnvironmentFault

__all__ = ["EXTRAS", "Extra", "MissingExtra", "import_optional", "missing", "needs", "require"]


@attrs.frozen(slots=True)
class Extra:
    """One optional dependency group: what to install, and the modules that prove it is there."""

    name: str  # the extra's name in the package metadata: pip install 'kvlifetime[name]'
    modules: tuple[str, ...]  # top-level import names, each checked without importing it
    distributions: tuple[str, ...]  # the PyPI names, for the message
    install: str = ""  # the command to run; empty: pip install 'kvlifetime[name]'
    also: str = ""  # what pip cannot install (a Debian package), said after the command

    def command(self) -> str:
        return self.install or f"pip install 'kvlifetime[{self.name}]'"


EXTRAS: Mapping[str, Extra] = {
    e.name: e
    for e in (
        Extra("harness", ("zmq", "msgpack"), ("pyzmq", "msgpack")),
        Extra(
            "mooncake",
            ("zmq", "msgpack", "mooncake"),
            ("pyzmq", "msgpack", "mooncake-transfer-engine-non-cuda"),
            also="its engine also needs Debian's libibverbs1 to import",
        ),
        # NIXL has no extra: `pip install nixl` pulls about 3 GB of torch and CUDA libraries,
        # and an extra cannot say --no-deps.
        Extra(
            "nixl",
            ("nixl",),
            ("nixl", "nixl-cu13"),
            install="pip install --no-deps nixl==1.5.1 nixl-cu13==1.5.1",
            also="the lean install: no torch, no CUDA libraries",
        ),
        Extra("prometheus", ("prometheus_client",), ("prometheus-client",)),
        Extra("report", ("matplotlib",), ("matplotlib",)),  # the plots of kvlifetime report
        # the documentation site (make docs): MkDocs, Material, the API reference
        Extra(
            "docs",
            ("mkdocs", "material", "mkdocstrings"),
            ("mkdocs", "mkdocs-material", "mkdocstrings"),
        ),
        Extra(
            "vllm",
            ("vllm",),
            ("vllm",),
            also="on a CPU-only machine install vLLM as `make vllm-venv` does",
        ),
        Extra(
            "sglang",
            ("sglang",),
            ("sglang",),
            also="on a CPU-only machine install SGLang as `make sglang-venv` does",
        ),
    )
}
"""Every extra kvlifetime knows, by name. A new extra is one entry here."""


class MissingExtra(EnvironmentFault, ModuleNotFoundError):
    """An optional dependency is not installed.

    Whose fault: the installation (the caller asked for a part of kvlifetime whose extra is not
    installed). State left: nothing ran; the message names the command that fixes it.
    """

    kind = "missing_extra"

    def __init__(self, extra: Extra, module: str, what: str) -> None:
        self.extra = extra
        self.what = what
        dist = extra.distributions[extra.modules.index(module)] if module in extra.modules else ""
        named = f"{dist} (module {module!r})" if dist and dist != module else repr(module)
        also = f"; {extra.also}" if extra.also else ""
        super().__init__(
            f"{what} needs the optional dependency {named}, which is not installed: "
            f"run {extra.command()}{also}",
            name=module,
        )


def _extra(name: str) -> Extra:
    try:
        return EXTRAS[name]
    except KeyError:
        raise ValueError(f"unknown extra {name!r} ({', '.join(EXTRAS)})") from None


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a parent that fails to import, a module without spec
        return False


def missing(extra: str) -> list[str]:
    """The modules of ``extra`` that are not installed (found without importing them)."""
    return [m for m in _extra(extra).modules if not _installed(m)]


def require(extra: str, what: str) -> None:
    """Raise ``MissingExtra`` unless every module of ``extra`` is installed.

    ``what`` names the thing that needs it, as the user called it (``"kvlifetime simulate"``,
    ``"LedgerCollector"``). Nothing is imported: the check is cheap enough for a constructor.
    """
    absent = missing(extra)
    if absent:
        raise MissingExtra(EXTRAS[extra], absent[0], what)


def _root(module: str | None) -> str:
    return (module or "").partition(".")[0]


@contextlib.contextmanager
def needs(extra: str, what: str) -> Iterator[None]:
    """Translate a ``ModuleNotFoundError`` of one of ``extra``'s modules raised in the block.

    Any other import error (a kvlifetime module, a module of another extra) passes unchanged:
    it is a bug or another problem, and must not be reported as this extra.
    """
    e = _extra(extra)
    try:
        yield
    except MissingExtra:
        raise
    except ModuleNotFoundError as err:
        if _root(err.name) not in e.modules:
            raise
        raise MissingExtra(e, _root(err.name), what) from err


def import_optional(module: str, extra: str, what: str) -> ModuleType:
    """``importlib.import_module(module)``, a missing ``extra`` raised as ``MissingExtra``."""
    with needs(extra, what):
        return importlib.import_module(module)
