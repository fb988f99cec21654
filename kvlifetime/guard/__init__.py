"""The guard core: what every guard in an engine shares, with no engine import (sans-IO).

- ``core``: ``GuardCore``, exposures by key, proofs, releases, counts, over:
- ``journal``: ``StepJournal``, the step's READ exposures made into ledger work once;
- ``reports``: ``Reports``, what the engine says about an exposure, made into evidence;
- ``hand_backs``: ``HandBacks``, the ids the engine is due, each once, on one channel;
- ``fences``: ``FenceLog``, fences recorded from any thread, applied at a step's start;
- ``holds``: each request's state of the engine-side lifecycle (``kvlifetime.spec``'s
  ``engine`` table, the only place it changes), its exposures, the step it is in;
- ``refusals``: a signal that proves nothing, as data (``Refusal``), counted by kind and logged
  on the one path every guard shares.

The integrations (``kvlifetime.integrations.vllm``, ``...sglang``) translate an engine's hooks
into these calls; the harness owners and the verifier's model step the same table.
"""

from kvlifetime.guard.core import CoreCounts, GuardCore
from kvlifetime.guard.holds import Hold, Holds
from kvlifetime.guard.refusals import Refusal, RefusalKind, Refusals, accepted

__all__ = [
    "CoreCounts",
    "GuardCore",
    "Hold",
    "Holds",
    "Refusal",
    "RefusalKind",
    "Refusals",
    "accepted",
]
