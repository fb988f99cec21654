"""Who said it: the source every piece of evidence carries (README, "Who may prove what").

A claim is only as good as whoever makes it, so the ledger never reads a claim without its
source. There are two kinds:

- ``LOCAL``: this process's own adapters, clock, failure detector and fences. Evidence built in
  the process (``CancelReceived.of(grant)``, an adapter's ``TransferQuiesced``, a fence's
  ``AccessRevoked``) carries it by default.
- ``Source.peer(identity)``: a remote peer, named by the *transport* - the identity of the
  connection the bytes came in on (a ZeroMQ socket dedicated to that peer, a routing id bound at
  handshake, a TLS client certificate) - never by a name written inside the message. The only
  way from bytes to evidence (``evidence.from_dict``) requires it.

What each kind may claim is ``kvlifetime.provenance``.
"""

from __future__ import annotations

import enum

import attrs

from kvlifetime.errors import InvalidField


class SourceKind(enum.Enum):
    LOCAL = "local"
    """This process's own components: they may make every claim the rules allow locally."""
    PEER = "peer"
    """A remote peer, identified by the transport: it may speak only about its own grants."""


def _check_identity(_inst: object, _a: attrs.Attribute[str], v: object) -> None:
    if not isinstance(v, str) or not v or len(v) > 256:
        raise InvalidField(f"a source identity is a non-empty str of at most 256 chars: {v!r}")


@attrs.frozen(slots=True)
class Source:
    """Who asserted a piece of evidence. Frozen: a source is fixed where the evidence was made."""

    kind: SourceKind = attrs.field(validator=attrs.validators.instance_of(SourceKind))
    identity: str = attrs.field(validator=_check_identity)  # PEER: the transport's peer id

    @classmethod
    def peer(cls, identity: str) -> Source:
        """A remote peer, as the transport identifies the connection (not as it names itself)."""
        return cls(SourceKind.PEER, identity)

    @property
    def is_local(self) -> bool:
        return self.kind is SourceKind.LOCAL

    def __str__(self) -> str:
        return "local" if self.kind is SourceKind.LOCAL else f"peer:{self.identity}"

    @classmethod
    def parse(cls, text: object) -> Source:
        """The inverse of ``str()``: ``"local"`` or ``"peer:<identity>"`` (recorded logs)."""
        if text == "local":
            return LOCAL
        if isinstance(text, str) and text.startswith("peer:"):
            return cls.peer(text[5:])
        raise InvalidField(f"a source is 'local' or 'peer:<identity>', got {text!r}")


LOCAL = Source(SourceKind.LOCAL, "local")
"""The source of evidence made by this process itself."""
