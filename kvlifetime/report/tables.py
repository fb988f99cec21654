"""The page's tables, as HTML: what each piece of evidence proves, who may prove what, each
engine's evidence profile (the harness runs are ``summary``'s).

Every table is built from the same data the command line prints (``kvlifetime evidence``,
``kvlifetime evidence --engine NAME``), so the page and the terminal can never say different
things.
"""

from __future__ import annotations

import html
import re
from collections.abc import Mapping, Sequence

_CODE = re.compile(r"``([^`]+)``|`([^`]+)`")  # the docstrings' ``x`` and markdown's `x`
_BOLD = re.compile(r"\*\*([^*]+)\*\*")
_EM = re.compile(r"(?<![\w*])\*([^*\s](?:[^*]*[^*\s])?)\*(?![\w*])")  # *not*, not a*b*c


def _prose(text: str) -> str:
    return _EM.sub(r"<em>\1</em>", _BOLD.sub(r"<strong>\1</strong>", text))


def inline(text: object) -> str:
    """Escape ``text`` for HTML, keeping the markdown the data uses: `code`, **bold** and
    *emphasis* (outside code only)."""
    out = html.escape(str(text), quote=False)
    parts, last = [], 0
    for m in _CODE.finditer(out):
        parts.append(_prose(out[last : m.start()]))
        parts.append(f"<code>{m.group(1) or m.group(2)}</code>")
        last = m.end()
    parts.append(_prose(out[last:]))
    return "".join(parts)


def table(
    head: Sequence[str],
    rows: Sequence[Sequence[str]],
    *,
    cls: str = "",
    centre: Sequence[int] = (),
) -> str:
    """An HTML table whose cells are already HTML (``inline`` them first)."""
    c = f' class="{cls}"' if cls else ""
    centred = set(centre)
    th = "".join(
        f"<th{' class=c' if i in centred else ''}>{html.escape(h)}</th>" for i, h in enumerate(head)
    )
    body = "".join(
        "<tr>"
        + "".join(f"<td{' class=c' if i in centred else ''}>{v}</td>" for i, v in enumerate(r))
        + "</tr>"
        for r in rows
    )
    return f"<table{c}><thead><tr>{th}</tr></thead><tbody>{body}</tbody></table>"


def evidence_table() -> str:
    """Each acknowledgement class: the claims it proves, and what it does not prove."""
    from kvlifetime.evidence import BY_NAME, Claim, claims_matrix

    claims = [c.value for c in Claim]
    rows = []
    for row in claims_matrix():
        name = str(row["evidence"])
        ticks: Mapping[str, bool] = row["claims"]  # type: ignore[assignment]
        rows.append(
            [
                f"<code>{html.escape(name)}</code>",
                inline(BY_NAME[name].SCOPE),
                *('<span class="tick">✓</span>' if ticks[c] else "" for c in claims),
                inline(row["proves"]),
                inline(row["does_not_prove"]),
            ]
        )
    head = ["evidence", "about", *(c.replace("_", " ") for c in claims), "proves", "does not prove"]
    return table(head, rows, cls="matrix", centre=range(2, 2 + len(claims)))


def provenance_table() -> str:
    """Who may make each claim (``provenance.RULES``)."""
    from kvlifetime.provenance import rules_matrix

    rows = []
    for r in rules_matrix():
        own = (
            "✓ (on the peer's word)" if r["rests_on_peer_word"] else ("✓" if r["own_peer"] else "")
        )
        rows.append(
            [
                f"<code>{html.escape(str(r['claim']))}</code>",
                "✓" if r["local"] else "",
                inline(own),
                inline(r["who"]),
                inline(r["never"]),
            ]
        )
    head = ["claim", "local", "the grant's own peer", "who can know it", "never from"]
    return table(head, rows, cls="matrix", centre=(1, 2))


def _evidence_names(text: object) -> str:
    """``"A or B"`` as code names; a status that yields no evidence says so in words."""
    names = [e for e in str(text or "").split(" or ") if e and e != "nothing"]
    return " or ".join(f"`{e}`" for e in names) or "nothing"


def engine_profiles() -> list[tuple[str, str, str]]:
    """(name, title, HTML) for every engine with an evidence profile, in registry order."""
    from kvlifetime.profiles import PROFILES, title

    out = []
    for name, profile in PROFILES.items():
        d = profile.to_dict()
        rows = [
            [
                inline(r.get("status", "")),
                inline(_evidence_names(r.get("evidence"))),
                inline(", ".join(r.get("claims", []))),
                inline(r.get("proves") or ""),
                inline(r.get("does_not_prove") or ""),
                inline(r.get("established") or ""),
            ]
            for r in d.get("rows", [])
        ]
        fence = d.get("fence")
        parts = [
            f"<p>Engine: <code>{html.escape(str(d.get('package')))}</code> "
            f"{html.escape(str(d.get('version')))}; transport: {inline(d.get('transport'))}.</p>",
            table(
                [
                    "status or operation",
                    "evidence",
                    "claims",
                    "proves",
                    "does not prove",
                    "established",
                ],
                rows,
                cls="profile",
            ),
            "<p><strong>Fence:</strong> "
            + (f"<code>{html.escape(str(fence))}</code>. " if fence else "<strong>none</strong>. ")
            + f"{inline(d.get('fence_note', ''))}</p>",
            f"<p><strong>On the peer's word:</strong> {inline(d.get('peer_word', ''))}</p>",
        ]
        out.append((name, title(name), "".join(parts)))
    return out
