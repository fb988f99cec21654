"""The specification of kvlifetime, in one place.

h11's rule: **everything that affects a transition lives here.** A change to what may happen to
a request or a block is a change to this package, and nowhere else:

- ``vocabulary``: the states, the events and the guards of both lifecycles, the order in which
  evidence-driven transitions are tried (``PROOF_CHAIN``), and which events are unsafe;
- ``proof``: ``GrantProof``, what has been proven about one grant (the facts the request guards
  read: when a grant is closed, what contradicts, what only makes it suspect);
- ``lifecycles``: ``RequestLifecycle`` and ``BlockLifecycle``, the python-statemachine classes
  that arrange the vocabulary into transitions: the one source of truth;
- ``table``: compiles the classes into ``TransitionTable`` data (the ledger's fast path runs
  only that), and exports it as markdown, csv and json;
- ``table_data``: the compiled rows, committed (``python -m kvlifetime.spec.table`` rewrites
  it; a test checks it against the classes), so that an unchecked ledger never imports
  python-statemachine.

What cannot be a row is named here and lives beside the state it changes, in
``kvlifetime.ledger`` (each runs only after a row of this package allowed the step):

- ``ledger.transitions.fire`` / ``advance``: which row to try (a call's event; the
  evidence-driven events in ``PROOF_CHAIN`` order, as long as one fires);
- ``ledger.transitions.moved``, the bookkeeping on every request transition: the ``checked``
  mirror into a ``RequestLifecycle``, the set of releasable requests (``transfer_quiesced``
  enters it, any other state leaves it), the quarantine reason and time, the ``Transition``
  record logged;
- ``ledger.blocks.BlockCounts.derive_states``: the ledger does not step a ``BlockLifecycle`` per
  block on the hot path; it derives every block's state in one vectorized pass from the counts
  the block guards read (holders, live holders, open grants, quarantine), and
  tests/test_ledger_stateful.py checks that against ``BlockLifecycle``;
- the hold and grant checks of the per-block state (``ledger.ledger_counts.LedgerCounts`` and
  ``ledger.engine_counts.EngineCounts``: ``check_hold``, ``check_grant``, ...): the block guards
  ``no_open_write_grant`` and ``write_needs_single_holder`` as refusals (``BlockUnavailable``)
  before anything changes.

Who may make each claim is checked before evidence reaches a guard (``kvlifetime.provenance``),
and what each engine's raw statuses prove is turned into evidence before it reaches the ledger
(``kvlifetime.profiles``): neither changes what a claim does once accepted.

This ``__init__`` imports nothing, so that importing one module of the package does not load
the others (``lifecycles`` loads python-statemachine).
"""
