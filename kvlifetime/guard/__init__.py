"""The guard core: what every guard in an engine shares, with no engine import (sans-IO).

- ``core``: ``GuardCore``, exposures by key, the step's journal, proofs, fences, counts;
- ``holds``: each request's state of the engine-side lifecycle (``kvlifetime.spec``'s
  ``engine`` table, the only place it changes), its exposures, the step it is in;
- ``refusals``: a signal that proves nothing, as data (``Refusal``), counted by kind and logged
  on the one path every guard shares.

The integrations (``kvlifetime.integrations.vllm``, ``...sglang``) translate an engine's hooks
into these calls; the harness owners and the verifier's model step the same table.
"""

from kvlifetime.guard.core import CoreCounts, GuardCore
from kvlifetime.guard.holds import Hold, Holds
from kvlifetime.guard.refusals import Refusal, RefusalKind, Refusals

__all__ = ["CoreCounts", "GuardCore", "Hold", "Holds", "Refusal", "RefusalKind", "Refusals"]
