"""The ``kvlifetime`` command's entry point (also ``python -m kvlifetime``).

The command itself is ``kvlifetime.cli``. This module only imports it, inside the handler a
Ctrl-C needs: that import (numpy, structlog, the tables) takes about 0.2 s (2 cores), and a
Ctrl-C during it used to end in a traceback, where one later ends with exit 130 and one line.
It also keeps the harness's peer processes light: a spawned child re-imports the script that
started its owner, which is this module, not the whole command line.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

EXIT_INTERRUPTED = 130  # as every kvlifetime command (128 + SIGINT)


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``kvlifetime.cli.main(argv)``; a Ctrl-C before the command has started (while it is
    imported, or its arguments parsed) exits 130 with one line."""
    try:
        from kvlifetime.cli import main as command

        return command(argv)
    except KeyboardInterrupt:  # a Ctrl-C inside the command is the command's own to report
        print("kvlifetime: interrupted: nothing had started", file=sys.stderr)
        return EXIT_INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())
