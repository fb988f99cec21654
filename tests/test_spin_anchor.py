"""The SPIN anchor works: SPIN refutes the naive policy and passes proof on the smallest
configuration, read by the runner's own parsers (``bench/spin_anchor.py``).

Skipped only when ``spin`` (or ``gcc``) is missing and ``KVLIFETIME_REQUIRE_SPIN`` is unset;
CI sets it, so there a missing SPIN fails.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from bench import spin_anchor
from kvlifetime.verify import Config, Policy, parse_faults

_HAVE = shutil.which("spin") is not None and shutil.which("gcc") is not None
_REQUIRED = bool(os.environ.get("KVLIFETIME_REQUIRE_SPIN"))

needs_spin = pytest.mark.skipif(
    not _HAVE and not _REQUIRED,
    reason="spin or gcc not installed (Debian: apt-get install spin gcc); "
    "set KVLIFETIME_REQUIRE_SPIN=1 to make this a failure",
)

SMALLEST = spin_anchor.CONFIGS["1x1x1"]


@needs_spin
def test_spin_refutes_naive_with_the_shortest_counterexample(tmp_path: Path) -> None:
    res = spin_anchor.run_spin(SMALLEST, Policy.NAIVE, tmp_path)
    row = spin_anchor.spin_row("1x1x1", SMALLEST, Policy.NAIVE, res)
    assert (row.verdict, row.invariant) == ("refuted", "isolation")
    # admit, grant, reject (naive frees the block), the cancel is lost, post, land: the
    # explorer's shortest counterexample is these six events too.
    assert res.trail_steps == 6
    # -i: each shorter counterexample found counts as one more error, the last is the shortest.
    assert res.run.errors >= 1 and not res.run.complete
    # The staged build: the -O0 verifier gave the verdict, no -O2 build was waited for.
    assert [b.cflags[0] for b in res.builds] == ["-O0"] and res.quick_seconds is None


@needs_spin
def test_spin_passes_proof(tmp_path: Path) -> None:
    res = spin_anchor.run_spin(SMALLEST, Policy.PROOF, tmp_path)
    row = spin_anchor.spin_row("1x1x1", SMALLEST, Policy.PROOF, res)
    assert row.verdict == "pass" and row.invariant is None
    assert res.run.complete and res.run.errors == 0 and res.trail_steps is None
    assert res.run.states > 1000 and res.run.transitions >= res.run.states


@needs_spin
def test_the_optimisation_level_changes_no_count(tmp_path: Path) -> None:
    # A quick search with no time (quick_s=0) gives no verdict: the staged build goes on to
    # -O2, and that verifier stores exactly the states and transitions the -O0 one did.
    quick = spin_anchor.run_spin(SMALLEST, Policy.PROOF, tmp_path / "quick")
    full = spin_anchor.run_spin(SMALLEST, Policy.PROOF, tmp_path / "full", quick_s=0.0)
    assert [b.cflags[0] for b in quick.builds] == ["-O0"]
    assert [b.cflags[0] for b in full.builds] == ["-O0", "-O2"] and full.quick_seconds == 0.0
    assert "-O2" in full.flags and "-O0" in quick.flags
    assert spin_anchor.spin_row("1x1x1", SMALLEST, Policy.PROOF, full).verdict == "pass"
    assert (full.run.states, full.run.transitions) == (quick.run.states, quick.run.transitions)


def test_an_unknown_optimisation_level_is_refused(tmp_path: Path) -> None:
    with pytest.raises(spin_anchor.AnchorError, match="optimize"):
        spin_anchor.run_spin(SMALLEST, Policy.PROOF, tmp_path, optimize="-O3")


# ------------------------------------------------------------------ the parsers, no SPIN needed

_PAN_PASS = """
(Spin Version 6.5.2 -- 6 December 2019)
\t+ Breadth-First Search
State-vector 60 byte, depth reached 24, errors: 0
    29182 states, stored
\t   29182 nominal states (stored-atomic)
    21201 states, matched
    50383 transitions (= stored+matched)
  128.839\ttotal actual memory usage
pan: elapsed time 0.07 seconds
pan: rate 416885.71 states/second
"""

_PAN_FAIL = """
pan:1: assertion violated (gen[blk[(0/1)]]==ggen[0]) (at depth 5)
pan: wrote kvlifetime.pml.trail
Warning: Search not completed
State-vector 60 byte, depth reached 5, errors: 1
      210 states, stored
      338 transitions (= stored+matched)
pan: elapsed time 0 seconds
"""


def test_parse_pan_reads_a_pass_and_a_violation() -> None:
    ok = spin_anchor.parse_pan(_PAN_PASS)
    assert (ok.complete, ok.errors, ok.states, ok.transitions) == (True, 0, 29182, 50383)
    assert (ok.seconds, ok.vector_bytes, ok.assertion, ok.memory_mb) == (0.07, 60, None, 128.839)
    bad = spin_anchor.parse_pan(_PAN_FAIL)
    assert (bad.complete, bad.errors, bad.states) == (False, 1, 210)
    assert bad.assertion == "(gen[blk[(0/1)]]==ggen[0])"
    assert spin_anchor.invariant_of(bad.assertion) == "isolation"


def test_parse_pan_reads_large_counts_in_e_notation() -> None:
    text = _PAN_PASS.replace("50383 transitions", "2.3532038e+08 transitions")
    assert spin_anchor.parse_pan(text).transitions == 235_320_380


def test_parse_pan_refuses_what_is_no_report() -> None:
    with pytest.raises(spin_anchor.AnchorError):
        spin_anchor.parse_pan("spin: kvlifetime.pml:12, Error: syntax error")


def test_hash_compaction_is_reported_approximate() -> None:
    text = _PAN_PASS.replace("+ Breadth-First Search", "Hash-Compact 4 search for:")
    run = spin_anchor.parse_pan(text)
    assert run.approximate
    assert not spin_anchor.parse_pan(_PAN_PASS).approximate


def test_a_memory_bound_is_no_pass() -> None:
    text = _PAN_PASS.replace("pan: elapsed", "pan: reached -DMEMLIM bound\npan: elapsed")
    assert not spin_anchor.parse_pan(text).complete


def test_a_channel_bound_too_small_is_the_anchors_error() -> None:
    with pytest.raises(spin_anchor.AnchorError, match="channel bound"):
        spin_anchor.invariant_of("((lqn[0]<6))")


def test_defines_follow_the_explorers_config() -> None:
    # The generated model states them as #define lines; spin_defines lists them for the record.
    cfg = spin_anchor.CONFIGS["3x2x3/k2"]
    flags = spin_anchor.spin_defines(cfg, Policy.TIMEOUT)
    assert {"-DR=3", "-DP=2", "-DB=3", "-DT=1", "-DPOLICY=1", "-DMAXF=2", "-DF_LIE=1"} <= set(flags)
    none = Config(2, 2, 2, faults=parse_faults("none"))
    assert "-DF_REORDER=0" in spin_anchor.spin_defines(none, Policy.PROOF)
    assert "-DMAXF=-1" in spin_anchor.spin_defines(none, Policy.PROOF)


def test_defines_refuse_what_the_model_lacks() -> None:
    with pytest.raises(spin_anchor.AnchorError, match="one block"):
        spin_anchor.spin_defines(Config(2, 2, 2, blocks_per_request=2), Policy.PROOF)
    with pytest.raises(spin_anchor.AnchorError, match="at most"):
        spin_anchor.spin_defines(Config(5, 2, 2), Policy.PROOF)


def test_agreement_is_only_claimed_when_both_finished() -> None:
    def row(verdict: str) -> spin_anchor.Row:
        return spin_anchor.Row("c", "f", "proof", "x", verdict, None, 1, 1, 1.0, None)

    assert spin_anchor.agreement(row("pass"), row("pass")) == "agree"
    assert spin_anchor.agreement(row("pass"), row("refuted")) == "DISAGREE"
    assert spin_anchor.agreement(row("unfinished"), row("pass")) == "unconfirmed"
