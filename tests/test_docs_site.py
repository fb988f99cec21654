"""The documentation site: built strictly by MkDocs (Material, mkdocstrings), and opened in
headless Chromium page by page with no script error."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from report_helpers import chromium_or_skip

from kvlifetime.report.browser import CHROMIUM_FLAGS, find_chromium

ROOT = Path(__file__).resolve().parent.parent
# The pages opened in the browser: the front door, the guide's first page, a generated page
# with its Graphviz pictures, a page that held a Mermaid block, the glossary and the API.
PAGES = (
    "index.html",
    "getting-started.html",
    "block.html",
    "architecture.html",
    "glossary.html",
    "reference/ledger.html",
)
_CONSOLE = re.compile(r':(?:INFO|WARNING|ERROR):CONSOLE[^\]]*\] "(.*?)", source: (\S+)')


def _build(config: Path, site: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(config), "-d", str(site)],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
        cwd=config.parent,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("site")
    done = _build(ROOT / "mkdocs.yml", out)
    assert done.returncode == 0, done.stderr[-3000:]
    return out


def test_site_builds_strictly_with_every_page_in_the_nav(site: Path) -> None:
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text(encoding="utf-8"))
    assert config["strict"] is True
    pages = {p.relative_to(ROOT / "docs").as_posix() for p in (ROOT / "docs").rglob("*.md")}
    for page in pages:
        assert (site / page.replace(".md", ".html")).is_file(), page
    # the API reference is generated from the docstrings: the ledger's calls are on it
    ledger = (site / "reference" / "ledger.html").read_text(encoding="utf-8")
    for call in ("allocate", "grant", "apply", "collect_releasable", "force_release"):
        assert f'id="kvlifetime.ledger.BlockLedger.{call}"' in ledger, call


def test_a_broken_link_fails_the_build(tmp_path: Path) -> None:
    """The build is strict with the project's own validation settings: a link to a page that
    does not exist is an error, not a warning."""
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text(encoding="utf-8"))
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "index.md").write_text("# Home\n\nSee [the contract](contract.md).\n")
    small = {k: config[k] for k in ("site_name", "strict", "validation", "use_directory_urls")}
    (tmp_path / "mkdocs.yml").write_text(yaml.safe_dump({**small, "docs_dir": "docs"}))
    done = _build(tmp_path / "mkdocs.yml", tmp_path / "site")
    assert done.returncode != 0
    assert "contract.md" in done.stderr


def _console(page: Path) -> tuple[str, list[str]]:
    """The page's DOM after its scripts ran, and every script error the console reported."""
    exe = find_chromium()
    assert exe is not None
    profile = page.parent / ".chromium-profile"
    done = subprocess.run(
        [
            exe,
            *CHROMIUM_FLAGS,
            f"--user-data-dir={profile}",
            "--enable-logging=stderr",
            "--v=0",
            "--virtual-time-budget=8000",
            "--dump-dom",
            page.resolve().as_uri(),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    errors = [m.group(1) for m in _CONSOLE.finditer(done.stderr) if "Uncaught" in m.group(1)]
    errors += [line for line in done.stderr.splitlines() if "net::ERR_" in line]
    return done.stdout, errors


def test_pages_render_in_chromium_without_script_errors(site: Path) -> None:
    chromium_or_skip()
    for name in PAGES:
        dom, errors = _console(site / name)
        assert errors == [], (name, errors)
        assert "<h1" in dom and 'class="md-content"' in dom, name


def test_the_console_check_catches_a_script_error(tmp_path: Path) -> None:
    chromium_or_skip()
    page = tmp_path / "broken.html"
    page.write_text("<html><body><h1>x</h1><script>undefinedFunction();</script></body></html>")
    _, errors = _console(page)
    assert any("undefinedFunction" in e for e in errors)
