"""The generated pages of ``docs/`` other than the diagrams: what each piece of evidence
proves and who may prove it, what each engine's statuses prove, and the set of files
``kvlifetime docs`` writes (with the diagrams of ``kvlifetime.diagrams``). Nothing here is
written by hand: each page is drawn from the data it describes (``kvlifetime.evidence``,
``kvlifetime.provenance.RULES``, the engines' ``PROFILE``), and ``tests`` pin the committed
pages byte for byte.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, cast

from kvlifetime.diagrams import MACHINES, dot, pictures, render, svg
from kvlifetime.evidence import BY_NAME, Claim, claims_matrix, proves_text
from kvlifetime.spec.table import table_for

if TYPE_CHECKING:
    from kvlifetime.profiles import EngineProfile


# --------------------------------------------------------------------------- evidence


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def evidence_markdown() -> str:
    """The claims matrix (``evidence.claims_matrix()``) and who may make each claim
    (``provenance.RULES``), as a markdown page."""
    from kvlifetime.provenance import rules_matrix

    claims = [c.value for c in Claim]
    lines = [
        "# Evidence and what it proves",
        "",
        "Generated from `kvlifetime.evidence` by `kvlifetime evidence --format md`. Do not edit.",
        "",
        "Each acknowledgement proves exactly the claims ticked, about the grant (or peer) it "
        "names, and nothing more. A grant is closed only by `access_revoked`, or by "
        "`scheduling_stopped` at `last_seq = N` together with `transfers_ended` through `N`.",
        "",
        "| evidence | about | " + " | ".join(claims) + " | proves | does not prove |",
        "| --- | --- |" + " :---: |" * len(claims) + " --- | --- |",
    ]
    for row in claims_matrix():
        name = str(row["evidence"])
        ticks = cast(Mapping[str, bool], row["claims"])
        cells = ["✓" if ticks[c] else "" for c in claims]
        lines.append(
            f"| `{name}` | {BY_NAME[name].SCOPE} | "
            + " | ".join(cells)
            + f" | {_cell(str(row['proves']))} | {_cell(str(row['does_not_prove']))} |"
        )
    lines += [
        "",
        "## Who may prove what",
        "",
        "Generated from `kvlifetime.provenance.RULES`. Every piece of evidence carries its "
        "source: `local` (this process's own adapters, clock, failure detector and fences) or "
        "`peer:<id>`, the identity of the connection it came in on - never a name written "
        "inside the message. A claim from a source that may not make it is refused "
        "(`UnauthorizedEvidence`), logged, counted, and changes nothing. A peer may only speak "
        "about its own grants, in its own name. Claims marked *on the peer's word* are "
        "believed from the peer when nothing local observes them: provenance stops a peer "
        "from speaking for others, not from lying about its own transfers.",
        "",
        "| claim | local | the grant's own peer | who can know it | never from |",
        "| --- | :---: | :---: | --- | --- |",
    ]
    for r in rules_matrix():
        own = (
            "✓ (on the peer's word)" if r["rests_on_peer_word"] else ("✓" if r["own_peer"] else "")
        )
        lines.append(
            f"| {r['claim']} | {'✓' if r['local'] else ''} | {own} | {_cell(str(r['who']))} "
            f"| {_cell(str(r['never']))} |"
        )
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------- engine profiles


def engine_markdown(profile: EngineProfile) -> str:
    """An engine's evidence profile (``kvlifetime.profiles``) as a markdown page: what every
    status and operation of the engine proves, its fence, and what rests on the peer's word."""
    from kvlifetime.profiles import origin, title

    name = profile.name
    lines = [
        f"# {title(name)} (`{name}`): what each status proves",
        "",
        f"Generated from `{origin(name)}` by `kvlifetime evidence --engine {name} --format md`. "
        "Do not edit.",
        "",
        f"Engine: `{profile.package}` {profile.version}; transport: {profile.transport}.",
    ]
    if profile.source:
        lines += ["", f"Established from: {profile.source}."]
    lines += [
        "",
        "Each row is a raw status or operation of the engine, the kvlifetime evidence it yields "
        "(`nothing`: none, whatever the status is called), the claims that evidence supports "
        "(`kvlifetime evidence`), and the test that pins the row.",
        "",
        "| status or operation | evidence | claims | proves | does not prove | established "
        "| pinned by |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in profile.rows:
        ev = " or ".join(f"`{c.__name__}`" for c in r.evidence_classes) or "nothing"
        claims = ", ".join(c.value for c in Claim if c in r.claims)
        test = f"`{r.test}`" if r.test else "(none yet)"
        # What the row proves in words; else what its evidence proves (kvlifetime.evidence).
        proves = r.proves or " / ".join(proves_text(c) for c in r.evidence_classes) or "nothing"
        lines.append(
            f"| {_cell(r.status)} | {ev} | {claims} | {_cell(proves)} "
            f"| {_cell(r.does_not_prove)} | {r.established} | {test} |"
        )
    fence = f"**`{profile.fence}`**." if profile.fence else "**None.**"
    lines += ["", "## Fence", "", f"{fence} {profile.fence_note}"]
    lines += ["", "## On the peer's word", "", profile.peer_word]
    if profile.notes:
        lines += ["", "## Notes", ""] + [f"- {n}" for n in profile.notes]
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------- engine hooks


def hooks_markdown() -> str:
    """Where the guard sits in each engine it integrates with, and every private detail of the
    engine it relies on: the rows of each engine-facts module (``integrations/*/facts_v*.py``),
    as one page."""
    from kvlifetime.integrations.engine_facts import Fact
    from kvlifetime.integrations.hooks import Hook
    from kvlifetime.integrations.sglang import facts_v0_5_23 as sglang
    from kvlifetime.integrations.vllm import facts_v0_33 as vllm

    def hooks(rows: tuple[Hook, ...]) -> list[str]:
        out = ["| engine class | attribute | when | core event | handler |",
               "| --- | --- | --- | --- | --- |"]  # fmt: skip
        for r in rows:
            where = r.where.replace(":", ".")
            out.append(f"| `{where}` | `{r.name}` | {r.when} | {_cell(r.event)} | `{r.handler}` |")
        return out

    def facts(rows: tuple[Fact, ...]) -> list[str]:
        out = ["| relied on | mirrors |", "| --- | --- |"]
        out += [f"| `{_cell(f.label)}` | {_cell(f.mirrors)} |" for f in rows]
        return out

    lines = [
        "# Where the guard sits in each engine",
        "",
        "Generated from the engine-facts modules (`kvlifetime/integrations/vllm/facts_v0_33.py`, "
        "`kvlifetime/integrations/sglang/facts_v0_5_23.py`) by `kvlifetime docs`. Do not edit.",
        "",
        "Each integration is a table of rows: the engine class and attribute the guard wraps, "
        "when its handler runs around the engine's own code (`before`: it may answer instead; "
        "`after`: it sees the result; `around`: it calls the engine's code itself), the guard-"
        "core event it leads to, and the handler. One generic wrapper "
        "(`kvlifetime.integrations.hooks`) puts every row in place. Every row's target and "
        "every private detail listed below is checked on the installed engine when the guard "
        "is installed; a release where one has moved is refused with "
        "`UnsupportedEngineVersion` naming it, and nothing is wrapped.",
        "",
        f"## vLLM {vllm.VERSION}.x: the connector's methods",
        "",
        "The guarded connector's class derives from the inner connector's; each row's method "
        "is the inner connector's own, wrapped (a row the inner class does not have is not).",
        "",
        *hooks(vllm.HOOKS),
        "",
        f"### Private details of vLLM {vllm.VERSION}",
        "",
        *facts(vllm.FACTS),
        "",
        f'## SGLang {sglang.VERSION}: decode (`install(role="decode")`)',
        "",
        *hooks(sglang.DECODE_HOOKS),
        "",
        f'## SGLang {sglang.VERSION}: prefill (`install(role="prefill")`)',
        "",
        *hooks(sglang.PREFILL_HOOKS),
        "",
        f"### Private details of SGLang {sglang.VERSION}",
        "",
        *facts(sglang.FACTS),
    ]
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------- docs/


def docs_files(*, include_svg: bool) -> dict[str, str]:
    """Every generated document, by file name, in a fixed order (``kvlifetime docs``)."""
    files: dict[str, str] = {}
    for m in MACHINES:
        files[f"{m}.mmd"] = render(m, "mermaid")
        files[f"{m}.md"] = render(m, "md")
        table = table_for(m)
        for pic in pictures(table):  # the review pictures, as the page draws them
            files[f"{pic.name}.dot"] = dot(table, pic)
    files["evidence.md"] = evidence_markdown()
    files["engine-hooks.md"] = hooks_markdown()
    from kvlifetime.profiles import PROFILES

    for name, profile in PROFILES.items():  # engines whose adapter declares a profile
        files[f"engine-{name}.md"] = engine_markdown(profile)
    if include_svg:
        for m in MACHINES:
            table = table_for(m)
            for pic in pictures(table):
                files[f"{pic.name}.svg"] = svg(table, pic)
    return files
