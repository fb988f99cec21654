"""The optional accelerator: which of the ledger's and the verifier's modules may run compiled,
and which do.

The ledger's and the verifier's hot paths can be compiled by mypyc from their own source (``make
accel``, or a wheel built with the hook in ``hatch_build.py``): the same ``.py`` files, no second
copy of the rules.
Nothing needs it: a plain install runs the sources. When the compiled modules are present Python
imports them first; ``KVLIFETIME_PURE=1`` in the environment makes a process import the sources
instead (``kvlifetime/__init__.py`` calls ``force_pure`` before any of them can load), so the
two can be measured and tested side by side on one installation.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import importlib.util
import sys
from collections.abc import Sequence
from pathlib import Path

# The modules compiled: the ledger's per-request and per-block work, and the proof its records
# extend (a compiled class cannot extend an interpreted one, so the two compile together).
# Interpreted always: ``ledger.values`` (attrs classes), ``ledger.facade`` and ``ledger.queries``
# (``BlockLedger``: applications and tests subclass it, which a compiled class refuses).
MODULES = (
    "kvlifetime.spec.proof",
    "kvlifetime.ledger.batch",
    "kvlifetime.ledger.block_rows",
    "kvlifetime.ledger.blocks",
    "kvlifetime.ledger.counters",
    "kvlifetime.ledger.engine_counts",
    "kvlifetime.ledger.events",
    "kvlifetime.ledger.exposure_rows",
    "kvlifetime.ledger.grant_rows",
    "kvlifetime.ledger.grant_table",
    "kvlifetime.ledger.ledger_counts",
    "kvlifetime.ledger.proofs",
    "kvlifetime.ledger.records",
    "kvlifetime.ledger.request_rows",
    "kvlifetime.ledger.requests",
    "kvlifetime.ledger.restart",
    "kvlifetime.ledger.snapshot",
    "kvlifetime.ledger.step_rows",
    "kvlifetime.ledger.transitions",
    # The verifier's step and what it reads: the environment's values and their ledger view
    # (state, rebuild), the events, the step and its policies, the keys, the stubborn sets,
    # the packed ledger. Their attrs classes stay ordinary Python classes (mypyc compiles
    # their methods' callers, not the classes). Interpreted: the search loop
    # (``verify.search``, a few percent of a search; its tests stop a search by replacing a
    # name in its namespace, which a compiled module's calls to its own group never look up)
    # and the rest of ``verify/``.
    "kvlifetime.verify.events",
    "kvlifetime.verify.keys",
    "kvlifetime.verify.lies",
    "kvlifetime.verify.packed",
    "kvlifetime.verify.policies",
    "kvlifetime.verify.por",
    "kvlifetime.verify.rebuild",
    "kvlifetime.verify.scratch",
    "kvlifetime.verify.semantics",
    "kvlifetime.verify.state",
    "kvlifetime.verify.successors",
)

PURE_ENV = "KVLIFETIME_PURE"


class _SourcesFirst:
    """A meta path finder that resolves ``MODULES`` to their ``.py`` files, so a compiled
    module beside its source is never the one imported."""

    @classmethod
    def find_spec(
        cls, fullname: str, path: Sequence[str] | None, target: object = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname not in MODULES or not path:
            return None
        leaf = fullname.rpartition(".")[2] + ".py"
        for entry in path:
            source = Path(entry) / leaf
            if source.is_file():
                return importlib.util.spec_from_file_location(fullname, source)
        return None


def force_pure() -> None:
    """From now on ``MODULES`` import from their sources (idempotent). Called before any of
    them is imported (``KVLIFETIME_PURE=1``); one imported already stays as it is."""
    if _SourcesFirst not in sys.meta_path:
        sys.meta_path.insert(0, _SourcesFirst)


def compiled() -> dict[str, bool]:
    """Each of ``MODULES`` (imported here if it is not yet) -> whether it runs compiled."""
    out = {}
    for name in MODULES:
        module = importlib.import_module(name)
        origin = getattr(module, "__file__", None) or ""
        out[name] = origin.endswith(tuple(importlib.machinery.EXTENSION_SUFFIXES))
    return out


def variant() -> str:
    """``"compiled"`` when every one of ``MODULES`` runs compiled, ``"pure"`` when none does,
    else ``"mixed"`` (a build left half done: ``make accel`` again)."""
    flags = set(compiled().values())
    if flags == {True}:
        return "compiled"
    return "pure" if flags == {False} else "mixed"
