"""One harness run's result, either direction: what happened to the requests and to the blocks,
as text and JSON, and runs side by side (the comparison table).

The field names are the same concept in both directions. ``peer_crashes`` / ``peer_counters``
are the initiator's (prefill's when it pushes, decode's reader when it pulls);
``contaminated_blocks`` is KV the consumer got with another request's bytes in it (checked at
consume when prefill pushes; the stale reads when decode pulls); ``leaked_blocks`` is
``owner.leaked_blocks``'s one definition."""

from __future__ import annotations

import itertools
import json
from collections.abc import Mapping, Sequence
from typing import Any

import attrs


def _kind_of(default: object) -> type:
    """The JSON kind a field with this default must have: factory defaults are mappings, a
    field without a default (not in ``_KINDS``) is a count."""
    if isinstance(default, attrs.Factory):  # type: ignore[arg-type]
        return dict
    if isinstance(default, bool | str):
        return type(default)
    return int


MAX_SERIES_SAMPLES = 10_000  # StateSeries keeps a few hundred; refuse what no run writes


def _check_series(series: Mapping[str, Any]) -> None:
    """A time series read back must be what ``StateSeries.columns`` writes: the same columns,
    each a list of counts, all of one length (bounded), ticks in order."""
    from kvlifetime.errors import UsageError, show
    from kvlifetime.harness.series import COLUMNS

    if not series:
        return
    if set(series) != set(COLUMNS):  # in any order: report.json sorts its keys
        raise UsageError(
            f"a harness result's 'series' has columns {show(sorted(map(str, series)), 200)}, "
            f"not {sorted(COLUMNS)}"
        )
    lengths = set()
    for name, values in series.items():
        if not isinstance(values, list) or len(values) > MAX_SERIES_SAMPLES:
            raise UsageError(f"a harness result's 'series' column {show(name)} is not a short list")
        if not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in values):
            raise UsageError(f"a harness result's 'series' column {show(name)} holds a non-count")
        lengths.add(len(values))
    ticks = series["tick"]
    if len(lengths) != 1 or any(b < a for a, b in itertools.pairwise(ticks)):
        raise UsageError("a harness result's 'series' columns differ in length or go back in time")


def _check_counts(name: str, values: Mapping[Any, Any]) -> None:
    """A mapping field read back: names to counts (the oracle's ``method`` is a name)."""
    from kvlifetime.errors import UsageError, show

    for k, v in values.items():
        count = isinstance(v, int) and not isinstance(v, bool)
        if not isinstance(k, str) or not (count or (name == "oracle" and isinstance(v, str))):
            raise UsageError(f"a harness result's {name!r} has {show(k)}: {show(v)}")


# The JSON kind of each required field (the defaulted ones follow their default).
_KINDS: dict[str, type | tuple[type, ...]] = {
    "backend": str,
    "policy": str,
    "seed": int,
    "wall_s": (int, float),
    "requests_per_s": (int, float),
    "gb_per_s": (int, float),
    "mean_hold_ticks": (int, float),
    "refused_evidence": dict,
    "peer_counters": dict,
}


@attrs.frozen(slots=True)
class RunResult:
    """One run's figures. ``contaminated_blocks`` is counted by content, never estimated."""

    backend: str
    policy: str
    seed: int
    requests: int  # admitted
    completed: int  # consumed and finished normally
    aborted: int  # by the client
    rejected: int  # by the peer's admission, after the addresses were sent (push)
    transfer_failed: int  # a batch reported FAILED
    lost_to_crash: int  # live when the peer crashed
    ended_mid_transfer: int  # aborted/rejected/failed with a batch posted and the grant open
    # consumed (or held) with another owner's bytes in them; pulling, the stale reads
    contaminated_blocks: int
    contaminated_requests: int
    leaked_blocks: int  # out of the pool at the end, and no quarantine explains it
    quarantined_blocks: int  # out of circulation at the end, waiting for proof that can't come
    quarantined_requests: int
    unsafe_releases: int  # force_release of a request with an open grant
    refused_evidence: Mapping[str, int]  # ledger refusals by kind (stale, mismatched, ...)
    malformed_refused: int  # garbage frames refused by either worker
    peer_crashes: int  # crashes of the initiator (prefill pushing, decode's reader pulling)
    queries: int  # evidence re-requested after a loss
    ticks: int
    wall_s: float
    requests_per_s: float
    kv_bytes: int  # bytes of KV consumed by decode
    gb_per_s: float
    mean_hold_ticks: float  # allocation to release, released requests
    peak_blocks_out: int  # most blocks out of the pool at once
    num_blocks: int
    block_bytes: int
    peer_counters: Mapping[str, int]  # the initiator's, from its incarnations that exited cleanly
    restart: str = "none"  # the owner's restart mid-run (push: decode): none / naive / guarded
    fences: Mapping[str, int] = attrs.field(factory=dict)  # fence name -> times performed
    reclaimed_blocks: Mapping[str, int] = attrs.field(factory=dict)  # fence -> blocks back
    peak_quarantined_blocks: int = 0  # most blocks quarantined at once (sampled every 8 ticks)
    admission_stalls: int = 0  # times a request waited for free blocks (the pool ran short)
    pool_exhausted: bool = False  # the run stopped: no admission for drain_ticks ticks
    unauthorized_refused: int = 0  # evidence a peer may not assert (provenance), refused
    lost_to_fence: int = 0  # live requests ended because their peer was fenced
    lost_to_restart: int = 0  # requests the owner held when it restarted
    released_by_late_proof: int = 0  # quarantined, then released by proof that came late
    prefix_hits: int = 0  # requests that shared their first blocks with an earlier one
    # the oracle at the transport (harness.oracle.OracleCounts as data): every landing seen
    oracle: Mapping[str, int | str] = attrs.field(factory=dict)
    # "push": prefill writes into decode's blocks; "pull": decode reads prefill's
    direction: str = "push"
    stale_reads: int = 0  # pull: reads whose bytes were not their grant's words (reader check)
    stale_read_blocks: int = 0  # ... distinct source blocks they hit
    # topology knobs (push): tp_ranks, slices a dead initiator's transport landed after it was
    # gone (landed_after_death) or that a fence discarded first (cut_by_fence); re-delivered
    # slices are the oracle's (``redelivered``, ``late_redelivered``)
    topology: Mapping[str, int] = attrs.field(factory=dict)
    # blocks by state over the run (harness.series.StateSeries.columns: column -> one value
    # per sample, at most a few hundred samples whatever the run's length); the report's plots
    series: Mapping[str, Sequence[int]] = attrs.field(factory=dict)
    # the owner's engine-side table (its ``guard.Holds``): signals it refused, by kind
    # (``RefusalKind``); under the proof policy none
    engine_refusals: Mapping[str, int] = attrs.field(factory=dict)
    # frees the table refused to hand back (the policy freed what the ledger had not proven):
    # one per unsafe release (``unsafe_releases``, the ledger's own count)
    refused_hand_backs: int = 0

    @property
    def topology_label(self) -> str:
        """The topology knobs that were on, for the comparison table ("-": none)."""
        on = []
        if self.topology.get("tp_ranks", 1) > 1:
            on.append(f"tp={self.topology['tp_ranks']}")
        if self.topology.get("land_after_crash"):
            on.append("lands after crash")
        if self.topology.get("redeliver_permille"):
            on.append(f"re-delivery {self.topology['redeliver_permille'] / 10:g}%")
        return ", ".join(on) or "-"

    def seen(self, key: str) -> int:
        v = self.oracle.get(key, 0)
        return v if isinstance(v, int) else 0

    @property
    def reclaimed_total(self) -> int:
        return sum(self.reclaimed_blocks.values())

    @property
    def fences_total(self) -> int:
        return sum(self.fences.values())

    @property
    def mid_transfer_ratio(self) -> float:
        return self.ended_mid_transfer / self.requests if self.requests else 0.0

    def to_dict(self) -> dict[str, Any]:
        d = attrs.asdict(self)
        d["mid_transfer_ratio"] = round(self.mid_transfer_ratio, 4)
        d["reclaimed_total"] = self.reclaimed_total
        for k in ("late_writes", "late_into_owned", "late_into_free"):
            d[k] = self.seen(k)
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> RunResult:
        """A report back from ``to_dict()`` (what ``report.json`` holds); the derived keys
        (``late_writes``, ``reclaimed_total``, ...) are recomputed, not read. Raises
        ``UsageError`` naming the first missing field or a value of the wrong kind (a mapping
        field's values included: counts, and the oracle's method name), and for data nested
        deeper than ``inputs.MAX_NESTING``."""
        from kvlifetime.errors import UsageError, show
        from kvlifetime.inputs import shallow

        if not isinstance(d, Mapping):
            raise UsageError(f"a harness result must be a JSON object, not {type(d).__name__}")
        shallow(d, "a harness result", error=UsageError)
        kwargs: dict[str, Any] = {}
        for f in attrs.fields(cls):
            if f.name not in d:
                if f.default is attrs.NOTHING:
                    raise UsageError(f"a harness result has no {f.name!r}")
                continue
            v = d[f.name]
            want = _KINDS.get(f.name) or _kind_of(f.default)
            wrong = not isinstance(v, want) or (isinstance(v, bool) and want is not bool)
            if wrong:  # a bool is an int to Python, never a count here
                raise UsageError(f"a harness result's {f.name!r} is {show(v)}")
            if want is dict and f.name != "series":
                _check_counts(f.name, v)
            kwargs[f.name] = v
        _check_series(kwargs.get("series", {}))
        return cls(**kwargs)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    def timing_free(self) -> dict[str, Any]:
        """Everything but wall-clock figures: equal for equal seeds (reproducibility)."""
        d = self.to_dict()
        for k in ("wall_s", "requests_per_s", "gb_per_s"):
            d.pop(k)
        return d

    def to_text(self) -> str:
        rows = [
            ("requests", self.requests),
            ("completed", self.completed),
            ("aborted (client)", self.aborted),
            ("rejected (admission)", self.rejected),
            ("transfer failed", self.transfer_failed),
            ("lost to peer crash", self.lost_to_crash),
            (
                "ended mid-transfer",
                f"{self.ended_mid_transfer} ({100 * self.mid_transfer_ratio:.1f}%)",
            ),
            (
                "late writes (oracle)",
                f"{self.seen('late_writes')}: {self.seen('late_into_owned')} into another "
                f"owner's block, {self.seen('late_into_free')} into a free block; "
                f"{self.seen('late_blocks')} blocks, {self.seen('hit_requests')} requests hit "
                f"(of {self.seen('writes')} landings, {self.oracle.get('method', '-')})",
            ),
            ("contaminated at consume", self.contaminated_blocks),
            ("contaminated requests", self.contaminated_requests),
            ("leaked blocks", self.leaked_blocks),
            ("quarantined blocks", f"{self.quarantined_blocks} ({self.quarantined_requests} req)"),
            ("unsafe releases", self.unsafe_releases),
            (
                "refused hand-backs",
                f"{self.refused_hand_backs} (engine-side table; "
                f"{sum(self.engine_refusals.values())} refusals in all)",
            ),
            ("fences", ", ".join(f"{k} x{v}" for k, v in sorted(self.fences.items())) or "none"),
            ("reclaimed by fences", sum(self.reclaimed_blocks.values())),
            ("peak quarantined", self.peak_quarantined_blocks),
            ("admission stalls", self.admission_stalls),
            ("pool exhausted", "YES: the run stopped" if self.pool_exhausted else "no"),
            ("unauthorized refused", self.unauthorized_refused),
            ("lost to fence / restart", f"{self.lost_to_fence} / {self.lost_to_restart}"),
            ("released by late proof", self.released_by_late_proof),
            ("prefix-cache hits", self.prefix_hits),
            (
                "topology",
                f"{self.topology.get('tp_ranks', 1)} prefill rank(s); after a crash "
                f"{self.topology.get('landed_after_death', 0)} slices landed, "
                f"{self.topology.get('cut_by_fence', 0)} cut by a fence "
                f"({self.seen('late_after_death')} late); {self.seen('redelivered')} re-delivered "
                f"slices landed ({self.seen('late_redelivered')} late)",
            ),
            ("refused evidence", sum(self.refused_evidence.values())),
            ("malformed frames refused", self.malformed_refused),
            ("evidence queries", self.queries),
            ("ticks", self.ticks),
            ("wall time", f"{self.wall_s:.2f} s"),
            ("requests/s", f"{self.requests_per_s:.0f}"),
            ("KV consumed", f"{self.kv_bytes / 2**20:.1f} MiB ({self.gb_per_s:.3f} GB/s)"),
            ("mean block hold", f"{self.mean_hold_ticks:.2f} ticks"),
            ("peak blocks out", f"{self.peak_blocks_out} of {self.num_blocks}"),
        ]
        width = max(len(k) for k, _ in rows)
        head = f"kvlifetime simulate: backend={self.backend} policy={self.policy} seed={self.seed}"
        if self.restart != "none":
            head += f" restart={self.restart}"
        if self.direction != "push":
            head += f" direction={self.direction}"
            rows.insert(
                7,
                (
                    "stale reads (reader)",
                    f"{self.stale_reads} of {self.seen('reads')} reads, "
                    f"{self.stale_read_blocks} source blocks",
                ),
            )
        return "\n".join([head, *(f"  {k:<{width}}  {v}" for k, v in rows)]) + "\n"


COMPARE_COLUMNS: tuple[tuple[str, str], ...] = (
    ("policy", "policy"),
    ("restart", "restart"),
    ("requests", "requests"),
    ("mid-transfer", "ended_mid_transfer"),
    ("late writes", "late_writes"),
    ("into owned", "late_into_owned"),
    ("into free", "late_into_free"),
    ("contaminated at consume", "contaminated_blocks"),
    ("leaked", "leaked_blocks"),
    ("quarantined", "quarantined_blocks"),
    ("peak quarantined", "peak_quarantined_blocks"),
    ("reclaimed by fences", "reclaimed_total"),
    ("unsafe releases", "unsafe_releases"),
    ("req/s", "requests_per_s"),
    ("GB/s", "gb_per_s"),
    ("hold (ticks)", "mean_hold_ticks"),
)


PULL_COLUMNS: tuple[tuple[str, str], ...] = (
    ("direction", "direction"),
    ("stale reads", "stale_reads"),
    ("stale read blocks", "stale_read_blocks"),
)


def compare_cells(reports: Sequence[RunResult]) -> tuple[list[str], list[list[str]]]:
    """The comparison table as data: its headings, and one row of cells per run."""
    columns = COMPARE_COLUMNS
    if any(r.direction != "push" for r in reports):  # push-only tables stay as they were
        columns = (*COMPARE_COLUMNS[:4], *PULL_COLUMNS, *COMPARE_COLUMNS[4:])
    if any(r.topology_label != "-" for r in reports):
        columns = (*columns[:2], ("topology", "topology_label"), *columns[2:])
    rows = []
    for r in reports:
        d = {**r.to_dict(), "topology_label": r.topology_label}
        cells = [r.backend]
        for _c, k in columns:
            v = d[k]
            if k == "ended_mid_transfer":
                v = f"{v} ({100 * r.mid_transfer_ratio:.1f}%)"
            elif isinstance(v, float):
                v = f"{v:.3f}" if k == "gb_per_s" else f"{v:.1f}"
            cells.append(str(v))
        rows.append(cells)
    return ["backend", *(c for c, _ in columns)], rows


def compare_markdown(reports: Sequence[RunResult]) -> str:
    """The policies side by side, and what the proof policy costs against naive."""
    head, rows = compare_cells(reports)
    lines = ["| " + " | ".join(head) + " |", "| --- " * len(head) + "|"]
    lines += ["| " + " | ".join(cells) + " |" for cells in rows]
    out = "\n".join(lines) + "\n"
    by = {
        r.policy: r
        for r in reports
        if r.restart == "none" and r.direction == "push" and r.topology_label == "-"
    }
    naive, proof = by.get("naive"), by.get("proof")
    if naive is not None and proof is not None and naive.requests_per_s > 0:
        hold = proof.mean_hold_ticks / max(naive.mean_hold_ticks, 1e-9)
        out += (
            f"\nproof vs naive: {proof.requests_per_s / naive.requests_per_s:.2f}x the "
            f"throughput, blocks held {hold:.2f}x"
            f" as long (quarantined requests count once fenced and released), "
            f"{proof.seen('late_writes')} late writes instead of {naive.seen('late_writes')} "
            f"({naive.contaminated_blocks} contaminated at consume); "
            f"at most {proof.peak_quarantined_blocks} quarantined, "
            f"{proof.reclaimed_total} reclaimed by {proof.fences_total} fences, "
            f"{proof.quarantined_blocks} left at the end\n"
        )
    pulls = {r.policy: r for r in reports if r.direction == "pull"}
    if pulls:
        out += (
            "\npull (decode reads): "
            + ", ".join(f"{p} {r.stale_reads} stale reads" for p, r in sorted(pulls.items()))
            + "\n"
        )
    rs = {r.restart: r for r in reports if r.restart != "none"}
    if "naive" in rs and "guarded" in rs:
        out += (
            f"\ndecode restart: naive {rs['naive'].seen('late_writes')} late writes "
            f"({rs['naive'].contaminated_blocks} contaminated at consume), "
            f"guarded {rs['guarded'].seen('late_writes')} "
            f"({rs['guarded'].fences_total} fences, "
            f"{sum(rs['guarded'].reclaimed_blocks.values())} blocks reclaimed)\n"
        )
    return out
