"""The package as it ships: its version, its licence in the wheel, its exports, and an
``import kvlifetime`` that loads nothing the caller did not ask for."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

import kvlifetime

ROOT = Path(__file__).resolve().parent.parent
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def _modules_after(statement: str) -> set[str]:
    code = f"{statement}\nimport sys, json\nprint(json.dumps(sorted(sys.modules)))"
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    )
    return set(json.loads(proc.stdout))


def test_import_kvlifetime_loads_only_kvlifetime() -> None:
    bare = _modules_after("pass")
    after = _modules_after("import kvlifetime")
    assert after - bare == {"kvlifetime"}


def test_catching_kvlifetime_errors_costs_two_small_modules() -> None:
    bare = _modules_after("pass")
    after = _modules_after("from kvlifetime import KVLifetimeError, UsageError")
    assert after - bare <= {"kvlifetime", "kvlifetime.errors", "__future__"}


def test_a_name_loads_its_module_and_no_more() -> None:
    bare = _modules_after("pass")
    after = _modules_after("from kvlifetime import OutOfBlocks, MissingExtra")
    assert {m for m in after - bare if m.startswith("kvlifetime")} == {
        "kvlifetime",
        "kvlifetime.errors",
        "kvlifetime.extras",
    }
    for heavy in ("numpy", "structlog", "statemachine", "asyncio"):
        assert heavy not in after


def test_every_export_resolves_and_the_three_lists_agree() -> None:
    exports = set(kvlifetime._EXPORTS)
    assert set(kvlifetime.__all__) == exports | {"__version__"}
    # The type checker's imports (under TYPE_CHECKING) name exactly the same set.
    tree = ast.parse(Path(kvlifetime.__file__).read_text())
    (block,) = [
        n for n in tree.body if isinstance(n, ast.If) and ast.unparse(n.test) == "TYPE_CHECKING"
    ]
    typed = {
        (alias.asname or alias.name, node.module)
        for node in block.body
        if isinstance(node, ast.ImportFrom)
        for alias in node.names
    }
    assert typed == set(kvlifetime._EXPORTS.items())
    for name in exports:
        value = getattr(kvlifetime, name)
        assert getattr(sys.modules[kvlifetime._EXPORTS[name]], name) is value
    assert exports <= set(dir(kvlifetime))
    # dir() shows what a user may use: no helper of the module's own
    public = {n for n in dir(kvlifetime) if not (n.startswith("__") and n.endswith("__"))}
    assert public == exports and "TYPE_CHECKING" not in dir(kvlifetime)
    assert "__version__" in dir(kvlifetime)
    with pytest.raises(AttributeError, match="no attribute 'Nope'"):
        _ = kvlifetime.Nope


def test_every_error_class_is_exported() -> None:
    from kvlifetime import errors

    classes = {
        name
        for name, v in vars(errors).items()
        if isinstance(v, type) and issubclass(v, errors.KVLifetimeError)
    }
    assert classes <= set(kvlifetime.__all__)


def test_version_agrees_everywhere() -> None:
    assert kvlifetime.__version__ == PYPROJECT["project"]["version"]
    changelog = (ROOT / "CHANGELOG.md").read_text()
    if f"## [{kvlifetime.__version__}]" not in changelog:
        pytest.fail(f"CHANGELOG.md has no [{kvlifetime.__version__}] section")


def test_the_wheel_ships_the_apache_licence(tmp_path: Path) -> None:
    licence = (ROOT / "LICENSE").read_text()
    assert PYPROJECT["project"]["license"] == "Apache-2.0"
    assert "Apache License\n                           Version 2.0, January 2004" in licence
    assert "END OF TERMS AND CONDITIONS" in licence
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "-w",
            str(tmp_path),
            str(ROOT),
        ],
        check=True,
        capture_output=True,
        timeout=300,
    )
    (wheel,) = tmp_path.glob("kvlifetime-*.whl")
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        info = f"kvlifetime-{kvlifetime.__version__}.dist-info"
        assert z.read(f"{info}/licenses/LICENSE").decode() == licence
        metadata = z.read(f"{info}/METADATA").decode()
        entry_points = z.read(f"{info}/entry_points.txt").decode()
    assert "License-Expression: Apache-2.0" in metadata
    assert "kvlifetime/py.typed" in names
    # The accelerator's build hook is off by default: a plain wheel is pure Python, whatever
    # `make accel` left in the tree (tests/test_accel.py).
    assert wheel.name.endswith("-py3-none-any.whl")
    assert "kvlifetime/ledger/requests.py" in names
    assert not [n for n in names if n.endswith((".so", ".pyd"))]
    assert "kvlifetime = kvlifetime.pytest_plugin" in entry_points
