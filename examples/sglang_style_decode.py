"""Worked example 2: an SGLang-style decode side with deferred KV release.

The decode worker pre-allocates KV pages for a request *before* prefill has admitted it, and sends
their indices to the prefill peer (a write grant: from this moment prefill may write into them).
Prefill then rejects the request because it exceeds its capacity. The error response can go out
at once — but the pages cannot be reused until prefill proves it will write no more:

1. ``reject``                 -> the request is ``rejected``; the pages stay out of the pool;
2. ``CancelReceived``         -> prefill got the abort (proves nothing about in-flight writes);
3. ``TransferQuiesced(2)``    -> writes 1..2 ended (but prefill might still post a third);
4. ``SchedulingStopped(2)``   -> prefill posted nothing after 2: the grant is closed;
5. ``collect_releasable``     -> the pages go back to the pool with generation + 1.

A second request whose prefill peer crashes shows the other path: no proof can come, the
deadline passes, the pages are quarantined (counted, with reason and age) and never reused.

Run: ``python examples/sglang_style_decode.py``.
"""

from __future__ import annotations

from kvlifetime.errors import InsufficientEvidence
from kvlifetime.evidence import CancelReceived, SchedulingStopped, TransferQuiesced
from kvlifetime.grant import Access
from kvlifetime.ledger import BlockLedger


def main() -> None:
    ledger = BlockLedger(16)

    # Decode pre-allocates 4 pages for rid "req-7" and sends them to prefill (bootstrap).
    pages = ledger.allocate("req-7", 4)
    grant = ledger.grant("req-7", "prefill-0", pages, Access.WRITE)
    print("sent pages", pages.tolist(), "to prefill-0 as grant", grant.id)

    # Prefill: "request exceeds capacity" -> the client gets its error now.
    for t in ledger.reject("req-7", reason="exceeds prefill capacity"):
        print(f"  {t.event}: {t.source} -> {t.target}")

    try:
        ledger.release("req-7")
    except InsufficientEvidence as e:
        print("release refused:", e.unproven)

    for ev in (
        CancelReceived.of(grant),
        TransferQuiesced.of(grant, through_seq=2),
        SchedulingStopped.of(grant, last_seq=2),
    ):
        fired = ledger.apply(ev)
        print(f"{ev.kind}: fired {[t.event for t in fired]}")

    released = ledger.collect_releasable()
    print("released:", {k: v.tolist() for k, v in released.items()})
    print("generations now:", ledger.generation(pages).tolist())

    # A request whose prefill peer dies mid-transfer: no proof will ever come.
    pages2 = ledger.allocate("req-8", 2, deadline=10.0)
    ledger.grant("req-8", "prefill-1", pages2)
    ledger.reject("req-8", reason="client abort")
    print("expire(5):", ledger.expire(5.0), "expire(11):", ledger.expire(11.0))
    print("after the deadline:", ledger.state("req-8").value, "- never reused")
    q = ledger.stats(now=12.0).quarantined[0]
    print(f"quarantined: {q.request} {q.blocks} blocks, reason={q.reason}, age={q.age}s")
    assert ledger.collect_releasable() == {}
    fresh = ledger.allocate("req-9", 14)
    assert not set(fresh.tolist()) & set(pages2.tolist())
    print("req-9 got 14 fresh pages, none of req-8's")


if __name__ == "__main__":
    main()
