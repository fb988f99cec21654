"""The committed table data is what the specification compiles to, and the ledger runs it
without importing python-statemachine."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from kvlifetime.spec.table import (
    block_table,
    compiled_from_spec,
    engine_table,
    request_table,
    table_for,
)
from kvlifetime.spec.vocabulary import GUARDS


@pytest.mark.parametrize(
    ("machine", "table"),
    [("request", request_table), ("block", block_table), ("engine", engine_table)],
)
def test_the_committed_data_is_the_compiled_specification(machine: str, table: object) -> None:
    """Fails when kvlifetime/spec/lifecycles.py changed and the data did not.
    Fix: `python -m kvlifetime.spec.table` and commit kvlifetime/spec/table_data.py."""
    assert callable(table)
    got, want = table(), compiled_from_spec(machine)
    assert got == want  # states, initial, finals, events and every row, in order
    assert got.index == want.index
    assert set(got.guards) == set(want.guards)


@pytest.mark.parametrize("machine", ["request", "block", "engine"])
def test_every_guard_is_written_once_and_used(machine: str) -> None:
    """The tables call the guard functions themselves, the classes' conditions call the same
    functions, and no guard is left that no row names."""
    from kvlifetime.spec.lifecycles import SPECS

    guards = GUARDS[machine]
    table = table_for(machine)
    assert {r.guard for r in table.rows} - {None} == set(guards)
    assert all(table.guards[name] is fn for name, fn in guards.items())
    for name, fn in guards.items():
        condition = getattr(SPECS[machine], name)
        assert condition.__name__ == name and condition.__doc__ == fn.__doc__


def test_an_unchecked_ledger_does_not_import_python_statemachine() -> None:
    code = (
        "import sys, json\n"
        "from kvlifetime import BlockLedger, CancelReceived\n"
        "led = BlockLedger(4)\n"
        "g = led.grant('r', 'p', led.allocate('r', 2))\n"
        "led.reject('r'); led.apply(CancelReceived.of(g))\n"
        "unchecked = 'statemachine' in sys.modules\n"
        "BlockLedger(4, checked=True).allocate('x', 1)\n"
        "print(json.dumps([unchecked, 'statemachine' in sys.modules]))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    )
    assert json.loads(proc.stdout) == [False, True]  # checked mode loads the specification
