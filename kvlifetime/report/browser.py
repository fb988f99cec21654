"""Open the page in headless Chromium and read back what the browser made of it.

The page carries its own check (``page._CHECK``): once loaded, it counts what the browser drew
in every figure (Graphviz nodes, sequence steps, plot axes, and each one's size) and records
every script error, as JSON in ``<pre id="verdict">``. ``check_page`` loads the file with
``--dump-dom`` (the DOM after the scripts ran) and parses that verdict; with ``screenshot`` it
loads it again at the page's full height and writes a PNG.

Chromium runs with no network at all (every host name resolves to nothing), a fresh empty
profile, and the flags that let it run headless as root in a container.
"""

from __future__ import annotations

import html
import json
import re
import shutil
import subprocess
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs

from kvlifetime.errors import EnvironmentFault

CHROMIUM_FLAGS: tuple[str, ...] = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--hide-scrollbars",
    "--host-resolver-rules=MAP * ~NOTFOUND",  # offline: nothing can be fetched
)
WIDTH = 1280  # a laptop screen, or a slide projected at 1280 x 720
MAX_HEIGHT = 16_000
_VERDICT = re.compile(r'<pre id="verdict"[^>]*>(.*?)</pre>', re.S)


class BrowserError(EnvironmentFault):
    """The page could not be checked in a browser.
    Whose fault: the environment (no Chromium, or a Chromium that failed), or the page (no
    verdict: its check never ran)."""

    kind = "browser"


class ChromiumNotFound(BrowserError):
    """No Chromium on ``PATH`` (the page's browser check needs it)."""

    kind = "chromium_not_found"

    def __init__(self) -> None:
        super().__init__(
            "Chromium was not found on PATH: install Debian's chromium (apt-get install chromium)"
        )


def find_chromium() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        exe = shutil.which(name)
        if exe is not None:
            return exe
    return None


@attrs.frozen(slots=True)
class PageCheck:
    """What the browser found on the page."""

    verdict: Mapping[str, Any]  # the page's own JSON verdict (see the module docstring)
    screenshot: Path | None
    stderr: str  # Chromium's own diagnostics, for a failure message

    @property
    def ok(self) -> bool:
        return bool(self.verdict.get("ok"))

    @property
    def figures(self) -> Sequence[Mapping[str, Any]]:
        figs: Sequence[Mapping[str, Any]] = self.verdict.get("figures", [])
        return figs

    @property
    def tables(self) -> Sequence[Mapping[str, Any]]:
        tables: Sequence[Mapping[str, Any]] = self.verdict.get("tables", [])
        return tables

    def problems(self) -> str:
        """Everything the page's check found wrong, one clause each."""
        out = []
        for f in self.figures:
            if f.get("ok"):
                continue
            fid = f.get("id")
            if not f.get("drawn"):
                out.append(f"figure {fid} ({f.get('parts')} of {f.get('expect')} parts drawn)")
            if f.get("drawn") and not f.get("fits"):
                out.append(f"figure {fid} is {f.get('width')} px wide in {f.get('room')} px")
            out += [f"figure {fid}: {a!r} overlaps {b!r}" for a, b in f.get("overlaps", [])]
            out += [f"figure {fid}: {t!r} leaves the picture" for t in f.get("outside", [])]
            out += [f"figure {fid}: a line runs through {t!r}" for t in f.get("struck", [])]
            out += [
                f"figure {fid}: {t!r} is {d} px from its edge, {o} px from another"
                for t, d, o in f.get("strays", [])
            ]
        out += [
            f"table {t.get('head')!r} is {t.get('width')} px wide in {t.get('room')} px"
            for t in self.tables
            if not t.get("ok")
        ]
        out += [f"script error: {e}" for e in self.verdict.get("errors", [])]
        return "; ".join(out)


def _run(exe: str, args: Sequence[str], timeout: float) -> subprocess.CompletedProcess[bytes]:
    with tempfile.TemporaryDirectory(prefix="kvlifetime-chromium-") as profile:
        cmd = [exe, *CHROMIUM_FLAGS, f"--user-data-dir={profile}", *args]
        try:
            return subprocess.run(cmd, capture_output=True, timeout=timeout, check=False)
        except (OSError, subprocess.SubprocessError) as e:
            raise BrowserError(f"running {exe} failed: {e}") from e


def check_page(index: Path, *, screenshot: Path | None = None, timeout: float = 60.0) -> PageCheck:
    """Load ``index`` in headless Chromium; the page's verdict, and a PNG if asked for."""
    exe = find_chromium()
    if exe is None:
        raise ChromiumNotFound()
    uri = index.resolve().as_uri()
    done = _run(
        exe,
        [f"--window-size={WIDTH},1000", "--virtual-time-budget=10000", "--dump-dom", uri],
        timeout,
    )
    dom = done.stdout.decode("utf-8", "replace")
    err = done.stderr.decode("utf-8", "replace")
    m = _VERDICT.search(dom)
    if m is None or not m.group(1).strip():
        tail = " ".join(err.split()[-40:])
        raise BrowserError(
            f"{index}: the page's check did not run (exit {done.returncode}): {tail}"
        )
    verdict = json.loads(html.unescape(m.group(1)))
    shot = None
    if screenshot is not None:
        height = min(MAX_HEIGHT, max(800, int(verdict.get("height", 2400))))
        screenshot.parent.mkdir(parents=True, exist_ok=True)
        shot_run = _run(
            exe,
            [f"--screenshot={screenshot.resolve()}", f"--window-size={WIDTH},{height}", uri],
            timeout,
        )
        if not screenshot.is_file():
            tail = " ".join(shot_run.stderr.decode("utf-8", "replace").split()[-40:])
            raise BrowserError(f"Chromium wrote no screenshot {screenshot}: {tail}")
        shot = screenshot
    return PageCheck(verdict, shot, err)
