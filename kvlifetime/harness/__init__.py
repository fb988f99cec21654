"""Prefill/decode disaggregation over a real transfer engine, with seeded faults.

``loop.run(PushSettings(...))`` runs decode here and prefill in other processes (the push
direction; ``PullSettings``: decode reads prefill's blocks), and returns a ``RunResult``. Import
the submodules you need; this package imports nothing heavy by itself.
"""
