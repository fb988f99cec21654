"""The API reference (docs/api.md), generated from the code: every name ``kvlifetime`` exports.

Each name gets its signature and the first paragraph of its own docstring; a class defined in
kvlifetime also lists its public methods and properties, each with its signature and first
line. ``kvlifetime docs --out docs`` writes it and a test checks the committed page is what the
code says, so the reference cannot drift. The hand-written, annotated summary of the ledger's
calls is docs/ledger-api.md; the contract they keep is docs/contract.md.
"""

from __future__ import annotations

import enum
import inspect
from collections.abc import Callable
from typing import Any

__all__ = ["api_markdown"]

_HEADER = """\
# API reference

Generated from the docstrings by `kvlifetime docs --out docs`. Do not edit.

Every name below imports from `kvlifetime` itself (`from kvlifetime import BlockLedger`), and is
loaded only when first used. What the calls must keep is [contract.md](contract.md); an
annotated summary of the ledger's calls is [ledger-api.md](ledger-api.md).
"""


def _first_paragraph(obj: object) -> str:
    doc = obj.__dict__.get("__doc__") if isinstance(obj, type) else getattr(obj, "__doc__", None)
    if not isinstance(doc, str) or not doc.strip():
        return ""
    return " ".join(inspect.cleandoc(doc).split("\n\n")[0].split())


def _default(value: object) -> str:
    if isinstance(value, enum.Enum):
        return f"{type(value).__name__}.{value.name}"
    return repr(value)


def _signature(fn: Callable[..., Any], *, drop_self: bool) -> str:
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return "(...)"
    parts: list[str] = []
    star_done = False
    params = list(sig.parameters.values())
    if drop_self and params and params[0].name in ("self", "cls"):
        params = params[1:]
    for p in params:
        if p.kind is p.KEYWORD_ONLY and not star_done:
            parts.append("*")
            star_done = True
        if p.kind is p.VAR_POSITIONAL:
            star_done = True
            text = f"*{p.name}"
        elif p.kind is p.VAR_KEYWORD:
            text = f"**{p.name}"
        else:
            text = p.name
        if p.annotation is not p.empty:
            text += f": {_annotation(p.annotation)}"
        if p.default is not p.empty:
            eq = " = " if p.annotation is not p.empty else "="
            text += f"{eq}{_default(p.default)}"
        parts.append(text)
        if p.kind is p.POSITIONAL_ONLY and (
            p is params[-1] or params[params.index(p) + 1].kind is not p.POSITIONAL_ONLY
        ):
            parts.append("/")
    out = f"({', '.join(parts)})"
    ret = sig.return_annotation
    if ret is not sig.empty:
        out += f" -> {_annotation(ret)}"
    return out


def _annotation(ann: object) -> str:
    # Under ``from __future__ import annotations`` they are the source text already.
    return ann if isinstance(ann, str) else inspect.formatannotation(ann)


def _own_bases(cls: type) -> list[type]:
    """``cls`` and the private bases it is built from in kvlifetime (``BlockLedger``'s read
    side, say): their members are the class's own, for the reader."""
    return [cls] + [
        b
        for b in cls.__mro__[1:]
        if b.__name__.startswith("_") and b.__module__.startswith("kvlifetime.")
    ]


def _members(cls: type) -> list[str]:
    lines: list[str] = []
    seen: set[str] = set()
    for name, member in (kv for k in _own_bases(cls) for kv in k.__dict__.items()):
        if name.startswith("_") or name in seen:
            continue
        seen.add(name)
        if isinstance(member, property):
            lines.append(f"- `{name}` (property): {_first_line(member.fget)}".rstrip(": "))
        elif isinstance(member, classmethod | staticmethod):
            fn = member.__func__
            sig = _signature(fn, drop_self=isinstance(member, classmethod))
            lines.append(f"- `{cls.__name__}.{name}{sig}`: {_first_line(fn)}".rstrip(": "))
        elif inspect.isfunction(member):
            sig = _signature(member, drop_self=True)
            lines.append(f"- `{name}{sig}`: {_first_line(member)}".rstrip(": "))
    return lines


def _first_line(fn: object) -> str:
    text = _first_paragraph(fn)
    return text.split(". ")[0].rstrip(".") + "." if text else ""


def _entry(name: str, obj: object) -> list[str]:
    lines = [f"### `{name}`", ""]
    if isinstance(obj, type) and issubclass(obj, enum.Enum):
        names = ", ".join(f"`{m.name}`" for m in obj)
        lines.append(f"An enumeration: {names}.")
    elif isinstance(obj, type):
        bases = [b.__name__ for b in obj.__bases__ if b is not object and b.__name__[0] != "_"]
        init = obj.__dict__.get("__init__") or obj.__dict__.get("__new__")
        sig = _signature(init, drop_self=True) if init is not None else ""
        if sig == "" and hasattr(obj, "__attrs_attrs__"):
            sig = _signature(obj, drop_self=False)
        kind = f" (subclass of {', '.join(f'`{b}`' for b in bases)})" if bases else ""
        lines.append(f"`{name}{sig}`{kind}")
    elif callable(obj):
        lines.append(f"`{name}{_signature(obj, drop_self=False)}`")
    else:
        lines.append(f"A constant: `{name} = {obj!r}`.")
    doc = _first_paragraph(obj)
    if doc:
        lines += ["", doc]
    if isinstance(obj, type) and not issubclass(obj, enum.Enum | BaseException):
        members = _members(obj)
        if members:
            lines += ["", *members]
    return [*lines, ""]


def api_markdown() -> str:
    """docs/api.md: every export of ``kvlifetime``, grouped by the module that defines it."""
    import kvlifetime

    exports: dict[str, str] = kvlifetime._EXPORTS
    by_module: dict[str, list[str]] = {}
    for name, module in exports.items():
        by_module.setdefault(module, []).append(name)
    lines = [_HEADER]
    for module in sorted(by_module):
        lines += [f"## `{module}`", ""]
        mod = __import__(module, fromlist=["_"])
        head = _first_paragraph(mod)
        if head:
            lines += [head, ""]
        for name in sorted(by_module[module], key=str.lower):
            lines += _entry(name, getattr(kvlifetime, name))
    return "\n".join(lines).rstrip("\n") + "\n"
