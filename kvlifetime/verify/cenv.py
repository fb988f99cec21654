"""The compiled checker's model, generated as C: the specification (``cspec``) and the
environment around the ledger, for one configuration.

The environment (``cenv.c`` beside this module) is the one the Promela model states
(``promela_env``): the same state variables, the same events with the same enabling rules and
fault budgets, the same release policies (``naive``, ``timeout``, ``proof``, ``trusting``) and
the same assertions, as C over a fixed-width state (``st_t``: one byte per variable, the
budget of faults signed). One event is one successor; ``csearch.c`` searches them breadth
first. The request rows, the guards and the grant proof are ``cspec``'s, emitted from the
specification. Beside it:

- ``cstate.c``, the stored state: packed (``packing``: each field in the bits its range
  needs), and in canonical form (``kvlifetime verify``'s canonical key as a state: the least
  state over every renaming of the peers, the admitted requests sorted, what is never read
  again forgotten);
- ``cpor.c``, the partial-order reduction: ``por.stubborn``'s sets, chosen on the canonical
  state expanded (``por=True``; only the first ``max_crashes`` peers then crash).

This module puts the configuration and the specification before them, encodes a Python state
as a C state (``encode``; ``canonical`` gives it as the search stores it), reads stored
states back (``unpack``, ``decode``) and maps counterexamples onto the Python model's events
(``python_events``).

Invariants, as violation codes: ``ISOLATION`` (a write lands on a block released since its
grant, its peer not fenced), ``EXCLUSIVITY`` (a block handed to two requests), ``NO_LEAK`` (a
quiet state where a block is held by a request that is neither released nor quarantined),
``LEDGER_ERROR`` (the ledger refuses a call or honest evidence).

What it covers: the shapes and policies the Promela model covers
(``promela.check_expressible``: one block per request, write grants, no ranks, restarts,
sharing or reused ids; every fault kind). ``tests/test_cenv.py`` holds its canonical states to
``kvlifetime verify``'s canonical keys, and its concrete ones to the unreduced Python model,
state by state; and its partial-order reduction to the same quiet states and verdicts.
"""

from __future__ import annotations

import ctypes
from importlib import resources
from typing import Any

from kvlifetime.errors import SpecDisagreement
from kvlifetime.spec.proof import GrantProof
from kvlifetime.spec.table import request_table
from kvlifetime.verify import csearch
from kvlifetime.verify.cspec import emit
from kvlifetime.verify.events import enabled
from kvlifetime.verify.lies import lie_events
from kvlifetime.verify.projection import of_state, of_vector
from kvlifetime.verify.promela import (
    MODEL_POLICIES,
    QC,
    QL,
    PromelaError,
    check_expressible,
    lie_evidence,
)
from kvlifetime.verify.promela import defines as promela_defines
from kvlifetime.verify.semantics import run_events, step
from kvlifetime.verify.spec_codes import ProofCoding, evidence_codes
from kvlifetime.verify.state import (
    FAILED,
    FINISHED,
    IN_FLIGHT,
    LANDED,
    LANDED_UNSEEN,
    LIVE,
    REJECTED,
    RELEASED,
    TO_LEDGER,
    TO_PEER,
    Broken,
    Config,
    Event,
    Msg,
    Policy,
    State,
    Violation,
    initial,
)

ISOLATION, EXCLUSIVITY, NO_LEAK, LEDGER_ERROR, MODEL_BOUND = 1, 2, 3, 4, 9
INVARIANTS = {
    ISOLATION: "isolation",
    EXCLUSIVITY: "exclusivity",
    NO_LEAK: "no_leak",
    LEDGER_ERROR: "ledger_error",
    MODEL_BOUND: "model_bound",
}
"""Violation codes -> the invariant's name (as ``kvlifetime verify`` names them)."""


def _revoked() -> GrantProof:
    p = GrantProof()
    p.revoked = True
    return p


PF_CLOSED = {t: ProofCoding(t).encode(_revoked()) for t in (1, 2)}
"""Per transfers a grant, the one closed proof a canonical state keeps for every closed grant:
revoked, and nothing else (no evidence contradicts it)."""
_PHASES = ("unadmitted", LIVE, FINISHED, REJECTED, RELEASED)
_RELEASED = _PHASES.index(RELEASED)
_TRANSFERS = {IN_FLIGHT: 1, FAILED: 2, LANDED: 3, LANDED_UNSEEN: 4}
_KIND_CODES = {"CancelReceived": 1, "SchedulingStopped": 2, "TransferQuiesced": 3}
_KIND_CODES["TransferCompleted"] = 4


def environment() -> str:
    """The environment's C text, with the stored state's and the partial-order reduction's
    (``cenv.c``, ``cstate.c``, ``cpor.c`` beside this module): the configuration's
    ``#define`` lines and ``cspec``'s text come first (``model``)."""
    here = resources.files("kvlifetime.verify")
    return "\n".join(here.joinpath(f).read_text() for f in ("cenv.c", "cstate.c", "cpor.c"))


def model(config: Config, policy: Policy, *, reduce: bool = True, por: bool = False) -> str:
    """The model's C text for ``config`` under ``policy``: the configuration, the
    specification (``cspec``), the environment. ``reduce``: successors in canonical form
    (``kvlifetime verify``'s canonical key, as a state; else every concrete state). Raises
    ``PromelaError`` for a configuration or policy it cannot state (the Promela model's reach:
    ``promela.check_expressible``)."""
    check_modelled(config, policy)
    t, p_ = config.transfers_per_grant, config.peers
    names = [name for name, _ in evidence_codes(t)]
    lies = [names.index(e) for e in lie_evidence(t, p_)]
    defines = {
        **promela_defines(config, Policy.PROOF),  # the sizes, budgets and fault switches
        "QL": QL,
        "QC": QC,
        "ISOLATION": ISOLATION,
        "EXCLUSIVITY": EXCLUSIVITY,
        "NO_LEAK": NO_LEAK,
        "LEDGER_ERROR": LEDGER_ERROR,
        "MODEL_BOUND": MODEL_BOUND,
        "POLICY": POLICIES[policy],
        "KVL_CANON": int(reduce),
        "KVL_POR": int(por),
        "STRICT": int(policy is Policy.TIMEOUT),
        "PF_CLOSED": PF_CLOSED[t],
    }
    head = [
        "/* kvlifetime verify's model as C, GENERATED by kvlifetime.verify.cenv: do not edit */",
        "#include <string.h>",
        "static void kvl_emit(void *ctx, int event, const unsigned char *next);",
        "static void kvl_fail(void *ctx, int event, int code);",
    ]
    head += [f"#define {k} {v}" for k, v in defines.items()]
    fields = packing(config, reduce=reduce, counted=policy is Policy.COUNTED_COMPLETIONS)
    bits = sum(n for _, n, _ in fields)
    head.append(f"#define KVL_W {max(1, (bits + 7) // 8)}")
    head.append(f"#define NPK {len(fields)}")
    for name, col in (("PK_OFF", 0), ("PK_BITS", 1), ("PK_KIND", 2)):
        kind = "unsigned short" if col == 0 else "unsigned char"
        values = ", ".join(str(f[col]) for f in fields)
        head.append(f"static const {kind} {name}[{len(fields)}] = {{{values}}};")
    head.append(f"#define NLIE_G {len(lies)}")
    head.append(
        "static const int LIE_G["
        + str(max(1, len(lies)))
        + "] = {"
        + ", ".join(str(x) for x in lies or [0])
        + "};"
    )
    return "\n".join(head) + "\n" + emit(transfers=t) + environment()


POLICIES: dict[Policy, int] = {
    **MODEL_POLICIES,
    Policy.FIRST_FAILURE: 4,
    Policy.COUNTED_COMPLETIONS: 5,
    Policy.SGLANG_0_5_23: 6,
}
"""The release policies the C models, with their codes (``POLICY``): the Promela model's, and
three of the field's (``first-failure``, ``counted-completions``; ``sglang-0.5.23`` with write
grants, the only ones the C models)."""


def check_modelled(config: Config, policy: Policy) -> None:
    """Raise ``PromelaError`` for a configuration or policy the C does not model: a policy not
    in ``POLICIES``, or a shape the Promela model cannot state (``check_expressible``)."""
    if policy not in POLICIES:
        known = ", ".join(p.value for p in POLICIES)
        raise PromelaError(f"the compiled checker has no policy {policy.value!r} (it has {known})")
    check_expressible(config, Policy.PROOF)


def _layout(config: Config) -> list[tuple[str, int]]:
    """``st_t``'s fields in order, with their lengths (one byte each element)."""
    r_, p_ = config.requests, config.peers
    g_ = r_ * p_
    return [
        ("admitted", 1), ("nheld", 1), ("phase", r_), ("rs", r_), ("blk", r_), ("comp", r_),
        *((name, g_) for name in ("gf", "tf", "pf", "lqn", "cqn", "nprompt")),
        ("lq", g_ * QL), ("cq", g_ * QC), ("peerf", p_),
        *((name, 1) for name in ("dups", "delays", "losses", "crashes", "faults")),
    ]  # fmt: skip


def packing(
    config: Config, *, reduce: bool = True, counted: bool = False
) -> list[tuple[int, int, int]]:
    """How a state is stored: per ``st_t`` byte kept, (its offset, its bits, how it is coded:
    0 as it is, 1 a message to the ledger renumbered densely, 2 a cancel, 3 the signed fault
    budget plus one). Left out, as following from the rest: nheld, the queues' lengths, the
    prompt counts and, in canonical form, the blocks; the completion notices counted but under
    ``counted-completions`` (``counted``)."""
    t = config.transfers_per_grant
    msgs = 4 * (t + 1) * 4  # kinds x values x (not dupable, delayed)
    budget = -1 if config.max_faults is None else config.max_faults
    bits = {
        "admitted": (config.requests.bit_length(), 0),
        "phase": (3, 0),
        "rs": ((len(request_table().states)).bit_length(), 0),
        "blk": (max(1, (config.blocks - 1).bit_length()), 0),
        "comp": (4, 0),
        "gf": (6 + config.max_retries.bit_length(), 0),
        "tf": (3 * t, 0),
        "pf": ((ProofCoding(t).size - 1).bit_length(), 0),
        "lq": (msgs.bit_length(), 1),
        "cq": (3, 2),
        "peerf": (4, 0),
        "dups": (max(1, config.max_duplicates.bit_length()), 0),
        "delays": (max(1, config.max_delays.bit_length()), 0),
        "losses": (max(1, config.max_losses.bit_length()), 0),
        "crashes": (max(1, config.max_crashes.bit_length()), 0),
        "faults": (max(1, (budget + 1).bit_length()), 3),
    }
    skip = {"nheld", "lqn", "cqn", "nprompt", *(("blk",) if reduce else ())}
    skip |= set() if counted else {"comp"}
    out: list[tuple[int, int, int]] = []
    offset = 0
    for name, n in _layout(config):
        if name not in skip:
            nbits, kind = bits[name]
            out += [(offset + i, nbits, kind) for i in range(n)]
        offset += n
    return out


def width(config: Config) -> int:
    """Bytes of one C state (``st_t``) for ``config``."""
    return sum(n for _, n in _layout(config))


def _fields(state: bytes, config: Config) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    k = 0
    for name, n in _layout(config):
        out[name] = list(state[k : k + n])
        k += n
    return out


def decode(state: bytes, config: Config) -> list[int]:
    """A C state (``st_t``) as the integers the Promela model's ``print_state`` prints, in its
    order (``projection.of_vector`` reads them)."""
    f = _fields(state, config)
    p_ = config.peers
    faults = f["faults"][0]
    faults = faults - 256 if faults > 127 else faults  # (signed char)
    # A grant is stale once its request is released (the request's block is then free).
    stale = [int(f["phase"][g // p_] == _RELEASED) for g in range(len(f["gf"]))]
    values = [f["admitted"][0], *f["phase"], *f["rs"], *stale]
    for name in ("gf", "tf", "pf", "lqn", "cqn", "peerf", "lq", "cq"):
        values += f[name]
    return [*values, *(f[n][0] for n in ("dups", "delays", "losses", "crashes")), faults]


def encode(state: State, config: Config) -> bytes:
    """A state of ``kvlifetime verify``'s model as a C state (``st_t``), concrete (its
    requests, peers and blocks named as they are): ``kvl_canon`` gives its canonical form."""
    env, snap = state.env, state.snap
    p_ = config.peers
    t = config.transfers_per_grant
    coding = ProofCoding(t)
    f = {name: [0] * n for name, n in _layout(config)}
    f["admitted"][0] = env.admitted
    rows = list(request_table().states)
    held = 0
    for r, q in enumerate(env.reqs):
        f["phase"][r] = _PHASES.index(q.phase)
        f["rs"][r] = rows.index("released" if q.phase == RELEASED else snap.state(q.key)) + 1
        f["comp"][r] = q.completions
        if q.phase != RELEASED:
            f["blk"][r] = held
            held += 1
    f["nheld"][0] = held
    for gi, g in enumerate(env.grants):
        k = g.req * p_ + g.peer
        f["gf"][k] = (
            1
            | g.cancelled << 1
            | g.stopped << 2
            | g.quiesced_sent << 3
            | g.lease_fired << 4
            | g.silent << 5
            | g.retries << 6
        )
        f["tf"][k] = sum(_TRANSFERS[st] << (3 * i) for i, st in enumerate(g.transfers))
        if env.reqs[g.req].phase != RELEASED:
            cr, last, through, revoked, suspect, _closed = snap.proof(g.grant)
            p = GrantProof()
            p.cancel_received, p.last_seq, p.through_seq = cr, None if last == -1 else last, through
            p.revoked, p.suspect = revoked, "lease_expired" if suspect else None
            f["pf"][k] = coding.encode(p)
        lq = [m for m in env.msgs if m.grant == gi and m.dest == TO_LEDGER]
        cq = [m for m in env.msgs if m.grant == gi and m.dest == TO_PEER]
        f["lqn"][k], f["cqn"][k] = len(lq), len(cq)
        f["nprompt"][k] = sum(not m.delayed for m in (*lq, *cq))
        for i, m in enumerate(lq):
            f["lq"][k * QL + i] = _msg(_KIND_CODES[m.kind], m.value, m)
        for i, m in enumerate(cq):
            f["cq"][k * QC + i] = _msg(5, 0, m)
    for p_i, ps in enumerate(env.peers):
        f["peerf"][p_i] = ps.crashed | ps.fenced << 1 | ps.lost_reported << 2 | ps.crashable << 3
    f["dups"][0], f["delays"][0] = env.dups_left, env.delays_left
    f["losses"][0], f["crashes"][0] = env.losses_left, env.crashes_left
    f["faults"][0] = env.faults_left & 0xFF
    return bytes(v for name, _ in _layout(config) for v in f[name])


def _msg(kind: int, value: int, m: Msg) -> int:
    return kind | value << 3 | (not m.dupable) << 5 | m.delayed << 6


def canonical(lib: Any, state: bytes) -> bytes:
    """``state`` (a C state, ``encode``'s) as the loaded checker ``lib`` stores it: in
    canonical form (a reduced checker), packed (``kvl_store_form``)."""
    out = ctypes.create_string_buffer(int(lib.kvl_width()))
    lib.kvl_store_form.argtypes = [ctypes.c_char_p, ctypes.c_char_p]
    lib.kvl_store_form.restype = None
    lib.kvl_store_form(state, out)
    return out.raw


def unpack(lib: Any, stored: bytes) -> bytes:
    """A state as the loaded checker ``lib`` stores it, back as a C state (``st_t``:
    ``decode`` reads it)."""
    out = ctypes.create_string_buffer(int(lib.kvl_st_width()))
    lib.kvl_unpack.argtypes = [ctypes.c_char_p, ctypes.c_char_p]
    lib.kvl_unpack.restype = None
    lib.kvl_unpack(stored, out)
    return out.raw


def python_events(
    config: Config,
    policy: Policy,
    lib: Any,
    result: csearch.CSearchResult,
    *,
    reduce: bool = True,
    por: bool = False,
) -> tuple[list[Event], Violation]:
    """A compiled checker's counterexample as the Python model's events, replayed on the real
    ``BlockLedger``: each C step is the Python event whose step leads to the same state (its
    canonical form, ``encode`` then ``kvl_canon``; unreduced, its projection, ``projection``);
    the last, the event that breaks the same invariant (or the quiet state that leaks).
    ``SpecDisagreement`` when a step has no such event, or when the real ledger does not break
    the same invariant with those events. ``por``: the checker was built with the partial-order
    reduction (only the first ``max_crashes`` peers may crash, as in the Python search with it)."""
    want = INVARIANTS[result.code]
    states = csearch.path_states(lib, result, result.bad)
    s = initial(config, checked=False, crash_first=por)
    events: list[Event] = []
    for k, raw in enumerate(states[1:], start=1):
        target: Any = raw if reduce else of_vector(decode(unpack(lib, raw), config), config)
        for ev in _candidates(s, config, policy):
            try:
                nxt, _ = step(s, ev, config, policy)
            except Broken:
                continue
            got_ = canonical(lib, encode(nxt, config)) if reduce else of_state(nxt, config)
            if got_ == target:
                events.append(ev)
                s = nxt
                break
        else:
            raise SpecDisagreement(f"step {k} of the compiled trace has no Python event")
    if result.bad_event >= 0:
        for ev in _candidates(s, config, policy):
            try:
                step(s, ev, config, policy)
            except Broken as b:
                if b.violation.invariant == want:
                    events.append(ev)
                    break
        else:
            raise SpecDisagreement(f"the compiled trace's last step breaks {want}: no Python event")
    _, _, got = run_events(config, policy, events, checked=False)
    if got is None or got.invariant != want:
        raise SpecDisagreement(
            f"the compiled checker found {want}; replayed on the real ledger the same events give "
            f"{got!r}"
        )
    return events, got


def _candidates(s: State, config: Config, policy: Policy) -> list[Event]:
    return [*enabled(s, config), *lie_events(s, config, policy)]


def checker(config: Config, policy: Policy, *, reduce: bool = True, por: bool = False) -> str:
    """The whole checker's C text: the model, then the search (``csearch``). ``por``: the
    partial-order reduction (``por.stubborn``'s sets, in C)."""
    return csearch.source(model(config, policy, reduce=reduce, por=por))


__all__ = [
    "INVARIANTS",
    "PF_CLOSED",
    "POLICIES",
    "canonical",
    "check_modelled",
    "checker",
    "decode",
    "encode",
    "environment",
    "model",
    "packing",
    "python_events",
    "unpack",
    "width",
]
