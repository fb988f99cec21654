"""``simulate``: one harness run (its arguments and its report live in the harness)."""

from __future__ import annotations

import argparse


def add_arguments(p: argparse.ArgumentParser) -> None:
    from kvlifetime.harness.simulate import add_arguments

    add_arguments(p)


def run(args: argparse.Namespace) -> int:
    from kvlifetime.harness.simulate import run_command

    return run_command(args)
