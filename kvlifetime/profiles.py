"""Evidence profiles: what every status and operation of a transfer engine proves, as data.

Each transfer-engine adapter declares one ``EngineProfile``: a row per raw status or operation
of its engine (``StatusRow``), the kvlifetime evidence it yields (or ``"nothing"``), the claims
that evidence supports, what it does *not* prove, how that was established (read in the
engine's code, measured, or both) and the test that pins it. ``kvlifetime evidence --engine
NAME`` prints a profile, ``kvlifetime docs`` writes ``docs/engine-<name>.md`` from it, and the
adapters' tests check the rows against the behaviour they measure.

Where the profiles live:

- ``inproc``: ``INPROC_PROFILE`` below (the engine is ``kvlifetime.adapters.inproc``; its
  fence is ``kvlifetime.harness.peer.fence_peer``);
- ``mooncake-tcp``: ``kvlifetime.adapters.mooncake.PROFILE`` (importable without Mooncake
  installed: the adapter imports the engine lazily);
- ``nixl-ucx``: ``kvlifetime.adapters.nixl.PROFILE``, an ``EngineProfile`` or, as a first
  draft, a tuple of ``(status, evidence, proves, does not prove, established)`` 5-tuples.

``PROFILES`` loads them on first use, so that importing this module imports no adapter.
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import attrs

from kvlifetime.errors import InvalidField, UsageError
from kvlifetime.evidence import BY_NAME, Claim, Evidence
from kvlifetime.provenance import RESTS_ON_PEER

NOTHING = "nothing"
ESTABLISHED: tuple[str, ...] = ("code", "measured", "code and measured")
_TEST_ID = re.compile(r"^tests/[\w/]+\.py::test_\w+$")


class ProfileUnavailable(UsageError):
    """No evidence profile can be loaded for this engine.
    Its adapter is not written yet, or does not declare one. Whose fault: the caller's choice of
    engine. Nothing was printed."""

    kind = "profile_unavailable"


def evidence_classes(evidence: str) -> tuple[type[Evidence], ...]:
    """The evidence classes a row's ``evidence`` names: ``"nothing"`` -> ``()``; otherwise
    class names joined by ``" or "`` (``"TransferQuiesced or TransferCompleted"``)."""
    if evidence == NOTHING:
        return ()
    names = evidence.split(" or ")
    unknown = [n for n in names if n not in BY_NAME]
    if unknown:
        raise InvalidField(
            f"evidence must be {NOTHING!r} or evidence class names joined by ' or ', got "
            f"{evidence!r} (unknown: {', '.join(unknown)}; known: {', '.join(BY_NAME)})"
        )
    return tuple(BY_NAME[n] for n in names)


def supported_claims(evidence: str) -> frozenset[Claim]:
    """The claims every class named by ``evidence`` proves (the most a row may claim)."""
    classes = evidence_classes(evidence)
    if not classes:
        return frozenset()
    out = frozenset(classes[0].PROVES)
    for cls in classes[1:]:
        out &= cls.PROVES
    return out


def _text(_inst: object, attr: attrs.Attribute[Any], value: object) -> None:
    if not isinstance(value, str):
        raise InvalidField(f"{attr.name} must be a str, got {value!r}")


def _nonempty(_inst: object, attr: attrs.Attribute[Any], value: object) -> None:
    if not isinstance(value, str) or not value.strip():
        raise InvalidField(f"{attr.name} must be a non-empty str, got {value!r}")


def _claims(value: Iterable[Claim]) -> frozenset[Claim]:
    return frozenset(value)


def _notes(value: Iterable[str]) -> tuple[str, ...]:
    return tuple(value)


@attrs.frozen(slots=True)
class StatusRow:
    """One raw status or operation of an engine, and what it proves.

    ``claims`` must be what every class named in ``evidence`` proves or less, and empty when
    ``evidence`` is ``"nothing"``; ``test`` names the test that pins the row
    (``tests/<file>.py::test_<name>``)."""

    status: str = attrs.field(validator=_nonempty)  # the raw status / operation, engine's names
    evidence: str = attrs.field(validator=_nonempty)  # evidence class name(s), or "nothing"
    claims: frozenset[Claim] = attrs.field(converter=_claims)
    does_not_prove: str = attrs.field(validator=_nonempty)
    established: str = attrs.field()  # "code", "measured" or "code and measured"
    test: str = attrs.field(validator=_text)  # the test that pins it; "" only for drafts
    proves: str = attrs.field(default="", kw_only=True, validator=_text)  # in words

    @claims.validator
    def _check_claims(self, _a: attrs.Attribute[frozenset[Claim]], v: frozenset[Claim]) -> None:
        if not all(isinstance(c, Claim) for c in v):
            raise InvalidField(f"claims must be Claim members, got {sorted(map(repr, v))}")
        allowed = supported_claims(self.evidence)
        extra = v - allowed
        if extra:
            raise InvalidField(
                f"{self.status!r}: {self.evidence} does not prove "
                f"{', '.join(sorted(c.value for c in extra))}"
            )

    @established.validator
    def _check_established(self, _a: attrs.Attribute[str], v: object) -> None:
        if v not in ESTABLISHED:
            raise InvalidField(f"established must be one of {ESTABLISHED}, got {v!r}")

    @test.validator
    def _check_test(self, _a: attrs.Attribute[str], v: str) -> None:
        if v and not _TEST_ID.match(v):
            raise InvalidField(f"test must look like tests/<file>.py::test_<name>, got {v!r}")

    @property
    def evidence_classes(self) -> tuple[type[Evidence], ...]:
        return evidence_classes(self.evidence)


def _rows(value: object) -> tuple[StatusRow, ...]:
    rows = tuple(value) if isinstance(value, list | tuple) else None
    if rows is None or not rows or not all(isinstance(r, StatusRow) for r in rows):
        raise InvalidField(f"rows must be a non-empty sequence of StatusRow, got {value!r}")
    return rows


@attrs.frozen(slots=True)
class EngineProfile:
    """What every status and operation of one engine, on one transport, proves.

    ``fence`` is the name of the engine's fence (the ``fence`` of the ``AccessRevoked`` it
    yields), or ``None`` where none exists; exactly one row then yields ``access_revoked``, and
    its ``status`` names the fence. ``peer_word`` says which claims rest on the peer's word on
    this engine (``provenance.RESTS_ON_PEER``)."""

    name: str = attrs.field(validator=_nonempty)  # "mooncake-tcp", the CLI's --engine
    package: str = attrs.field(validator=_nonempty)  # the engine's package
    version: str = attrs.field(validator=_nonempty)  # the version the rows were established on
    transport: str = attrs.field(validator=_nonempty)
    rows: tuple[StatusRow, ...] = attrs.field(converter=_rows)
    fence: str | None = attrs.field()
    fence_note: str = attrs.field(validator=_nonempty)
    peer_word: str = attrs.field(validator=_nonempty)
    source: str = attrs.field(default="", kw_only=True, validator=_text)  # where it was read
    notes: tuple[str, ...] = attrs.field(default=(), kw_only=True, converter=_notes)

    @fence.validator
    def _check_fence(self, _a: attrs.Attribute[str | None], v: object) -> None:
        if v is not None and (not isinstance(v, str) or not v):
            raise InvalidField(f"fence must be None or a non-empty str, got {v!r}")
        revoking = self.fence_rows
        if v is None and revoking:
            raise InvalidField(f"{self.name}: no fence, yet {revoking[0].status!r} revokes")
        if v is not None:
            if len(revoking) != 1:
                raise InvalidField(f"{self.name}: fence {v!r} needs exactly one revoking row")
            if v not in revoking[0].status:
                raise InvalidField(f"{self.name}: the fence row must name {v!r}")

    @property
    def fence_rows(self) -> tuple[StatusRow, ...]:
        """The rows that yield ``access_revoked``: the fence's (none when ``fence`` is None)."""
        return tuple(r for r in self.rows if Claim.ACCESS_REVOKED in r.claims)

    def to_dict(self) -> dict[str, Any]:
        """Plain data (``kvlifetime evidence --engine NAME --format json``); claims in
        ``Claim`` order."""
        return {
            "name": self.name,
            "package": self.package,
            "version": self.version,
            "transport": self.transport,
            "source": self.source,
            "fence": self.fence,
            "fence_note": self.fence_note,
            "peer_word": self.peer_word,
            "rests_on_peer_word": [c.value for c in Claim if c in RESTS_ON_PEER],
            "rows": [
                {
                    "status": r.status,
                    "evidence": r.evidence,
                    "claims": [c.value for c in Claim if c in r.claims],
                    "proves": r.proves,
                    "does_not_prove": r.does_not_prove,
                    "established": r.established,
                    "test": r.test,
                }
                for r in self.rows
            ],
            "notes": list(self.notes),
        }


# =========================================================================== the in-process engine

_HARNESS = "tests/test_mooncake_adapter.py"

INPROC_PROFILE = EngineProfile(
    name="inproc",
    package="kvlifetime.adapters.inproc",
    version="this checkout",
    transport="shared file mapping; copies on a thread of the initiator's process",
    source="kvlifetime/adapters/inproc.py (InprocTarget, InprocEngine); "
    "kvlifetime/harness/peer.py (fence_peer); docs/fencing.md",
    rows=(
        StatusRow(
            "`wait(handle) == COMPLETED` (0)",
            "TransferQuiesced or TransferCompleted",
            {Claim.TRANSFERS_ENDED},
            "anything about batches not yet completed; with every batch 1..N completed the "
            "adapter emits TransferQuiesced through N, or TransferCompleted(N) at the normal end",
            "code and measured",
            "tests/test_profiles.py::test_inproc_completed_means_landed",
            proves="every slice of the batch was copied into the arena before the status was "
            "set (the copy thread sets it after the last slice); none copies again",
        ),
        StatusRow(
            "`wait(handle) == FAILED` (-1, or a wait that timed out)",
            NOTHING,
            frozenset(),
            "that the batch stopped: its accepted slices land `straggle_ticks` ticks later, "
            "after FAILED was reported (as on Mooncake); the grant stays open, the blocks are "
            "quarantined",
            "code and measured",
            f"{_HARNESS}::test_inproc_failed_batch_still_lands_later",
        ),
        StatusRow(
            "`InprocTarget.unregister()`",
            NOTHING,
            frozenset(),
            "that access ended: it refuses new slices only; a slice accepted before it keeps "
            "writing (the range is checked once, when the slice is posted). Not AccessRevoked",
            "code and measured",
            f"{_HARNESS}::test_inproc_unregister_is_not_revocation",
        ),
        StatusRow(
            "`InprocTarget.fence()`",
            NOTHING,
            frozenset(),
            "anything: it raises FenceUnavailable. The copies run in the initiator's process, "
            "which maps the arena itself; the target side cannot cut it",
            "code",
            "tests/test_profiles.py::test_inproc_target_has_no_fence",
        ),
        StatusRow(
            "initiator process reaped (`fence_peer`: killed, exit status collected) "
            '-> `"inproc_initiator_reaped"`',
            "AccessRevoked",
            {Claim.ACCESS_REVOKED},
            "nothing is left unproven about the peer's grants; it says nothing about a new "
            "incarnation of the peer, which must be granted afresh",
            "code and measured",
            "tests/test_profiles.py::test_inproc_reaping_the_initiator_ends_its_writes",
            proves="no thread of the initiator exists: its queued copies, the stragglers of its "
            "failed batches and its mapping are gone (AccessRevoked for every grant of the peer)",
        ),
        StatusRow(
            "heartbeat to the initiator failed (its process hung or unreachable, not reaped)",
            "PeerLost",
            {Claim.HEARTBEAT_FAILED},
            "that its copies stopped: a stopped process that resumes writes again (measured: "
            "SIGSTOP, then SIGCONT); every grant to the peer is quarantined until it is reaped",
            "code and measured",
            "tests/test_profiles.py::test_inproc_a_stopped_initiator_writes_again",
        ),
    ),
    fence="inproc_initiator_reaped",
    fence_note="The target side has no fence (InprocTarget.fence raises FenceUnavailable). The "
    "harness fences on the initiator: kill the prefill process and wait for its exit status "
    "(kvlifetime.harness.peer.fence_peer); then decode applies "
    'AccessRevoked(peer, fence="inproc_initiator_reaped"). If it cannot be reaped, nothing is '
    "revoked (PeerFailed). It exists because the harness owns the copy process.",
    peer_word="The engine runs in prefill's process: COMPLETED is observed there and relayed "
    "over the wire, so cancel_received, scheduling_stopped and transfers_ended "
    "(SchedulingStopped, TransferQuiesced, TransferCompleted) rest on the peer's word. "
    "access_revoked never does: decode makes it itself, after reaping the process.",
    notes=(
        "The in-process engine reproduces Mooncake TCP's hard semantics, never kinder: one "
        "range check per slice at post time, FAILED at the first failing slice while the "
        "others still land, no cancel.",
    ),
)


# =========================================================================== the registry


def _from_tuples(name: str, rows: object, module: str) -> EngineProfile:
    """A draft profile from ``(status, evidence, proves, does not prove, established)`` tuples:
    the evidence text is reduced to the class names it mentions, the claims to what they all
    prove; no test pins a row (``test == ""``, which ``tests/test_profiles.py`` refuses)."""
    if not isinstance(rows, list | tuple):
        raise InvalidField(f"{module}.PROFILE must be an EngineProfile or a tuple of 5-tuples")
    out: list[StatusRow] = []
    for item in rows:
        if not (isinstance(item, list | tuple) and len(item) == 5):
            raise InvalidField(f"{module}.PROFILE: each row must be a 5-tuple, got {item!r}")
        status, evidence, proves, not_proved, established = (str(x) for x in item)
        names = [n for n in BY_NAME if re.search(rf"\b{n}\b", evidence)]
        ev = NOTHING if not names or evidence.strip().lower().startswith(NOTHING) else None
        ev = ev or " or ".join(names)
        est = established if established in ESTABLISHED else _established(established)
        out.append(
            StatusRow(
                status,
                ev,
                supported_claims(ev),
                not_proved or "(not stated)",
                est,
                "",
                proves=proves if evidence == ev else f"{proves} ({evidence})".strip(),
            )
        )
    fences = [r for r in out if Claim.ACCESS_REVOKED in r.claims]
    return EngineProfile(
        name=name,
        package="(draft: not stated)",
        version="(draft: not stated)",
        transport="UCX over TCP" if name == "nixl-ucx" else "(draft: not stated)",
        rows=tuple(out),
        fence=fences[0].status if len(fences) == 1 else None,
        fence_note="(draft profile: a tuple of rows; no fence named)",
        peer_word="(draft profile: not stated)",
        source=module,
    )


def _established(text: str) -> str:
    low = text.lower()
    code = "code" in low or "read" in low or "source" in low
    measured = "measur" in low or "experiment" in low or "test" in low
    if code and measured:
        return "code and measured"
    return "measured" if measured else "code"


def _load_inproc() -> EngineProfile:
    return INPROC_PROFILE


def _load_module(name: str, module: str) -> EngineProfile:
    try:
        mod = importlib.import_module(module)
    except ImportError as e:
        raise ProfileUnavailable(
            f"{name}: no evidence profile yet: {module} cannot be imported ({e})"
        ) from e
    found = getattr(mod, "PROFILE", None)
    if found is None:
        raise ProfileUnavailable(f"{name}: no evidence profile yet: {module} defines no PROFILE")
    if isinstance(found, EngineProfile):
        if found.name != name:
            raise InvalidField(f"{module}.PROFILE is named {found.name!r}, expected {name!r}")
        return found
    return _from_tuples(name, found, module)


_LOADERS: Mapping[str, tuple[str, str | None]] = {
    "inproc": ("the in-process engine", None),
    "mooncake-tcp": ("Mooncake TCP", "kvlifetime.adapters.mooncake"),
    "nixl-ucx": ("NIXL over UCX", "kvlifetime.adapters.nixl"),
    "vllm": ("vLLM's KV-connector signals", "kvlifetime.integrations.vllm.signals"),
    "sglang": ("SGLang's disaggregation signals", "kvlifetime.integrations.sglang.signals"),
}
ENGINES: tuple[str, ...] = tuple(_LOADERS)
"""Every engine a profile is known for, available or not (the CLI's ``--engine`` choices)."""


def title(name: str) -> str:
    """A human name for an engine (``"Mooncake TCP"``)."""
    return _LOADERS[name][0]


def origin(name: str) -> str:
    """Where engine ``name``'s profile is declared (``"kvlifetime.adapters.mooncake.PROFILE"``)."""
    module = _LOADERS[name][1]
    return "kvlifetime.profiles.INPROC_PROFILE" if module is None else f"{module}.PROFILE"


def profile(name: str) -> EngineProfile:
    """The profile of engine ``name``; ``ProfileUnavailable`` when its adapter declares none
    (yet), ``InvalidField`` when what it declares is malformed."""
    if name not in _LOADERS:
        raise ProfileUnavailable(f"unknown engine {name!r} (known: {', '.join(ENGINES)})")
    module = _LOADERS[name][1]
    return _load_inproc() if module is None else _load_module(name, module)


class _Profiles(Mapping[str, EngineProfile]):
    """The available profiles, loaded on first use: an engine whose adapter declares no
    profile (yet) is absent; ``profile(name)`` says why."""

    def __getitem__(self, name: str) -> EngineProfile:
        try:
            return profile(name)
        except ProfileUnavailable as e:
            raise KeyError(name) from e

    def __iter__(self) -> Iterator[str]:
        for name in ENGINES:
            try:
                profile(name)
            except ProfileUnavailable:
                continue
            yield name

    def __len__(self) -> int:
        return sum(1 for _ in self)

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and name in set(self)


PROFILES: Mapping[str, EngineProfile] = _Profiles()
"""Engine name -> its profile, for every engine whose adapter declares one."""
