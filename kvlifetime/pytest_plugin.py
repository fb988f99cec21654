"""kvlifetime's pytest plugin: fixtures for an engine's own tests of its block lifetimes.

Installed with kvlifetime and registered through the ``pytest11`` entry point, so a test
suite of a project that depends on kvlifetime gets these fixtures with no ``conftest.py``:

- ``ledger`` — a fresh ``BlockLedger`` per test, *checked*: every request transition is
  mirrored into the specification (the python-statemachine classes), and a disagreement raises
  ``SpecDisagreement`` inside the call that caused it. 16 blocks unless the test is marked
  ``@pytest.mark.kvlifetime(num_blocks=64)``;
- ``checked_ledger`` — a factory of such ledgers, for a test that needs several or a size of
  its own: ``led = checked_ledger(64)``, ``checked_ledger(8, incarnation="decode-0")``;
- ``captured_logs`` — the structlog events kvlifetime logs during the test (one dict each,
  ``event`` names it), collected with ``structlog.testing.capture_logs`` and structlog left as
  it was found afterwards; pair it with ``kvlifetime.testing.assert_transitions``.

Nothing is imported from kvlifetime until a fixture is used: loading the plugin costs a suite
that never asks for these fixtures nothing. ``examples/test_engine_contract.py`` is the test an
engine would write with them, against the transition tables.

(``kvlifetime.integrations.vllm.pytest_plugin`` is another plugin, for vLLM's own test suite:
it is never loaded through this entry point, only with ``-p``.)
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, MutableMapping
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from kvlifetime.ledger import BlockLedger

DEFAULT_BLOCKS = 16

CheckedLedgerFactory = Callable[..., "BlockLedger"]


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "kvlifetime(num_blocks=16, incarnation=None): the size (and incarnation) of the "
        "`ledger` fixture's BlockLedger",
    )


@pytest.fixture
def checked_ledger() -> CheckedLedgerFactory:
    """A factory: ``checked_ledger(num_blocks=16, *, incarnation=None)`` returns a fresh
    ``BlockLedger(num_blocks, checked=True)``; call it as often as the test needs."""
    from kvlifetime.testing import new_checked_ledger

    def make(num_blocks: int = DEFAULT_BLOCKS, *, incarnation: str | None = None) -> BlockLedger:
        return new_checked_ledger(num_blocks, incarnation=incarnation)

    return make


@pytest.fixture
def ledger(request: pytest.FixtureRequest, checked_ledger: CheckedLedgerFactory) -> BlockLedger:
    """A fresh checked ``BlockLedger`` (see the module docstring for its size)."""
    marker = request.node.get_closest_marker("kvlifetime")
    kwargs: dict[str, Any] = dict(marker.kwargs) if marker is not None else {}
    unknown = set(kwargs) - {"num_blocks", "incarnation"}
    if unknown or (marker is not None and marker.args):
        raise pytest.UsageError(
            f"@pytest.mark.kvlifetime takes num_blocks= and incarnation= only, got "
            f"{sorted(unknown) or list(marker.args if marker else ())}"
        )
    return checked_ledger(**kwargs)


@pytest.fixture
def captured_logs() -> Iterator[list[MutableMapping[str, Any]]]:
    """kvlifetime's log events during the test, as dicts (structlog restored afterwards)."""
    from kvlifetime.testing import captured_logs as capture

    with capture() as logs:
        yield logs
