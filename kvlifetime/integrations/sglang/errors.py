"""The SGLang integration's own errors, in kvlifetime's one exception tree (``UsageError``:
the caller's deployment asked for something the guard cannot keep). Nothing was changed or
wrapped when one of them is raised."""

from __future__ import annotations

from kvlifetime.errors import InvalidField, UsageError


class UnsupportedEngineVersion(UsageError):
    """The installed SGLang is not the version the hooks were built for.
    The hooks were built and tested for one version: its release points (the functions the hooks
    wrap, and what each one frees) may have moved, so wrapping them could guard nothing while
    looking installed. Whose fault: the deployment. State left: nothing wrapped."""

    kind = "unsupported_engine_version"


class UnsupportedEngineSetting(UsageError):
    """An SGLang setting the guard cannot work with.
    Deferred decode KV release turned off: SGLang then frees a failed transfer's pages at once
    and never counts ABORT_ACKs. Whose fault: the deployment. State left: nothing wrapped."""

    kind = "unsupported_engine_setting"


class GuardNotBound(UsageError):
    """The guard's ledger was used before its size was known.
    ``bind`` sets it; the hooks bind it from SGLang's KV allocator when the first disaggregation
    queue is built. Whose fault: the caller. State left: unchanged."""

    kind = "guard_not_bound"


class AlreadyInstalled(UsageError):
    """``install`` called while the hooks are installed.
    Call ``uninstall`` first. Whose fault: the caller. State left: the hooks installed earlier,
    unchanged."""

    kind = "already_installed"


class MalformedEngineValue(InvalidField):
    """A value read from SGLang breaks SGLang's own contract.
    A ``bootstrap_room`` that is not an int in ``[0, 2**64)`` (None, a str, a float, a bool, a
    negative or too large int): the guard cannot key a lifecycle by it, and SGLang's prefill
    cannot parse it back off the wire. Whose fault: whoever sent the request (a client or
    router sets the room). State left: unchanged; the request is failed as SGLang fails a bad
    request, before anything is allocated or exposed."""

    kind = "malformed_engine_value"
