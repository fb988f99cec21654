"""Per-rank ABORT tokens: what ties an ABORT_ACK to the prefill rank that was sent the ABORT.

SGLang's ABORT_ACK names its rank as a number written in the message, and SGLang's decode reads
every ACK from one ZeroMQ PULL socket, which carries no sender identity: one prefill rank can
end another rank's hold by ACKing in its name. Where both sides run the guard, the decode's
guard makes an unguessable token per rank each time it arms an ABORT generation; the hooks send
each rank its own token with its ABORT (one more frame, which SGLang's parser ignores), and the
prefill's guard echoes it in that rank's ACK (one more frame too). An ACK whose token is not the
one sent to the rank it names is unauthorized evidence. Without the prefill's guard no token
comes back, and an ACK rests on the word of whoever sent it (``signals.PROFILE``).

No SGLang import; no I/O.
"""

from __future__ import annotations

import collections
import secrets

TOKEN_BYTES = 16
TOKEN_CHARS = 2 * TOKEN_BYTES
_HEX = frozenset("0123456789abcdef")
_REMEMBERED = 65536  # tokens a prefill keeps to echo (an ACK may be sent again)

Endpoint = tuple[int, str, int, int]  # room, the decode's ACK ip and port, the ABORT generation


def new_token() -> str:
    """A fresh token: 128 bits from the OS's CSPRNG, as 32 lowercase hex characters."""
    return secrets.token_hex(TOKEN_BYTES)


def wire_token(value: object) -> str | None:
    """A token as it came off the wire or from a caller (a ``str`` or ASCII ``bytes`` of 32
    lowercase hex characters), as a plain ``str``; None when it is anything else."""
    if type(value) is bytes:
        try:
            value = value.decode("ascii")
        except UnicodeDecodeError:
            return None
    if not isinstance(value, str):
        return None
    text = str.__str__(value)  # the plain value, never through a subclass's __str__
    if len(text) != TOKEN_CHARS or not _HEX.issuperset(text):
        return None
    return text


def matches(sent: str | None, got: str) -> bool:
    """Whether ``got`` is the token ``sent`` (compared in constant time)."""
    return sent is not None and secrets.compare_digest(sent, got)


class EchoTable:
    """The prefill's side: the token each ABORT carried, by what its ACK will name (room, the
    decode's ACK endpoint, generation), the newest ``_REMEMBERED`` kept."""

    def __init__(self) -> None:
        self._tokens: collections.OrderedDict[Endpoint, str] = collections.OrderedDict()

    def put(self, endpoint: Endpoint, token: str) -> None:
        self._tokens[endpoint] = token
        self._tokens.move_to_end(endpoint)
        if len(self._tokens) > _REMEMBERED:
            self._tokens.popitem(last=False)

    def get(self, endpoint: Endpoint) -> str | None:
        return self._tokens.get(endpoint)
