"""Asking the supervisor over its control socket (vsup/supervisor/control.py serves it): what `vsup ps`,
`stop` and `restart` import, and nothing more, so that they start fast."""

from __future__ import annotations

import json
import os


def request(path: str, cmd: str, timeout: float = 5.0, **fields) -> dict:
    """Ask the supervisor `cmd` (the fields of messages.ControlRequest, which the supervisor decodes: the
    client spares itself msgspec's import); raises OSError when none listens there."""
    if not os.path.exists(path):  # none has run, or it is gone: `vsup ps` then spares the socket module
        raise FileNotFoundError(f"no control socket at {path}")
    import socket

    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(timeout)
        sock.connect(path)
        sock.sendall((json.dumps({"cmd": cmd, **fields}) + "\n").encode())
        return json.loads(sock.makefile().readline())
