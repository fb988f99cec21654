"""The transport oracle against an independent write-by-write audit (issue 20, item 11;
the audit is ``oracle_audit_helpers``).

With prefix sharing and a transport that re-delivers slices after DONE, a writer lets go of a
block its sharers keep and then its own copy lands: an oracle told only of returns to the pool
calls that landing on time, and names as its victim a request that had let go. The figures
must agree exactly, landing by landing, on each seed; and the workload must produce such
landings, or the comparison proves nothing.
"""

from __future__ import annotations

import attrs
import pytest
from oracle_audit_helpers import WriteByWriteAudit, audits_fixture  # noqa: F401  (a fixture)

from kvlifetime.harness.faults import FaultConfig
from kvlifetime.harness.loop import run
from kvlifetime.harness.push_owner import DecodeWorker
from kvlifetime.harness.settings import PushSettings

# Prefix sharing on (the default rate, a quarter of the requests), and a transport that
# re-delivers a slice of a completed batch after reporting it COMPLETED: the writer is released
# on that proof (or early, by the naive and timeout policies) while a sharer keeps the block,
# and then its copy lands. One case adds the landings of a crashed initiator's hand-overs.
# Each case's seed produces landings after a writer let go of a block its sharers kept.
LIES = FaultConfig(p_redeliver=0.2, redeliver_after_done=True)


@pytest.mark.parametrize(
    ("policy", "seed", "faults"),
    [
        ("proof", 1, FaultConfig(p_redeliver=0.05, redeliver_after_done=True)),
        ("naive", 5, LIES),
        ("timeout", 6, LIES),
        ("proof", 4, attrs.evolve(LIES, land_after_crash=True)),
    ],
)
def test_the_oracle_matches_a_write_by_write_audit_with_sharing_and_redelivery(
    audits: list[tuple[DecodeWorker, WriteByWriteAudit]],
    policy: str,
    seed: int,
    faults: FaultConfig,
) -> None:
    r = run(PushSettings(policy=policy, requests=600, seed=seed, faults=faults))
    assert len(audits) == 1
    worker, audit = audits[0]
    o = worker.oracle
    c = o.counts()
    assert r.oracle["method"] == "copy log" and r.prefix_hits > 0
    # The workload produces what the comparison is about: late landings of a writer's own
    # word into a block its sharers kept (counted by the audit, from the ledger).
    assert audit.late_after_writer_let_go > 0
    got = (c.writes, c.late_into_owned, c.late_into_free, c.late_blocks, c.late_redelivered)
    want = (
        audit.writes,
        audit.late_into_owned,
        audit.late_into_free,
        len(audit.late_blocks),
        audit.late_redelivered,
    )
    assert got == want
    assert c.late_writes == audit.late  # counted one by one, not the sum of the two above
    assert o.hit_request_keys() == audit.hit and c.hit_requests == len(audit.hit)
