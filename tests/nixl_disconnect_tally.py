"""Tally the outcomes of ``test_nixl_adapter``'s disconnect experiment, for the figure in
``docs/engine-facts.md``: ``python tests/nixl_disconnect_tally.py 25`` (run four at once to
load the machine as the figure says). Prints a dict of (poll answer, how much landed) -> runs.
Not collected by pytest: a measurement, not a test."""

from __future__ import annotations

import collections
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))

import test_nixl_adapter as experiment
from nixl_helpers import Initiator, need_nixl


def main(runs: int) -> dict[tuple[str, str], int]:
    need_nixl()
    tally: collections.Counter[tuple[str, str]] = collections.Counter()
    started: list[Initiator] = []

    def start(target: Any) -> Initiator:
        i = Initiator(target.descriptor())
        started.append(i)
        return i

    for _ in range(runs):
        answer, landed = experiment.disconnect_mid_write(start)
        part = "none" if landed == 0 else "all" if landed == experiment.BIG else "part"
        tally[(answer, part)] += 1
        while started:
            started.pop().close()
    return dict(tally)


if __name__ == "__main__":
    print(main(int(sys.argv[1]) if len(sys.argv) > 1 else 25))
