"""A Promela model for SPIN, generated from the specification: ``kvlifetime promela``.

What of the model is in ``kvlifetime.spec`` is *emitted from it*, never restated:

- the **request states** (``RS_<state>``) and the **transitions**: every row of the request
  table (``spec.table.request_table``) becomes an option of ``fire_<event>(r)`` (the call-driven
  events: ``rejected``, ``finished``, ``released``, ``force_released``) or of ``advance(r)``
  (the evidence-driven ones, tried in ``PROOF_CHAIN`` order as ``ledger.transitions.advance``
  tries them, as long as one fires); a call with no row, or whose guards all fail, is the
  ledger refusing it (``assert(ledger_error)``);
- the **guards**: each request guard of ``spec.vocabulary.RequestGuards`` is read by running
  it. It must be "every open grant's proof has property X" or "some open grant's proof has
  property X" (a guard is probed on no open grant, which says which, then on every single
  proof, which gives X, then on every pair of proofs, which checks the quantifier); X becomes
  one bit of ``pfact[proof]``. A guard of another form is refused (``PromelaError``), never
  approximated;
- the **grant proof**: what evidence does to what has been proven about a grant is
  ``spec.proof.GrantProof`` run on every packed proof and every evidence value the model can
  send (``CancelReceived``, ``SchedulingStopped(v)``, ``TransferQuiesced(v)``,
  ``TransferCompleted(v)``, ``AccessRevoked``, ``LeaseExpired`` / ``PeerLost``): the table
  ``pfnext[proof * NEV + evidence]`` (``CONTRA`` where ``GrantProof.check`` refuses), and
  ``GrantProof.closed`` is bit 0 of ``pfact``. Both tables are ``hidden`` (not in the state
  vector: constants, set by the first step).

The environment around the ledger (requests, peers, the faulty control channel, the engine's
release policies, the assertions) is ``kvlifetime.verify.promela_env``: what
``kvlifetime verify`` builds around the ledger, as the hand-written anchor had it.

The model is for one configuration: ``generate(config, policy)`` returns its whole text, with
the sizes, budgets, fault kinds and policy as ``#define`` lines and every enumeration over the
requests, peers and grants unrolled. ``project=True`` adds a ``printf`` of the whole state after
every step (and of the initial one): with ``pan`` built with ``-DPRINTF`` it lists every state
it stores, which ``tests/test_promela.py`` compares with ``kvlifetime verify``'s own states.
"""

from __future__ import annotations

from typing import Any

from kvlifetime.evidence import (
    Evidence,
)
from kvlifetime.spec.table import TransitionTable, request_table
from kvlifetime.spec.vocabulary import PROOF_CHAIN, RequestState
from kvlifetime.verify.promela_env import ADMIT, ENVIRONMENT
from kvlifetime.verify.spec_codes import (
    CALLS,
    CONTRA,
    NotExpressible,
    ProofCoding,
    evidence_codes,
    guard_shapes,
    proof_tables,
)
from kvlifetime.verify.state import Config, Fault, Policy

__all__ = [
    "MODEL_POLICIES",
    "PromelaError",
    "ProofCoding",
    "check_expressible",
    "defines",
    "generate",
    "guard_shapes",
]


class PromelaError(NotExpressible):
    """The model cannot state what was asked: a configuration beyond its sizes, a fault kind or
    a policy it lacks, or a specification it cannot read (a guard of another form,
    ``spec_codes.NotExpressible``). The caller's fault (or the specification's); nothing was
    written."""


# The policies the model has, by their code in the Promela text (NAIVE ... TRUSTING there).
MODEL_POLICIES: dict[Policy, int] = {
    Policy.NAIVE: 0,
    Policy.TIMEOUT: 1,
    Policy.PROOF: 2,
    Policy.TRUSTING: 3,
}
# Each fault kind's switch in the Promela text.
FAULT_FLAGS: dict[Fault, str] = {
    Fault.REORDER: "F_REORDER",
    Fault.DUPLICATE: "F_DUP",
    Fault.DELAY: "F_DELAY",
    Fault.LOSS: "F_LOSS",
    Fault.CRASH: "F_CRASH",
    Fault.FENCE: "F_FENCE",
    Fault.TIMEOUT: "F_TIMEOUT",
    Fault.RETRY: "F_RETRY",
    Fault.FAIL: "F_FAIL",
    Fault.LIE: "F_LIE",
}
MAX_REQUESTS, MAX_PEERS, MAX_TRANSFERS, MAX_RETRIES = 4, 3, 2, 3
QL = 5  # messages on one grant's channel to the ledger, at most (promela_env)
QC = 2  # cancels on one grant's channel to the peer, at most

# ------------------------------------------------------------------ the text


def _spec_section(table: TransitionTable, config: Config) -> tuple[str, str, str]:
    """The specification's part of the model: its declarations, its inlines (the request
    transitions), and the statements that fill its tables (the model's first step)."""
    coding = ProofCoding(config.transfers_per_grant)
    nxt, proofs = proof_tables(coding)
    used = sorted({r.guard for r in table.rows if r.guard is not None})
    shapes = guard_shapes({g: table.guards[g] for g in used}, coding)
    if len(shapes) > 7:
        raise PromelaError("more than 7 request guards: pfa is one byte")
    codes = evidence_codes(coding.t)
    out = ["/* ------------------------------------------------ from kvlifetime.spec (generated)"]
    out.append("")
    out.append(
        "   The request lifecycle's states (spec.vocabulary.RequestState, the table's order);"
    )
    out.append("   0: not admitted. */")
    out.append("#define RS_NONE 0")
    for i, s in enumerate(table.states):
        out.append(f"#define RS_{s} {i + 1}")
    out.append(f"#define RS_INITIAL RS_{table.initial}")
    out.append("")
    out.append("/* The evidence the model sends, as codes. */")
    for e, (name, evs) in enumerate(codes):
        kinds = " / ".join(type(ev).__name__ for ev in evs)
        out.append(f"#define EV_{name} {e}  /* {kinds} */")
    out.append("#define EV_SS EV_SS0")
    out.append("#define EV_TQ EV_TQ0")
    out.append("#define EV_TC EV_TC0")
    out.append(f"#define CONTRA {CONTRA}")
    out.append("")
    out.append(f"#define NEV {len(codes)}")
    out.append(f"#define NPF {coding.size}")
    out.append("")
    out.append(
        "/* spec.proof.GrantProof.check / record run on every packed proof and evidence code:"
    )
    out.append(
        "   pfnext, the proof it becomes (CONTRA: refused); pfact, what it satisfies (bit 0:"
    )
    out.append(
        "   GrantProof.closed; bit k: guard k's property). Hidden: constants, not in the state"
    )
    out.append("   vector, set by the model's first step. */")
    out.append("hidden byte pfnext[NPF * NEV];")
    out.append("hidden byte pfact[NPF];")
    out.append("#define CLOSED(g) ((pfact[pf[g]] & 1) != 0)")
    out.append("#define GP(g, k) (((pfact[pf[g]] >> (k)) & 1) != 0)")
    out.append("#define PFNEXT(g, e) pfnext[pf[g] * NEV + (e)]")
    out.append("#define CHANGES(g, e) (PFNEXT(g, e) != pf[g] && PFNEXT(g, e) != CONTRA)")
    out.append("")
    out.append("/* The request guards (spec.vocabulary.RequestGuards), read by running them. */")
    for k, sh in enumerate(shapes, start=1):
        neg = "!" if sh.every else ""
        terms = " || ".join(
            f"(OPEN((r) * P + {j}) && {neg}GP((r) * P + {j}, {k}))" for j in range(config.peers)
        )
        expr = f"(!({terms}))" if sh.every else f"({terms})"
        quant = "every" if sh.every else "some"
        out.append(f"/* {sh.name}: {quant} open grant's proof has its property */")
        out.append(f"#define G_{sh.name}(r) {expr}")
    inl = ["/* n_ := what grant g's proof becomes with evidence e; pf[g] := n_ */"]
    inl.append("inline pf_next(g, e) { n_ = PFNEXT(g, e) }")
    inl.append("inline pf_set(g) { pf[g] = n_ }")
    init = [f"    pfnext[{pc * len(codes) + e}] = {v}" for (pc, e), v in sorted(nxt.items())]
    for pc, pr in sorted(proofs.items()):
        bits = int(pr.closed)
        if not pr.closed:
            for k, sh in enumerate(shapes, start=1):
                bits |= int(pc in sh.holds) << k
        init.append(f"    pfact[{pc}] = {bits}")
    inlines = "\n".join(inl) + "\n\n" + _fire_inlines(table) + "\n\n" + _advance_inline(table)
    return "\n".join(out), inlines, ";\n".join(init)


def lie_evidence(t: int, peers: int) -> list[str]:
    """The evidence codes a lying peer sends: about its own grant, AccessRevoked and
    LeaseExpired; about another peer's (only with two peers or more), each acknowledgement,
    claiming the most transfers a peer may post."""
    own = ["AR", "SUSPECT"]
    return own + (["CR", f"SS{t}", f"TQ{t}", f"TC{t}"] if peers > 1 else [])


def _option(table: TransitionTable, row: Any) -> str:
    guard = f" && G_{row.guard}(r)" if row.guard is not None else ""
    return f"  :: rs[r] == RS_{row.source}{guard} -> rs[r] = RS_{row.target}"


def _fire_inlines(table: TransitionTable) -> str:
    out = ["/* The call-driven transitions: the table's rows of each event (the first whose"]
    out.append("   guard holds wins); no row, or no guard holding, is the ledger refusing. */")
    for ev in CALLS:
        rows = [r for r in table.rows if r.event == ev]
        out.append(f"inline fire_{ev}(r) {{")
        out.append("  if")
        out += [_option(table, r) for r in rows]
        out.append("  :: else -> assert(ledger_error)")
        out.append("  fi")
        out.append("}")
    return "\n".join(out)


def _advance_inline(table: TransitionTable) -> str:
    out = ["/* The evidence-driven transitions, in PROOF_CHAIN order, as long as one fires. */"]
    out.append("inline advance(r) {")
    out.append("  do")
    for state in table.states:
        for ev in PROOF_CHAIN:
            out += [_option(table, r) for r in table.rows_for(state, ev.value)]
    out.append("  :: else -> break")
    out.append("  od")
    out.append("}")
    return "\n".join(out)


def check_expressible(config: Config, policy: Policy) -> None:
    """Raise ``PromelaError`` for what the model cannot state."""
    if policy not in MODEL_POLICIES:
        known = ", ".join(p.value for p in MODEL_POLICIES)
        raise PromelaError(f"the Promela model has no policy {policy.value!r} (it has {known})")
    if config.blocks_per_request != 1:
        raise PromelaError("the Promela model gives every request one block")
    if not (
        config.requests <= MAX_REQUESTS
        and config.peers <= MAX_PEERS
        and 1 <= config.transfers_per_grant <= MAX_TRANSFERS
        and config.max_retries <= MAX_RETRIES
    ):
        raise PromelaError(
            f"the Promela model has at most {MAX_REQUESTS} requests, {MAX_PEERS} peers, "
            f"{MAX_TRANSFERS} transfers per grant and {MAX_RETRIES} retries"
        )
    extras = {
        "ranks": config.ranks != 1,
        "restarts": config.restarts != 0,
        "share": config.share,
        "reuse_ids": config.reuse_ids,
        "access": config.access.value != "write",
    }
    lacking = sorted(k for k, v in extras.items() if v)
    if lacking:
        raise PromelaError(f"the Promela model has no {', '.join(lacking)}")


def defines(config: Config, policy: Policy) -> dict[str, int]:
    """The configuration as the model's ``#define`` values."""
    flags = {
        "R": config.requests,
        "P": config.peers,
        "B": config.blocks,
        "T": config.transfers_per_grant,
        "POLICY": MODEL_POLICIES[policy],
        "MAXF": -1 if config.max_faults is None else config.max_faults,
        "MAXDUP": config.max_duplicates,
        "MAXDELAY": config.max_delays,
        "MAXLOSS": config.max_losses,
        "MAXCRASH": config.max_crashes,
        "MAXRETRY": config.max_retries,
    }
    for fault, name in FAULT_FLAGS.items():
        flags[name] = int(fault in config.faults)
    return flags


def _loop(config: Config, policy: Policy, codes: list[tuple[str, list[Evidence]]]) -> str:
    r_, p_, t = config.requests, config.peers, config.transfers_per_grant
    reorder = Fault.REORDER in config.faults
    lies = Fault.LIE in config.faults and policy is Policy.TRUSTING
    lines = [ADMIT]
    for r in range(r_):
        lines += [f"  GRANT_TO({r}, {p})" for p in range(p_)]
        lines.append(f"  REQ_OPTS({r})")
    # A lie about its own grant: AccessRevoked, LeaseExpired; about another peer's (only with
    # two peers): each acknowledgement, claiming the most transfers a peer may post.
    for g in range(r_ * p_):
        lines += [f"  SEQ_OPTS({g}, {s})" for s in range(t)]
        lines += [f"  LQ_OPTS({g}, {i})" for i in range(QL if reorder else 1)]
        lines += [f"  CQ_OPTS({g}, {i})" for i in range(QC if reorder else 1)]
        lines.append(f"  GRANT_OPTS({g})")
        if lies:
            lines += [f"  LIE_G({g}, EV_{e})" for e in lie_evidence(t, p_)]
    for p in range(p_):
        lines.append(f"  PEER_OPTS({p})")
        if lies:
            lines.append(f"  LIE_P({p})")
    lines.append("  :: else -> break")
    return "\n".join(lines)


def _print_state(config: Config) -> str:
    """``print_state()``: every variable of the state (and each grant's staleness), one line."""
    r_, p_ = config.requests, config.peers
    g_ = r_ * p_
    items: list[str] = ["admitted"]
    items += [f"phase[{r}]" for r in range(r_)]
    items += [f"rs[{r}]" for r in range(r_)]
    items += [f"(gen[blk[{g // p_}]] != ggen[{g}])" for g in range(g_)]
    for arr, n in (("gf", g_), ("tf", g_), ("pf", g_), ("lqn", g_), ("cqn", g_), ("peerf", p_)):
        items += [f"{arr}[{i}]" for i in range(n)]
    items += [f"lq[{i}]" for i in range(g_ * QL)]
    items += [f"cq[{i}]" for i in range(g_ * QC)]
    items += ["dups_left", "delays_left", "losses_left", "crashes_left", "faults_left"]
    fmt = "KVSTATE" + " %d" * len(items) + "\\n"
    return f'inline print_state() {{\n  printf("{fmt}",\n    ' + ",\n    ".join(items) + ")\n}"


def generate(
    config: Config,
    policy: Policy,
    *,
    project: bool = False,
    table: TransitionTable | None = None,
) -> str:
    """The Promela model of ``config`` under ``policy``, generated from the specification.

    ``table``: the request table to generate from (default: the specification's,
    ``spec.table.request_table()``; the drift test passes a modified one).

    Raises ``PromelaError`` for what the model cannot express (``check_expressible``)."""
    check_expressible(config, policy)
    table = request_table() if table is None else table
    for s in (RequestState.TRANSFER_QUIESCED, RequestState.QUARANTINED, RequestState.RELEASED):
        if s.value not in table.states:
            raise PromelaError(f"the request table has no state {s.value!r}")
    spec, inlines, init = _spec_section(table, config)
    codes = evidence_codes(config.transfers_per_grant)
    r_, p_ = config.requests, config.peers
    head = [
        "/*",
        " * kvlifetime's block-lifetime protocol as a Promela model for SPIN, GENERATED by",
        " * `kvlifetime promela` (kvlifetime.verify.promela) from the specification",
        " * (kvlifetime.spec): do not edit. The request lifecycle's rows and guards and the grant",
        " * proof's rules are emitted from it; the environment is kvlifetime.verify.promela_env.",
        f" * Configuration: {r_} requests x {p_} peers x {config.blocks} blocks, "
        f"{config.transfers_per_grant} transfer(s) per grant, policy {policy.value}.",
        " */",
        "",
    ]
    head += [f"#define {k} {v}" for k, v in defines(config, policy).items()]
    step_end = "; print_state()" if project else ""
    subs = {
        "SPEC": spec,
        "SPEC_INLINES": inlines,
        "ON_CONTRA": "skip  /* refused: a no-op */"
        if policy is Policy.TRUSTING
        else "assert(ledger_error)  /* honest evidence contradicts */",
        "ANY_PROMPT_OF_R": " || ".join(f"PROMPT((r) * P + {j})" for j in range(p_)),
        "ANY_GACT_OF_R": "(" + " || ".join(f"GACT((r) * P + {j})" for j in range(p_)) + ")",
        "ANY_PEER_EV": " || ".join(f"PEER_EV({p})" for p in range(p_)),
        "ANY_OPEN_OF_P": " || ".join(f"OPEN({r} * P + (p))" for r in range(r_)),
        "ANY_UNSUSPECT_OF_P": " || ".join(
            f"LIE_CHANGES({r} * P + (p), EV_SUSPECT)" for r in range(r_)
        ),
        "PRINT_STATE": _print_state(config) if project else "",
        "FIRST": "  d_step {\n" + init + (";\n    print_state()" if project else "") + "\n  };",
        "LOOP": _loop(config, policy, codes),
    }
    text = "\n".join(head) + "\n" + ENVIRONMENT
    for k, v in subs.items():
        text = text.replace(f"@@{k}@@", v)
    text = text.replace("@@STEP_END@@", step_end)
    if "@@" in text:
        raise PromelaError("a placeholder of the environment was not filled")
    return text
