"""Compiling the generated checker's C with the system's compiler, once, into a cache.

``build(source)`` returns the shared library compiled from ``source`` (C text), loaded with
``ctypes``. It is compiled once per distinct source and compiler: the sha256 of both names the
file, in ``cache_dir()`` (``$KVLIFETIME_CACHE``, else ``$XDG_CACHE_HOME/kvlifetime``, else
``~/.cache/kvlifetime``), under ``checker/``. A builder writes a temporary file and renames it
into place, so concurrent builders (pytest workers, two shells) never load a half-written
library. The compiler is ``$CC`` if set, else the first of ``cc``, ``gcc``, ``clang`` on the
``PATH``.

Where there is no compiler, or it fails, ``CompilerUnavailable`` says why (with the compiler's
own output); the caller runs the Python engine instead and says so. Nothing here runs a
search: this module only turns text into a loaded library.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shlex
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import attrs

from kvlifetime.errors import UsageError

FLAGS: tuple[str, ...] = ("-O2", "-std=c11", "-shared", "-fPIC", "-Wall")
"""Flags for every build (``-O2``: the checker is a hot loop; no ``-march``: the cache may be
shared by machines with one compiler)."""

_COMPILERS = ("cc", "gcc", "clang")
_lock = threading.Lock()
_loaded: dict[Path, ctypes.CDLL] = {}


class CompilerUnavailable(UsageError):
    """No C compiler here could build the generated checker.
    None was found, or it failed (its output is in the message). Whose fault: the machine's
    set-up. Nothing was cached; the Python engine answers instead."""

    kind = "compiler_unavailable"


@attrs.frozen(slots=True)
class Built:
    """One compiled library: where it is, and whether this call compiled it."""

    path: Path
    compiled: bool  # False: found in the cache
    compiler: str
    library: ctypes.CDLL = attrs.field(eq=False, repr=False)


def cache_dir() -> Path:
    """Where compiled checkers are kept (see the module doc)."""
    own = os.environ.get("KVLIFETIME_CACHE")
    if own:
        return Path(own)
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg) if xdg else Path.home() / ".cache"
    return base / "kvlifetime"


def compiler() -> list[str]:
    """The compiler command (``$CC`` split as a shell would, else the first found);
    ``CompilerUnavailable`` when there is none."""
    cc = os.environ.get("CC")
    if cc:
        cmd = shlex.split(cc)
        if cmd and shutil.which(cmd[0]):
            return cmd
        raise CompilerUnavailable(f"$CC={cc!r} is not an executable on the PATH")
    for name in _COMPILERS:
        path = shutil.which(name)
        if path:
            return [path]
    raise CompilerUnavailable(f"no C compiler on the PATH (looked for {', '.join(_COMPILERS)})")


def _version(cmd: list[str]) -> str:
    try:
        out = subprocess.run(
            [*cmd, "--version"], capture_output=True, text=True, timeout=30, check=False
        )
    except OSError as e:  # (the binary vanished, or cannot be run)
        raise CompilerUnavailable(f"{cmd[0]} cannot run: {e}") from e
    return out.stdout.splitlines()[0] if out.stdout else cmd[0]


def build(source: str, *, name: str = "checker") -> Built:
    """The library compiled from ``source``: from the cache, or compiled now and cached.
    ``CompilerUnavailable`` when it cannot be compiled here."""
    cmd = compiler()
    version = _version(cmd)
    digest = hashlib.sha256(
        "\0".join([source, " ".join(cmd), version, *FLAGS]).encode()
    ).hexdigest()[:24]
    folder = cache_dir() / "checker"
    path = folder / f"{name}-{digest}.so"
    with _lock:
        lib = _loaded.get(path)
        if lib is not None:
            return Built(path, False, version, lib)
        compiled = not path.is_file()
        if compiled:
            _compile(cmd, source, folder, path)
        lib = ctypes.CDLL(str(path))
        _loaded[path] = lib
        return Built(path, compiled, version, lib)


def _compile(cmd: list[str], source: str, folder: Path, path: Path) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=folder, prefix=".build-") as tmp:
        src = Path(tmp) / f"{path.stem}.c"
        src.write_text(source)
        out = Path(tmp) / path.name
        try:
            done = subprocess.run(
                [*cmd, *FLAGS, "-o", str(out), str(src)],
                capture_output=True,
                text=True,
                timeout=600,
                check=False,
            )
        except (OSError, subprocess.TimeoutExpired) as e:
            raise CompilerUnavailable(f"{cmd[0]} could not compile the checker: {e}") from e
        if done.returncode != 0 or not out.is_file():
            raise CompilerUnavailable(
                f"{cmd[0]} failed to compile the checker (exit {done.returncode}):\n"
                + (done.stderr or done.stdout)[-4000:]
            )
        os.replace(out, path)  # atomic: a concurrent builder loads a whole file or none


__all__ = ["FLAGS", "Built", "CompilerUnavailable", "build", "cache_dir", "compiler"]
