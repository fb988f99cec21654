"""docs/api.md: generated from the code, covering every export (its drift is checked with the
other generated pages in test_diagrams.py)."""

from __future__ import annotations

from pathlib import Path

import kvlifetime
from kvlifetime import BlockLedger
from kvlifetime.apidoc import api_markdown

DOCS = Path(__file__).resolve().parent.parent / "docs"


def test_every_export_has_an_entry_and_the_committed_page_is_current() -> None:
    text = api_markdown()
    for name in kvlifetime._EXPORTS:
        assert f"### `{name}`" in text, name
    assert (DOCS / "api.md").read_text(encoding="utf-8") == text


def test_every_public_method_of_the_ledger_is_listed_with_its_signature() -> None:
    text = api_markdown()
    public = [n for n, m in vars(BlockLedger).items() if not n.startswith("_") and callable(m)]
    assert public
    for name in public:
        assert f"`{name}(" in text or f"`BlockLedger.{name}(" in text, name
