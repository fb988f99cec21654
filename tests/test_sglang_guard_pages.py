"""What the SGLang guard remembers of a lifecycle's pages (kept as the ledger's array of them, not
a set of Python ints built per page on every publish and send): each page once, in the
lifecycle view and in the quarantined-page count, however the chunks overlap."""

from __future__ import annotations

import numpy as np

from kvlifetime.guard import accepted
from kvlifetime.integrations.sglang import SGLangGuard


def test_prefill_pages_are_the_union_of_the_chunks_each_once() -> None:
    g = SGLangGuard(role="prefill", ledger_blocks=64)
    key = accepted(g.sending(None, 7, np.array([9, 1, 0, 3])))
    # A second chunk shares two pages with the first (a cached prefix is sent again).
    assert g.sending(key, 7, [3, 4, 5, 9]) == key
    assert g.lifecycle(key)["pages"] == [0, 1, 3, 4, 5, 9]
    g.poisoned(key)  # a send returned non-zero while its batch may still read
    assert g.ended(key, now=100.0) is False
    st = g.stats()
    assert st.quarantined == 1 and st.quarantined_pages == 6
    assert g.ledger.stats().blocks_by_state["free"] == 64 - 6


def test_decode_pages_are_the_published_pages_each_once() -> None:
    g = SGLangGuard(role="decode", ledger_blocks=64)
    key = accepted(
        g.published(7, np.array([5, 2, 8]), slot=0, ranks=[0, 1], prefill="10.0.0.1:8998")
    )
    assert g.lifecycle(key)["pages"] == [2, 5, 8]
    assert g.held(key, deadline=10.0) is False
    assert g.tick(11.0) == [key]  # the deadline passed unproven: quarantined, never released
    st = g.stats()
    assert st.quarantined == 1 and st.quarantined_pages == 3
