"""What every command shares: its logger, writing a file, emitting to stdout or ``-o``, argument
types that refuse bad numbers, progress on stderr, and what was done when Ctrl-C came."""

from __future__ import annotations

import argparse
import contextlib
import math
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import structlog

from kvlifetime.errors import UsageError

if TYPE_CHECKING:
    from tqdm import tqdm

Logger = Any  # a structlog bound logger (wrap_logger / get_logger return a lazy proxy)


def library_logger() -> Logger:
    return structlog.get_logger("kvlifetime")


def write_text(path: Path, text: str, log: Logger) -> None:
    """Write ``text`` as UTF-8 with ``\\n`` line endings on every platform (byte-stable docs)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8", newline="\n") as f:
        f.write(text)
    log.info("file_written", path=str(path), bytes=len(text.encode("utf-8")))


class MissingInput(UsageError):
    """An input file named on the command line is missing (or not a file).

    Whose fault: the caller (a mistyped path). State left: nothing read, nothing written.
    """

    kind = "missing_input"


def input_file(path: Path, what: str) -> Path:
    """``path``, if it is a file to read; else ``MissingInput`` naming ``what`` it is."""
    if not path.exists():
        raise MissingInput(f"{what} {path}: no such file")
    if not path.is_file():
        raise MissingInput(f"{what} {path}: not a file")
    return path


def emit(text: str, args: argparse.Namespace) -> None:
    if args.output is None or args.output == "-":
        sys.stdout.write(text)
        args.log.info("stdout_written", command=args.command, bytes=len(text.encode("utf-8")))
    else:
        write_text(Path(args.output), text, args.log)


# ------------------------------------------------------------------ argument types


def bounded_int(low: int, high: int | None = None) -> Callable[[str], int]:
    """An argparse ``type`` for an integer in ``[low, high]``.

    argparse reports a refusal against the option the user typed (``argument --requests: ...``),
    so a bad value never surfaces later as an error about a field nobody passed.
    """

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
        if value < low or (high is not None and value > high):
            span = f">= {low}" if high is None else f"in [{low}, {high}]"
            raise argparse.ArgumentTypeError(f"must be {span}, got {value}")
        return value

    parse.__name__ = "integer"
    return parse


def probability(text: str) -> float:
    """An argparse ``type`` for a probability: a finite number in ``[0, 1]``."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not math.isfinite(value) or not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"must be a probability in [0, 1], got {text}")
    return value


# ------------------------------------------------------------------ progress and Ctrl-C


class Interrupted(KeyboardInterrupt):
    """Ctrl-C, with what the command had finished when it came (``done``, one line).

    A ``KeyboardInterrupt``, so a caller that does not know it still stops; the command line
    prints ``done`` and exits 130. Raised by ``progress`` around a unit of work; a command that
    runs several units re-raises it with its own count in front (``interrupted``).
    """

    def __init__(self, done: str) -> None:
        super().__init__(done)
        self.done = done


def interrupted(done: str, inner: BaseException) -> Interrupted:
    """``Interrupted`` saying ``done``, followed by what an inner unit had done, if it said."""
    if isinstance(inner, Interrupted):
        return Interrupted(f"{done}; {inner.done}")
    return Interrupted(done)


class Bar:
    """The count of a unit of work, shown by tqdm when it shows (it counts either way)."""

    def __init__(self, bar: tqdm[Any]) -> None:
        self._bar = bar
        self.n = 0

    def set(self, n: int) -> None:
        if n != self.n:
            self._bar.update(n - self.n)
            self.n = n

    def advance(self, k: int = 1) -> None:
        self.set(self.n + k)


@contextlib.contextmanager
def progress(
    total: int, desc: str, unit: str, *, show: bool | None = None, position: int = 0
) -> Iterator[Bar]:
    """A progress bar on stderr (stdout stays the command's output).

    ``show``: True always, False never, None when stderr is a terminal (a CI log or a pipe
    gets no bar). A Ctrl-C inside the block becomes ``Interrupted`` with the count so far.
    """
    from tqdm import tqdm

    bar = Bar(
        tqdm(
            total=total,
            desc=desc,
            unit=unit,
            file=sys.stderr,
            disable=None if show is None else not show,
            leave=False,
            dynamic_ncols=True,
            position=position,
        )
    )
    try:
        yield bar
    except KeyboardInterrupt as e:
        raise interrupted(f"{desc}: {bar.n} of {total} {unit}", e) from e
    finally:
        bar._bar.close()
