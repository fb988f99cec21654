"""The package keeps its layers (docs/architecture.md): every module in one layer, no import
from a lower layer to a higher one, no circle, no module over 600 lines that does not say at its
top why it is one piece. The imports are read from the source: every one, lazy ones inside
functions included, those under ``if TYPE_CHECKING:`` left out."""

from __future__ import annotations

import pathlib
import textwrap

import pytest

from kvlifetime.architecture import (
    LAYERS,
    LONG_MODULE,
    Layer,
    committed_layers,
    cycles,
    import_graph,
    layer_of,
    layer_violations,
    layers_markdown,
)

KNOWN_VIOLATIONS: frozenset[str] = frozenset()
"""What still breaks the layers on main, each written as ``layer_violations`` prints it. It may
only shrink: a violation not listed here fails the test, and so does an entry that no longer
occurs (delete it in the commit that fixes it)."""


def test_the_package_keeps_its_layers() -> None:
    found = set(layer_violations())
    new = sorted(found - KNOWN_VIOLATIONS)
    gone = sorted(KNOWN_VIOLATIONS - found)
    assert not new, "breaks the layers (docs/architecture.md):\n" + "\n".join(new)
    assert not gone, "fixed: delete from KNOWN_VIOLATIONS:\n" + "\n".join(gone)


def test_docs_architecture_md_draws_the_layer_table() -> None:
    """Fails when LAYERS changed and the page did not. Fix: `python -m kvlifetime.architecture`
    and commit docs/architecture.md."""
    assert committed_layers() == layers_markdown(), "run `python -m kvlifetime.architecture`"


def test_each_layer_and_each_entry_appears_once() -> None:
    names = [layer.name for layer in LAYERS]
    entries = [entry for layer in LAYERS for entry in layer.files]
    assert len(set(names)) == len(names)
    assert len(set(entries)) == len(entries)
    assert all(entry.endswith((".py", "/")) for entry in entries)


# --------------------------------------------------------------------------- the checker itself

TOY_LAYERS = (
    Layer("low", ("__init__.py", "base.py"), "the bottom"),
    Layer("mid", ("core/",), "the middle"),
    Layer("high", ("top.py", "gone.py"), "the top"),
)


def _toy(tmp_path: pathlib.Path, files: dict[str, str]) -> pathlib.Path:
    root = tmp_path / "kvlifetime"  # the checker names modules from the package's own name
    for rel, text in {
        "__init__.py": '_EXPORTS = {**dict.fromkeys(("Thing",), "kvlifetime.top")}\n',
        **files,
    }.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text), encoding="utf-8")
    return root


def test_the_checker_sees_every_kind_of_import_and_skips_type_checking(
    tmp_path: pathlib.Path,
) -> None:
    root = _toy(
        tmp_path,
        {
            "base.py": """
                from typing import TYPE_CHECKING
                if TYPE_CHECKING:
                    from kvlifetime.top import T  # never runs: no arrow
                else:
                    pass
                def later():
                    import kvlifetime.core.inner  # lazy: still an arrow up
                    importlib.import_module("kvlifetime.top")  # by a literal name: too
            """,
            "core/__init__.py": "from . import inner\n",
            "core/inner.py": "from .. import base\nfrom kvlifetime import __version__, Thing\n",
            "top.py": "from kvlifetime.core import inner as i\nfrom kvlifetime.base import x\n",
        },
    )
    graph = import_graph(root)
    assert graph == {
        "kvlifetime": set(),
        "kvlifetime.base": {"kvlifetime.core.inner", "kvlifetime.top"},
        "kvlifetime.core": {"kvlifetime.core.inner"},
        # Thing is an export kvlifetime loads from kvlifetime.top when first asked for
        "kvlifetime.core.inner": {"kvlifetime.base", "kvlifetime", "kvlifetime.top"},
        "kvlifetime.top": {"kvlifetime.core.inner", "kvlifetime.base"},
    }
    assert layer_violations(root, TOY_LAYERS) == [
        "cycle: kvlifetime.base <-> kvlifetime.core.inner <-> kvlifetime.top",
        "no such module: layer high names gone.py",
        "upward: kvlifetime.base (low) -> kvlifetime.core.inner (mid)",
        "upward: kvlifetime.base (low) -> kvlifetime.top (high)",
        "upward: kvlifetime.core.inner (mid) -> kvlifetime.top (high)",
    ]


def test_the_checker_finds_unplaced_and_long_modules(tmp_path: pathlib.Path) -> None:
    long_body = "x = 1\n" * LONG_MODULE
    root = _toy(
        tmp_path,
        {
            "base.py": '"""Short."""\n',
            "core/__init__.py": '"""Long, and one piece: the reason is written here."""\n'
            + long_body,
            "top.py": '"""Long, with no reason."""\n' + long_body,
            "gone.py": "",
            "stray.py": "",
        },
    )
    assert layer_violations(root, TOY_LAYERS) == [
        "long: kvlifetime.top",
        "unplaced: kvlifetime.stray",
    ]
    assert layer_of("kvlifetime.core.deep.er", TOY_LAYERS) == 1
    assert layer_of("kvlifetime.corex", TOY_LAYERS) is None  # a package entry is not a prefix


@pytest.mark.parametrize(
    ("graph", "want"),
    [
        ({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}, [["a", "b", "c"]]),
        ({"a": {"b"}, "b": set()}, []),
        ({"a": {"b"}, "b": {"a"}, "c": {"d"}, "d": {"c"}}, [["a", "b"], ["c", "d"]]),
    ],
)
def test_cycles_are_found_however_long(graph: dict[str, set[str]], want: list[list[str]]) -> None:
    assert cycles(graph) == want
