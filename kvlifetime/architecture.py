"""The package's shape, read from its own code: the exception tree every error class sits in.

``kvlifetime/errors.py`` draws the one exception tree, but not every class in it is defined
there: an error lives beside the code that raises it (the SGLang integration's in
``integrations/sglang/errors.py``, the wire's in ``harness/wire.py``), and ``errors.py``, the
lowest layer, cannot import them. So the tree is generated, like the transition table: this
module imports every module of the package, walks every subclass of ``KVLifetimeError``, and
draws the tree with each class's one-line summary (the first line of its docstring) and where
it is defined. ``python -m kvlifetime.architecture`` rewrites the drawing in ``errors.py``; a
test fails when the committed drawing differs from the classes (tests/test_error_tree.py).
"""

from __future__ import annotations

import ast
import importlib
import inspect
import pathlib
import sys

from kvlifetime.errors import KVLifetimeError

PACKAGE = pathlib.Path(__file__).resolve().parent
ERRORS_PY = PACKAGE / "errors.py"
WIDTH = 100  # the project's line length: the drawing is part of a docstring
_FENCE = "```"
ERRORS_MODULE = "kvlifetime.errors"


# --------------------------------------------------------------------------- the package's modules


def module_names(root: pathlib.Path = PACKAGE) -> list[str]:
    """Every module of the package, by dotted name, from its files (nothing is imported).
    A package is named by its ``__init__`` (``kvlifetime.cli``), the package itself is
    ``kvlifetime``."""
    names = []
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        names.append(".".join(parts))
    return names


def module_path(name: str, root: pathlib.Path = PACKAGE) -> pathlib.Path:
    """The file of a module named by ``module_names``."""
    rel = pathlib.Path(*name.split(".")[1:])
    package = root / rel / "__init__.py"
    return package if package.exists() else root / rel.with_suffix(".py")


def import_every_module() -> dict[str, str]:
    """Import every module of the package; return the ones that cannot be imported here, each
    with why (an optional engine, vLLM or SGLang, missing from this environment)."""
    skipped: dict[str, str] = {}
    for name in module_names():
        try:
            importlib.import_module(name)
        except ImportError as e:  # MissingExtra is one
            skipped[name] = f"{type(e).__name__}: {e}"
    return skipped


# --------------------------------------------------------------------------- the error tree


def error_classes() -> list[type[KVLifetimeError]]:
    """``KVLifetimeError`` and every subclass defined in kvlifetime, parents before children,
    siblings in the order they are written (``errors.py`` first, then by module)."""
    found: list[type[KVLifetimeError]] = []

    def walk(cls: type[KVLifetimeError]) -> None:
        found.append(cls)
        for sub in sorted(cls.__subclasses__(), key=_written_order):
            if sub.__module__.split(".")[0] == "kvlifetime" and sub not in found:
                walk(sub)

    walk(KVLifetimeError)
    return found


def _written_order(cls: type) -> tuple[bool, str, int]:
    return (cls.__module__ != ERRORS_MODULE, cls.__module__, inspect.getsourcelines(cls)[1])


def summary(cls: type) -> str:
    """The first line of the class's own docstring, without its full stop."""
    doc = cls.__dict__.get("__doc__") or ""
    return doc.strip().splitlines()[0].strip().removesuffix(".") if doc.strip() else ""


def tree_problems(classes: list[type[KVLifetimeError]] | None = None) -> list[str]:
    """What keeps a class out of a readable tree: no docstring of its own, a first line that is
    not one sentence, no ``kind`` of its own (the name counted in ``stats()`` and logged), a
    ``kind`` another class already uses, or a line too long for the drawing."""
    classes = error_classes() if classes is None else classes
    problems = []
    kinds: dict[str, str] = {}
    for cls in classes:
        where = f"{cls.__module__}.{cls.__qualname__}"
        doc = (cls.__dict__.get("__doc__") or "").strip()
        if not doc:
            problems.append(f"{where}: no docstring of its own")
        elif not _one_sentence(doc.splitlines()[0].strip()):
            problems.append(f"{where}: the docstring's first line is not one whole sentence")
        kind = cls.__dict__.get("kind")
        if not isinstance(kind, str):
            problems.append(f"{where}: no `kind` of its own")
        elif kind in kinds:
            problems.append(f"{where}: kind {kind!r} is already {kinds[kind]}'s")
        else:
            kinds[kind] = where
    problems += [
        f"line longer than {WIDTH} characters (shorten the docstring's first line): {line}"
        for line in _drawing(classes)
        if len(line) > WIDTH
    ]
    return problems


def _one_sentence(line: str) -> bool:
    return line.endswith(".") and ". " not in line


def _drawing(classes: list[type[KVLifetimeError]]) -> list[str]:
    rows: list[tuple[str, type]] = []

    def draw(cls: type, prefix: str, last: bool, root: bool) -> None:
        rows.append(
            (cls.__name__ if root else f"{prefix}{'└── ' if last else '├── '}{cls.__name__}", cls)
        )
        children = [c for c in classes if cls in c.__bases__ and _first_parent(c, classes) is cls]
        inner = "" if root else prefix + ("    " if last else "│   ")
        for i, child in enumerate(children):
            draw(child, inner, i == len(children) - 1, False)

    draw(classes[0], "", True, True)
    column = max(len(label) for label, _ in rows) + 2
    lines = [
        label if i == 0 else f"{label:<{column}}{summary(cls)}"
        for i, (label, cls) in enumerate(rows)
    ]
    elsewhere: dict[str, list[str]] = {}
    for cls in classes:
        if cls.__module__ != ERRORS_MODULE:
            elsewhere.setdefault(cls.__module__.removeprefix("kvlifetime."), []).append(
                cls.__name__
            )
    if elsewhere:
        lines += [
            "",
            "Defined beside the code that raises them (kvlifetime.*, each imports this one):",
        ]
        indent = max(len(m) for m in elsewhere) + 4
        for module in sorted(elsewhere):
            line = f"  {module:<{indent - 2}}"
            for k, name in enumerate(elsewhere[module]):
                word = name + ("," if k < len(elsewhere[module]) - 1 else "")
                if len(line) + 1 + len(word) > WIDTH and line.strip():
                    lines.append(line.rstrip())
                    line = " " * indent
                line += word if line.endswith(" ") else " " + word
            lines.append(line)
    return [line.rstrip() for line in lines]


def _first_parent(cls: type, classes: list[type[KVLifetimeError]]) -> type | None:
    """The one parent a class is drawn under: its first base inside the tree (``InvalidField``
    is a ``UsageError`` and a ``ValueError``: drawn under ``UsageError``)."""
    return next((b for b in cls.__bases__ if b in classes), None)


def error_tree() -> str:
    """The drawing of every ``KVLifetimeError`` subclass, as ``errors.py`` holds it."""
    return "\n".join(_drawing(error_classes())) + "\n"


def classes_out_of_reach(skipped: dict[str, str]) -> list[str]:
    """Classes in modules that cannot be imported here which look like kvlifetime errors (a
    base named like a class of the tree): the tree cannot be checked without them."""
    names = {cls.__name__ for cls in error_classes()}
    found = []
    for module, why in skipped.items():
        tree = ast.parse(module_path(module).read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                bases = {
                    b.id if isinstance(b, ast.Name) else getattr(b, "attr", "") for b in node.bases
                }
                if bases & names:
                    found.append(f"{module}.{node.name} ({why})")
    return found


def committed_tree(text: str | None = None) -> str:
    """The drawing ``errors.py`` holds now: the first fenced block of its docstring."""
    text = ERRORS_PY.read_text(encoding="utf-8") if text is None else text
    start = text.index(_FENCE + "\n") + len(_FENCE) + 1
    return text[start : text.index(_FENCE, start)]


def rewrite_errors_py() -> bool:
    """Put the current drawing into ``errors.py``; True if the file changed."""
    text = ERRORS_PY.read_text(encoding="utf-8")
    old, new = committed_tree(text), error_tree()
    if old == new:
        return False
    start = text.index(_FENCE + "\n") + len(_FENCE) + 1
    ERRORS_PY.write_text(text[:start] + new + text[start + len(old) :], encoding="utf-8")
    return True


def main() -> int:
    skipped = import_every_module()
    problems = tree_problems() + [
        f"cannot be imported here, so cannot be drawn: {c}" for c in classes_out_of_reach(skipped)
    ]
    if problems:
        print("\n".join(problems), file=sys.stderr)
        return 1
    print(f"{ERRORS_PY}: {'rewritten' if rewrite_errors_py() else 'already current'}")
    return 0


if __name__ == "__main__":  # python -m kvlifetime.architecture: rewrite the tree in errors.py
    sys.exit(main())
