"""The vLLM integration's own errors, in kvlifetime's one exception tree (``UsageError``: the
deployment asked for something the guard cannot keep). Nothing is built or patched when one of
them is raised. Importable without vLLM."""

from __future__ import annotations

from kvlifetime.errors import UsageError


class UnsupportedEngineVersion(UsageError):
    """The installed vLLM is not one whose engine facts kvlifetime holds.
    The guard leans on private details of vLLM's scheduler, kept per version in one engine-facts
    module (``facts_v0_33``): another version, or a build where one of those details has moved,
    could leave the guard looking installed while it guards nothing or breaks vLLM's scheduler.
    The message names the installed and the supported versions, or the facts not found. Whose
    fault: the deployment. State left: nothing built or patched."""

    kind = "unsupported_vllm_version"


__all__ = ["UnsupportedEngineVersion"]
