"""msgpack decoding as every socket of the tree does it: a malformed message is always a DecodeError.

msgspec raises RecursionError, not DecodeError, on msgpack nested deeper than
Python's recursion limit, even in a field it would skip: a 1 KB message
(`{"type": "shutdown", "x": [[[...]]]}`) would kill a receiver that drops only
DecodeErrors, and stop an API server's receive task for good. Every decoder
of protocol.py and worker_messages.py is one of these.
"""

from __future__ import annotations

import msgspec


class Decoder:
    """msgspec.msgpack.Decoder(type) whose every rejection is a msgspec.DecodeError."""

    def __init__(self, type):
        self.type = type
        self._decoder = msgspec.msgpack.Decoder(type)

    def decode(self, buf):
        try:
            return self._decoder.decode(buf)
        except RecursionError:
            raise msgspec.DecodeError("malformed msgpack: nested deeper than the recursion limit") from None

    def decode_or_drop(self, buf, log, **context):
        """The message in `buf`, or None when it is malformed: then it is logged on `log` (with `context`,
        say the sender) and dropped, so that no stranger's bytes can end the receiver."""
        try:
            return self.decode(buf)
        except msgspec.DecodeError as e:
            log.warning("dropped malformed message", error=str(e), nbytes=len(buf), **context)
            return None
