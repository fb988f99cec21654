"""One side of SGLang 0.5.23's PD disaggregation, in a process of its own (decode or prefill).

Everything that decides where KV bytes go is SGLang's own: the decode's ``DecodePreallocQueue``
and ``DecodeTransferQueue``, the prefill's ``PrefillBootstrapQueue``, ``MHATokenToKVPool`` on
CPU, the token and request allocators, the radix cache, ``MetadataBuffers``, the Mooncake
backend's manager / sender / receiver / bootstrap server, and Mooncake's transfer engine over TCP
on loopback. What cannot run on this machine is a model forward and a whole ``Scheduler`` (it
loads a model); the Scheduler's methods that drive the queues (``process_decode_queue``,
``abort_request``, ``process_disagg_prefill_inflight_queue``, ``send_kv_chunk``) run unbound on
a small stand-in object carrying the attributes they read. "The forward" is the prefill writing a
marker into the request's source pages.

The test talks to each side over a multiprocessing pipe: ``(command, kwargs)`` in, ``("ok",
result)`` or ``("error", traceback)`` out, one at a time, on the process's main thread (the
scheduler's thread in SGLang). SGLang's own threads (bootstrap, transfer workers, heartbeat) run
as they do in a server.

Test instrumentation, the same alone and guarded: ``sglang_transfer_gate.TransferGate`` on the
prefill's transfer engine, which can hold a transfer mid-flight.

This module is the process's entry (``serve``); the decode side is ``sglang_decode_side``, the
prefill side ``sglang_prefill_side``, what both share ``sglang_side``.
"""

from __future__ import annotations

import os
import traceback
from multiprocessing.connection import Connection
from typing import Any, Literal

# SGLang reads these when its modules load or its managers start: set before the sides import it.
os.environ.setdefault("SGLANG_HOST_IP", "127.0.0.1")
os.environ.setdefault("MOONCAKE_PROTOCOL", "tcp")
os.environ.setdefault("MC_FORCE_TCP", "1")

from sglang_decode_side import DecodeSide
from sglang_prefill_side import PrefillSide
from sglang_side import Side, elements_per_page

__all__ = ["DecodeSide", "PrefillSide", "elements_per_page", "serve"]


def serve(role: Literal["decode", "prefill"], conn: Connection, options: dict[str, Any]) -> None:
    """The child's entry point: build one side, then answer commands until ``close``."""
    for key, value in options.get("env", {}).items():
        os.environ[key] = str(value)
    try:
        guard = None
        if options.get("guarded"):
            from kvlifetime.integrations import sglang as kv_sglang

            guard = kv_sglang.install(role=role, **options.get("guard_options", {}))
        side: Side = (DecodeSide if role == "decode" else PrefillSide)(options, guard)
    except BaseException:
        conn.send(("error", traceback.format_exc()))
        return
    conn.send(("ok", {"pid": os.getpid()}))
    while True:
        try:
            command, kwargs = conn.recv()
        except EOFError:
            return
        if command == "close":
            conn.send(("ok", None))
            os._exit(0)  # SGLang's daemon threads and Mooncake's engine need no orderly exit
        try:
            result = getattr(side, command)(**kwargs)
        except BaseException:
            conn.send(("error", traceback.format_exc()))
        else:
            conn.send(("ok", result))
