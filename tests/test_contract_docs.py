"""The contract lives in the repository: docs/contract.md and docs/engine-facts.md state it, the
code points at them, every such pointer resolves, and nothing cites a document the repository
does not hold."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from kvlifetime.evidence import BY_NAME
from kvlifetime.spec.table import block_table, request_table

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
SCANNED = [
    *sorted((ROOT / "kvlifetime").rglob("*.py")),
    *sorted(DOCS.glob("*.md")),
    *sorted((ROOT / "examples").glob("*.py")),
    *sorted((ROOT / "bench").glob("*.py")),
    ROOT / "README.md",
    ROOT / "CHANGELOG.md",
]
# From code and top-level files: docs/NAME.md#anchor; from a page in docs/: (NAME.md#anchor).
_FROM_CODE = re.compile(r"docs/([\w.-]+\.md)(?:#([\w-]+))?")
_FROM_PAGE = re.compile(r"\]\(([\w.-]+\.md)(?:#([\w-]+))?\)")


def _slug(heading: str) -> str:
    """The anchor a Markdown renderer (GitHub's) gives a heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    return {_slug(m.group(1)) for m in re.finditer(r"(?m)^#+ (.+)$", page.read_text())}


def _links() -> list[tuple[Path, str, str | None]]:
    out = []
    for path in SCANNED:
        text = path.read_text(encoding="utf-8")
        pattern = _FROM_PAGE if path.parent == DOCS else _FROM_CODE
        out += [(path, m.group(1), m.group(2)) for m in pattern.finditer(text)]
    return out


def test_every_pointer_to_a_docs_page_resolves() -> None:
    links = _links()
    assert any(p.suffix == ".py" and name == "contract.md" for p, name, _ in links)
    assert any(p.suffix == ".py" and name == "engine-facts.md" for p, name, _ in links)
    broken = []
    for path, name, anchor in links:
        page = DOCS / name
        if not page.exists():
            broken.append(f"{path.relative_to(ROOT)}: docs/{name} does not exist")
        elif anchor is not None and anchor not in _anchors(page):
            broken.append(f"{path.relative_to(ROOT)}: docs/{name} has no #{anchor}")
    assert broken == []


@pytest.mark.parametrize(
    "needle",
    # Spelled in pieces so that this file does not match itself.
    ["DESIGN" + " §", "DESIGN" + ".md", "shared" + "/notes", "../" + "shared", "notes" + "/"],
)
def test_nothing_cites_a_document_outside_the_repository(needle: str) -> None:
    here = Path(__file__).resolve()
    files = [*SCANNED, *sorted((ROOT / "tests").rglob("*.py")), ROOT / "Makefile"]
    hits = [
        str(p.relative_to(ROOT))
        for p in files
        if p.resolve() != here and needle in p.read_text(encoding="utf-8")
    ]
    assert hits == []


def test_the_contract_page_names_every_transition_state_and_evidence_class() -> None:
    text = (DOCS / "contract.md").read_text()
    table = request_table()
    missing = [f"`{n}`" for n in (*table.events, *table.states) if n not in text]
    missing += [n for n in block_table().states if n not in text]
    missing += [n for n in BY_NAME if f"`{n}" not in text]
    assert missing == []
