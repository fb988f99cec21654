"""The optional accelerator: the ledger's and the verifier's hot paths compiled by mypyc from
the same source.

Nothing here is needed to install or run kvlifetime: the modules are plain Python and a plain
``pip install`` (no compiler) installs and imports them as they are. Two ways to compile them,
both from the very ``.py`` files the pure path runs (no second copy of the rules):

- ``python hatch_build.py`` (``make accel``): compiles ``ACCEL_MODULES`` in place, beside
  their sources (``kvlifetime/ledger/*.cpython-*.so``, ``kvlifetime/verify/*.cpython-*.so``);
  ``python hatch_build.py --clean`` removes them. Python then imports the compiled modules
  first; ``KVLIFETIME_PURE=1`` makes a process import the sources instead
  (``kvlifetime/__init__.py``).
- a wheel built with ``HATCH_BUILD_HOOK_ENABLE_CUSTOM=true`` (hatchling's switch for this
  hook, off by default) carries the compiled modules beside the sources.

Needs mypy (mypyc), setuptools and a C compiler: the ``accel`` extra and the system's cc.
"""

from __future__ import annotations

import os
import shutil
import sys
import sysconfig
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent


def _modules() -> list[str]:
    """The source files of ``kvlifetime.accel.MODULES`` (the one list of what compiles)."""
    sys.path.insert(0, str(ROOT))
    try:
        from kvlifetime.accel import MODULES
    finally:
        sys.path.pop(0)
    return [m.replace(".", "/") + ".py" for m in MODULES]


ACCEL_MODULES = tuple(_modules())

# mypyc's shared runtime for every module above: one top-level extension module of this name.
GROUP = "kvlifetime_accel"


def _ext_suffix() -> str:
    return str(sysconfig.get_config_var("EXT_SUFFIX"))


def compiled_files(root: Path = ROOT) -> list[Path]:
    """The extension modules an in-place build leaves (present or not)."""
    suffix = _ext_suffix()
    out = [root / f"{GROUP}__mypyc{suffix}"]
    out += [root / (m[: -len(".py")] + suffix) for m in ACCEL_MODULES]
    return out


def clean(root: Path = ROOT) -> list[Path]:
    """Remove the compiled modules, and any other extension module left beside a source of
    the package (one a former ``ACCEL_MODULES`` listed); return those removed."""
    suffix = _ext_suffix()
    stale = [
        so
        for so in (root / "kvlifetime").rglob(f"*{suffix}")
        if so.with_name(so.name[: -len(suffix)] + ".py").exists()
    ]
    removed = sorted({p for p in [*compiled_files(root), *stale] if p.exists()})
    for p in removed:
        p.unlink()
    return removed


def build(dest: Path, opt_level: str = "3") -> list[Path]:
    """Compile ``ACCEL_MODULES`` with mypyc and put the extension modules under ``dest`` at
    their package paths; return them. The C is built in a temporary directory."""
    from mypyc.build import mypycify
    from setuptools import Distribution  # type: ignore[import-untyped]

    with tempfile.TemporaryDirectory(prefix="kvlifetime-accel-") as tmp:
        cwd = os.getcwd()
        os.chdir(ROOT)  # mypy finds the modules' names from the package layout here
        try:
            exts = mypycify(
                list(ACCEL_MODULES),
                opt_level=opt_level,
                group_name=GROUP,
                target_dir=str(Path(tmp) / "c"),
            )
            # A Distribution of our own: setup() would read pyproject.toml, which is hatchling's.
            dist = Distribution({"ext_modules": exts, "script_name": "hatch_build.py"})
            out, temp = str(Path(tmp) / "lib"), str(Path(tmp) / "tmp")
            dist.script_args = ["build_ext", "--build-lib", out, "--build-temp", temp]
            dist.parse_command_line()
            dist.run_commands()
        finally:
            os.chdir(cwd)
        built: list[Path] = []
        lib = Path(tmp) / "lib"
        for so in sorted(lib.rglob(f"*{_ext_suffix()}")):
            target = dest / so.relative_to(lib)
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(so, target)
            built.append(target)
    return built


try:
    from hatchling.builders.hooks.plugin.interface import BuildHookInterface
except ImportError:  # not building a wheel (make accel needs only mypyc and setuptools)
    pass
else:

    class AccelBuildHook(BuildHookInterface):  # type: ignore[type-arg]
        """Hatchling's custom hook: off unless ``HATCH_BUILD_HOOK_ENABLE_CUSTOM=true`` (then
        the wheel carries the compiled modules, and is tagged for this Python and platform)."""

        PLUGIN_NAME = "custom"

        def initialize(self, version: str, build_data: dict[str, Any]) -> None:
            if self.target_name != "wheel":
                return
            self._out = Path(tempfile.mkdtemp(prefix="kvlifetime-accel-wheel-"))
            for so in build(self._out):
                build_data["force_include"][str(so)] = str(so.relative_to(self._out))
            build_data["pure_python"] = False
            build_data["infer_tag"] = True

        def finalize(self, version: str, build_data: dict[str, Any], artifact: str) -> None:
            out = getattr(self, "_out", None)
            if out is not None:
                shutil.rmtree(out, ignore_errors=True)


def main(argv: list[str]) -> int:
    if argv[1:] == ["--clean"]:
        for p in clean():
            print(f"removed {p.relative_to(ROOT)}")
        return 0
    if argv[1:]:
        print("usage: python hatch_build.py [--clean]", file=sys.stderr)
        return 2
    clean()
    for p in build(ROOT):
        print(f"built {p.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
