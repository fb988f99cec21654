"""The exception tree errors.py draws is every ``KVLifetimeError`` subclass in the package,
each under the branch whose fault it is (issue 22 item 5).

The drawing is generated (``python -m kvlifetime.architecture``) from the classes themselves,
after importing every module of the package (in a fresh interpreter: the import must not depend
on what earlier tests loaded or replaced in ``sys.modules``)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from kvlifetime import errors
from kvlifetime.architecture import committed_tree

_WALK = """
import json
from kvlifetime.architecture import (
    classes_out_of_reach, error_classes, error_tree, import_every_module, tree_problems,
)
skipped = import_every_module()
print(json.dumps({
    "tree": error_tree(),
    "problems": tree_problems(),
    "out_of_reach": classes_out_of_reach(skipped),
    "classes": [f"{c.__module__}.{c.__qualname__}" for c in error_classes()],
    "skipped": sorted(skipped),
}))
"""


@pytest.fixture(scope="module")
def walked() -> dict[str, object]:
    proc = subprocess.run(
        [sys.executable, "-c", _WALK], capture_output=True, text=True, check=True, timeout=120
    )
    result: dict[str, object] = json.loads(proc.stdout)
    return result


def test_errors_py_draws_every_error_class_of_the_package(walked: dict[str, object]) -> None:
    """Fails when an error class was added, moved, re-based or re-summarised and the drawing
    was not. Fix: `python -m kvlifetime.architecture` and commit kvlifetime/errors.py."""
    assert committed_tree() == walked["tree"], (
        "kvlifetime/errors.py's tree is not the classes': run `python -m kvlifetime.architecture`"
    )


def test_every_error_class_can_be_drawn(walked: dict[str, object]) -> None:
    """Each class has a docstring whose first line is one sentence (its line in the tree), a
    ``kind`` of its own no other class uses, and fits the drawing's width."""
    assert walked["problems"] == [], "fix the class, then `python -m kvlifetime.architecture`"


def test_no_error_class_hides_in_a_module_this_environment_cannot_import(
    walked: dict[str, object],
) -> None:
    """A module that cannot be imported here (vLLM's connector without vLLM) is read instead:
    a class in it based on a class of the tree would be missing from the drawing."""
    assert walked["out_of_reach"] == []


def test_the_walk_finds_classes_outside_errors_py(walked: dict[str, object]) -> None:
    classes = walked["classes"]
    assert isinstance(classes, list)
    for name in (
        "kvlifetime.harness.wire.MalformedMessage",
        "kvlifetime.integrations.sglang.errors.AlreadyInstalled",
        "kvlifetime.extras.MissingExtra",
    ):
        assert name in classes
        assert name.rsplit(".", 1)[1] in committed_tree()


def test_the_committed_tree_is_what_errors_py_shows() -> None:
    assert errors.__doc__ is not None
    assert committed_tree() in errors.__doc__
    assert committed_tree().startswith("KVLifetimeError\n")


@pytest.mark.parametrize(
    ("cls", "branch"),
    [
        (errors.DoubleRelease, errors.RequestError),
        (errors.UnknownRequest, errors.RequestError),
        (errors.DuplicateRequest, errors.RequestError),
        (errors.RequestError, errors.UsageError),
        (errors.BlockError, errors.UsageError),
    ],
)
def test_request_errors_and_block_errors_are_apart(cls: type, branch: type) -> None:
    """``DoubleRelease`` is about a request (release, reject or finish of a released key), not
    about block ids: it is a ``RequestError`` and no ``BlockError``."""
    assert issubclass(cls, branch)
    if branch is errors.RequestError:
        assert not issubclass(cls, errors.BlockError)


def test_the_environments_faults_have_their_branch() -> None:
    from kvlifetime.diagrams import DiagramError
    from kvlifetime.extras import MissingExtra
    from kvlifetime.harness.peer import PeerFailed
    from kvlifetime.report.browser import BrowserError

    for cls in (DiagramError, MissingExtra, PeerFailed, BrowserError):
        assert issubclass(cls, errors.EnvironmentFault)
        assert not issubclass(cls, errors.UsageError)
    assert issubclass(MissingExtra, ModuleNotFoundError)  # still caught as a failed import
