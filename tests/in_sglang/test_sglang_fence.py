"""What ends a remote prefill's access to the decode's pages on Mooncake TCP, in SGLang 0.5.23's
set-up (no guard: the experiment is about SGLang and Mooncake alone).

A prefill's transfer is held mid-flight (2 of its 4 batches landed). The decode then re-creates
its transfer engine (``DecodeSide.fence``: a new engine serving the same buffers, the old one
destroyed and its ports observed closed). When the prefill resumes, its remaining batches go to
the old engine's session and fail: nothing more lands. A request started after the fence
registers the new session with the prefill and transfers whole.
"""

from __future__ import annotations

import time

from sglang_driver import Rig
from test_sglang_scenarios import MARK, PER_PAGE, TOKENS, _drain, _published, _rig, _stalled


def test_recreating_the_decode_engine_ends_a_stalled_transfer(rigs: list[Rig]) -> None:
    rig = _rig(rigs, guarded=False)
    pages = _stalled(rig, "f1", 41)
    fence = rig.decode.call("fence")
    assert fence["new_session"] != fence["old_session"]
    # Overwrite what landed, so anything that lands after the fence is visible.
    rig.decode.call("new_owner", name="probe", value=0.0)  # takes the free pages, not f1's
    rig.decode.call("fill", pages=pages, value=-1.0)
    _drain(rig, 41)
    time.sleep(0.2)
    assert rig.decode.call("count", pages=pages, value=MARK) == 0, "nothing lands after it"
    assert rig.prefill.call("poll", rid="f1") == "Failed"
    rig.decode.call("free_owner", name="probe")
    # SGLang goes on with the new engine: the next request registers its session and transfers.
    after = _published(rig, "f2", 42)
    rig.prefill.call("forward", rid="f2", value=MARK)
    rig.tick_until("f2", {"running"})
    assert rig.decode.call("count", pages=after, value=MARK) == TOKENS * PER_PAGE
    print(
        f"fence: new engine {fence['new_engine_s'] * 1000:.0f} ms, old engine gone "
        f"{fence['old_engine_gone_s'] * 1000:.0f} ms, total {fence['total_s'] * 1000:.0f} ms"
    )


def test_unregistering_the_buffers_is_not_a_fence(rigs: list[Rig]) -> None:
    """SGLang's own ``deregister_buffer_to_engine`` (its role-switch teardown) is no way out: the
    decode must register the same buffers again to serve later requests, Mooncake checks a
    request's addresses, not its sender, and the stalled transfer then lands whole."""
    rig = _rig(rigs, guarded=False)
    pages = _stalled(rig, "u1", 51)
    rig.decode.call("reregister")
    _drain(rig, 51)
    assert rig.decode.call("count", pages=pages, value=MARK) == TOKENS * PER_PAGE
