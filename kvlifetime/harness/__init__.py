"""Prefill/decode disaggregation over a real transfer engine, with seeded faults.

``simulate.run(SimConfig(...))`` runs decode here and prefill in another process, and returns a
``Report``. Import the submodules you need; this package imports nothing heavy by itself.
"""
