"""The package's shape, read from its own code: its layers and the exception tree.

**Layers.** ``LAYERS`` is the one table of them, lowest first: a module imports only from its
own layer or below, and no two modules import each other, even through others. The imports are
read from the source (``ast``), every one of them, including those inside functions that load
a module only when it is first needed; only those under ``if TYPE_CHECKING:`` are left out
(they never run). ``layer_violations`` lists what breaks the rules, and a module over
``LONG_MODULE`` lines whose docstring does not say why it is one piece; tests/test_architecture.py
holds the package to it. docs/architecture.md draws the table (generated from it).

**The exception tree.** ``kvlifetime/errors.py`` draws it, but not every class in it is defined
there: an error lives beside the code that raises it (the SGLang integration's in
``integrations/sglang/errors.py``, the wire's in ``harness/wire.py``), and ``errors.py``, the
lowest layer, cannot import them. So the tree is generated, like the transition table: this
module imports every module of the package, walks every subclass of ``KVLifetimeError``, and
draws the tree with each class's one-line summary (the first line of its docstring) and where
it is defined. tests/test_error_tree.py fails when the committed drawing differs.

``python -m kvlifetime.architecture`` rewrites both drawings (in ``errors.py`` and in
docs/architecture.md, when run from a checkout).
"""

from __future__ import annotations

import ast
import importlib
import inspect
import pathlib
import re
import sys
from collections.abc import Iterator

import attrs

from kvlifetime.errors import KVLifetimeError

PACKAGE = pathlib.Path(__file__).resolve().parent
ERRORS_PY = PACKAGE / "errors.py"
ARCHITECTURE_MD = PACKAGE.parent / "docs" / "architecture.md"
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


# --------------------------------------------------------------------------- the layers


@attrs.frozen(slots=True)
class Layer:
    name: str
    files: tuple[str, ...]  # in kvlifetime/: a module ``x.py``, or a package ``x/`` and all in it
    holds: str  # what lives here: where a reader looks for a concept


LAYERS: tuple[Layer, ...] = (
    Layer(
        "foundation",
        ("__init__.py", "errors.py", "inputs.py", "source.py", "extras.py", "accel.py"),
        "the exception tree (every class, by whose fault), the argument checks, where a piece of "
        "evidence comes from, the optional dependencies (a missing one names its install), which "
        "of the ledger's and the verifier's modules run compiled (the optional accelerator); "
        "`kvlifetime` itself only names where each export lives (it imports none of them)",
    ),
    Layer(
        "claims",
        ("grant.py", "evidence.py", "provenance.py"),
        "grants; the acknowledgement classes, each saying what it proves and what it does not; "
        "who may make each claim",
    ),
    Layer(
        "spec",
        ("spec/",),
        "the specification, in one place: states, events, guards, the proof chain, the "
        "python-statemachine lifecycles, the compiled table and its committed rows",
    ),
    Layer(
        "ledger",
        ("ledger/", "prometheus.py", "testing.py", "pytest_plugin.py"),
        "`BlockLedger`, a facade over per-block state, the request table, batch helpers, "
        "snapshots and log events; beside it, what reads a ledger and nothing above: the "
        "Prometheus collector and the helpers and fixtures an engine's own tests use",
    ),
    Layer(
        "profiles",
        ("profiles.py",),
        "what each engine's raw statuses prove, as data (an adapter's or integration's `PROFILE` "
        "is looked up by module name, when asked for, not imported)",
    ),
    Layer(
        "adapters",
        ("adapters/",),
        "transfer engines behind one protocol: in-process (the default, never kinder than the "
        "real ones), Mooncake TCP, NIXL/UCX, each with its fence; the control plane's sockets",
    ),
    Layer(
        "guard",
        ("guard/",),
        "the one role-agnostic, sans-IO guard core under every engine: each request's state of "
        "the engine-side lifecycle (stepped from `spec/`), refusals as data on one log path",
    ),
    Layer(
        "integrations",
        ("integrations/",),
        "the guard inside real engines: `vllm/`, `sglang/` (a sans-IO guard and thin hooks)",
    ),
    Layer(
        "harness",
        ("harness/",),
        "one lock-step loop for push and pull, the owner and initiator of each direction, peers "
        "in their own processes, the wire schema, the oracle at the transport, typed results",
    ),
    Layer(
        "verify",
        ("verify/",),
        "the exhaustive explorer and its compiled model, the lying peer, counterexamples, the "
        "replay of a recorded log",
    ),
    Layer(
        "documents",
        ("diagrams.py", "pages.py", "report/", "architecture.py"),
        "what is generated from the code and from results: the diagrams, the pages of docs/ "
        "(evidence, engines), the review page, the map of layers and the exception tree (the "
        "API reference is built from the docstrings by mkdocstrings)",
    ),
    Layer(
        "cli",
        ("cli/", "__main__.py"),
        "one module per command: the only place that parses arguments or prints",
    ),
)
"""The layers, lowest first. A module imports only from its own layer or from one below."""

LONG_MODULE = 600  # lines; a longer module says at its top why it is one piece
_ONE_PIECE = re.compile(r"\bone piece\b", re.IGNORECASE)


def module_of(entry: str) -> str:
    """The module a ``Layer.files`` entry names: ``errors.py`` -> ``kvlifetime.errors``,
    ``spec/`` -> ``kvlifetime.spec``, ``__init__.py`` -> ``kvlifetime``."""
    if entry == "__init__.py":
        return "kvlifetime"
    return "kvlifetime." + entry.removesuffix("/").removesuffix(".py").replace("/", ".")


def layer_of(module: str, layers: tuple[Layer, ...] = LAYERS) -> int | None:
    """The index in ``layers`` of the layer a module belongs to (``None``: in no layer): the
    layer of the module's own file, or of the package it is in."""
    for i, layer in enumerate(layers):
        for entry in layer.files:
            name = module_of(entry)
            if module == name or (entry.endswith("/") and module.startswith(name + ".")):
                return i
    return None


def _type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _import_nodes(node: ast.AST) -> Iterator[ast.Import | ast.ImportFrom | ast.Call]:
    """Every import under ``node``, at any depth (in functions, classes, ``try``): the
    statements, and ``importlib.import_module`` / ``__import__`` of a literal name; except in
    the body of an ``if TYPE_CHECKING:`` (its ``else`` runs, so it counts)."""
    for child in ast.iter_child_nodes(node):
        by_name = isinstance(child, ast.Call) and _imports_by_name(child)
        if isinstance(child, ast.Import | ast.ImportFrom | ast.Call) and (
            by_name or not isinstance(child, ast.Call)
        ):
            yield child
        if isinstance(child, ast.If) and _type_checking(child):
            for stmt in child.orelse:
                yield from _import_nodes(ast.Module(body=[stmt], type_ignores=[]))
            continue
        yield from _import_nodes(child)


def _imports_by_name(node: ast.Call) -> bool:
    if not node.args:
        return False
    f, arg = node.func, node.args[0]
    called = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""
    literal = isinstance(arg, ast.Constant) and isinstance(arg.value, str)
    return literal and called in ("import_module", "__import__")


def lazy_exports(root: pathlib.Path = PACKAGE) -> dict[str, str]:
    """``kvlifetime``'s table of exports (name -> defining module): ``from kvlifetime import
    BlockLedger`` loads ``kvlifetime.ledger`` through the package's ``__getattr__``, so it is an
    import of that module. Read from the source (the ``_EXPORTS = ...`` literal)."""
    tree = ast.parse((root / "__init__.py").read_text(encoding="utf-8"))
    for node in tree.body:
        target: ast.expr | None = node.target if isinstance(node, ast.AnnAssign) else None
        if isinstance(node, ast.Assign) and len(node.targets) == 1:
            target = node.targets[0]
        value = getattr(node, "value", None)
        if isinstance(target, ast.Name) and target.id == "_EXPORTS" and value is not None:
            code = compile(ast.Expression(value), "_EXPORTS", "eval")
            table = eval(code, {"__builtins__": {}, "dict": dict})  # a literal of our own source
            return {str(k): str(v) for k, v in table.items()}
    return {}


def imports(
    module: str,
    modules: set[str],
    root: pathlib.Path = PACKAGE,
    exports: dict[str, str] | None = None,
) -> set[str]:
    """The package's modules ``module`` imports, read from its source. ``from kvlifetime.spec
    import table`` is an import of ``kvlifetime.spec.table`` when that is a module, of
    ``kvlifetime.spec`` otherwise; ``from kvlifetime import BlockLedger`` of the module that
    defines the export (``lazy_exports``). The parent packages Python runs on the way are not
    counted: a package's ``__init__`` importing its own modules would otherwise close a circle
    with every one of them."""
    exports = lazy_exports(root) if exports is None else exports
    path = module_path(module, root)
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: set[str] = set()
    for node in _import_nodes(tree):
        if isinstance(node, ast.Call):
            arg = node.args[0]
            targets = [str(arg.value)] if isinstance(arg, ast.Constant) else []
        elif isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        else:
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                parts = parts[: len(parts) - node.level + 1]
                base = ".".join([*parts, base] if base else parts)
            targets = []
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                if sub in modules:
                    targets.append(sub)
                elif base == "kvlifetime" and alias.name in exports:
                    targets.append(exports[alias.name])
                else:
                    targets.append(base)
        for target in targets:
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if target and target != module:
                found.add(target)
    return found


def import_graph(root: pathlib.Path = PACKAGE) -> dict[str, set[str]]:
    """Each module of the package -> the modules of the package it imports."""
    modules = set(module_names(root))
    exports = lazy_exports(root)
    return {m: imports(m, modules, root, exports) for m in sorted(modules)}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The circles of the import graph: each set of modules that reach one another (Tarjan's
    strongly connected components of more than one module), sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:  # the package has ~100 modules: recursion is shallow enough
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(found)


def says_why_one_piece(path: pathlib.Path) -> bool:
    """The module's docstring (its top) says why it is one piece (the words "one piece")."""
    doc = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8")))
    return doc is not None and _ONE_PIECE.search(doc) is not None


def layer_violations(root: pathlib.Path = PACKAGE, layers: tuple[Layer, ...] = LAYERS) -> list[str]:
    """Everything that breaks the layers, one stable line each, sorted:

    - ``unplaced: M`` — a module in no layer;
    - ``no such module: layer L names E`` — a layer entry that is no module (or no package);
    - ``upward: M (L1) -> N (L2)`` — an import from a lower layer to a higher one;
    - ``cycle: M <-> N <-> ...`` — modules that import one another;
    - ``long: M`` — over ``LONG_MODULE`` lines without saying at its top why it is one piece.
    """
    graph = import_graph(root)
    found: set[str] = set()
    placed = {m: layer_of(m, layers) for m in graph}
    found |= {f"unplaced: {m}" for m, i in placed.items() if i is None}
    for layer in layers:
        for entry in layer.files:
            path = root / entry
            if not (path / "__init__.py" if entry.endswith("/") else path).is_file():
                found.add(f"no such module: layer {layer.name} names {entry}")
    for m, targets in graph.items():
        for t in targets:
            lm, lt = placed[m], placed[t]
            if lm is not None and lt is not None and lt > lm:
                found.add(f"upward: {m} ({layers[lm].name}) -> {t} ({layers[lt].name})")
    found |= {"cycle: " + " <-> ".join(c) for c in cycles(graph)}
    for m in graph:
        path = module_path(m, root)
        lines = len(path.read_text(encoding="utf-8").splitlines())
        if lines > LONG_MODULE and not says_why_one_piece(path):
            found.add(f"long: {m}")
    return sorted(found)


# --------------------------------------------------------------------------- docs/architecture.md

_BEGIN = "<!-- generated by `python -m kvlifetime.architecture` from LAYERS: do not edit -->"
_END = "<!-- end of generated -->"


def layers_markdown(layers: tuple[Layer, ...] = LAYERS) -> str:
    """The picture (mermaid) and the table of the layers, as docs/architecture.md shows them."""
    lines = ["```mermaid", "flowchart TB"]
    for layer in reversed(layers):
        files = " · ".join(layer.files)
        lines.append(f'    {layer.name}["<b>{layer.name}</b><br/>{files}"]')
    top_down = [layer.name for layer in reversed(layers)]
    lines.append("    " + " --> ".join(top_down))
    lines += ["```", "", "| layer | modules | what lives there |", "| --- | --- | --- |"]
    for layer in reversed(layers):
        files = ", ".join(f"`{f}`" for f in layer.files)
        lines.append(f"| {layer.name} | {files} | {layer.holds} |")
    return "\n".join(lines) + "\n"


def committed_layers(text: str | None = None) -> str:
    """The generated part docs/architecture.md holds now."""
    text = ARCHITECTURE_MD.read_text(encoding="utf-8") if text is None else text
    start = text.index(_BEGIN) + len(_BEGIN) + 1
    return text[start : text.index(_END, start)]


def rewrite_architecture_md() -> bool:
    """Put the current picture and table into docs/architecture.md; True if it changed."""
    text = ARCHITECTURE_MD.read_text(encoding="utf-8")
    old, new = committed_layers(text), layers_markdown()
    if old == new:
        return False
    start = text.index(_BEGIN) + len(_BEGIN) + 1
    ARCHITECTURE_MD.write_text(text[:start] + new + text[start + len(old) :], encoding="utf-8")
    return True


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
    if ARCHITECTURE_MD.exists():  # a checkout, not an installed wheel
        changed = rewrite_architecture_md()
        print(f"{ARCHITECTURE_MD}: {'rewritten' if changed else 'already current'}")
    return 0


if __name__ == "__main__":  # python -m kvlifetime.architecture: rewrite both drawings
    sys.exit(main())
