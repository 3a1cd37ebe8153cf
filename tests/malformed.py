"""Hypothesis strategies of malformed messages: what a broken or hostile peer could put on a socket.

`payloads(decoder, samples)` draws one frame that `decoder` must reject:
random bytes, a real message (one of `samples`) cut short, msgpack of the
wrong type, a real tag with misshapen fields, or a real message with an
extra field nested past Python's recursion limit. Every draw is checked
against the decoder itself, so no draw is a valid message that a receiver
would obey. `frames(...)` groups one to three of them into one message.
"""

from __future__ import annotations

import json
import random
import typing

import msgspec
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st

encode = msgspec.msgpack.encode
DEPTH = (5000, 20000)  # nesting of the deep draws: five times Python's default recursion limit and more
OVERSIZED = 8 << 20    # bytes of the one oversized message every socket gets

# a few draws per socket, the same ones on every run
FUZZ = settings(max_examples=40, deadline=None, derandomize=True, database=None, phases=[Phase.generate],
                suppress_health_check=[HealthCheck.filter_too_much, HealthCheck.too_slow,
                                       HealthCheck.data_too_large])

INT = st.integers(-2**63, 2**64 - 1)  # what msgpack holds
ANY = st.recursive(
    st.none() | st.booleans() | INT | st.floats() | st.text(max_size=12) | st.binary(max_size=12),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6) | INT, inner, max_size=4),
    max_leaves=8)


def rejects(decoder, raw: bytes) -> bool:
    """Whether `decoder` refuses `raw` (by any exception: before a fix, some were not DecodeErrors)."""
    try:
        decoder.decode(raw)
    except Exception:
        return True
    return False


def struct_types(decoder) -> tuple[type, ...]:
    return typing.get_args(decoder.type) or (decoder.type,)


def misshapen(cls: type) -> st.SearchStrategy[bytes]:
    """`cls`'s tag with its fields (and others) holding anything."""
    config = cls.__struct_config__
    names = [f.encode_name for f in msgspec.structs.fields(cls)]
    if config.array_like:
        return st.lists(ANY, max_size=len(names) + 1).map(lambda values: encode([config.tag, *values]))
    keys = st.sampled_from(names) | st.text(max_size=6) if names else st.text(max_size=6)
    return st.dictionaries(keys, ANY, max_size=len(names) + 1).map(
        lambda fields: encode({**fields, config.tag_field: config.tag}))


def nested_too_deep(raw: bytes, depth: int) -> bytes:
    """The message `raw` (a fixmap or fixarray) with one more field: [[[...]]] `depth` levels deep."""
    head = raw[0]
    assert 0x80 <= head <= 0x9f, f"not a small map or array: {head:#x}"
    is_map, size = head < 0x90, (head & 0x0f) + 1
    if size <= 15:
        header = bytes([head + 1])
    else:  # past a fixmap's or fixarray's 15 entries: map 16 or array 16
        header = (b"\xde" if is_map else b"\xdc") + size.to_bytes(2, "big")
    return header + raw[1:] + (encode("zz") if is_map else b"") + b"\x91" * depth + b"\xc0"


def truncated(raw: bytes) -> st.SearchStrategy[bytes]:
    return st.integers(0, len(raw) - 1).map(lambda n: raw[:n])


def payloads(decoder, samples) -> st.SearchStrategy[bytes]:
    """One frame that `decoder` rejects; `samples` are valid messages of its type."""
    encoded = [encode(s) for s in samples]
    return st.one_of(
        st.binary(max_size=64),
        st.sampled_from(encoded).flatmap(truncated),
        ANY.map(encode),
        st.sampled_from(struct_types(decoder)).flatmap(misshapen),
        st.tuples(st.sampled_from(encoded), st.integers(*DEPTH)).map(lambda t: nested_too_deep(*t)),
    ).filter(lambda raw: rejects(decoder, raw))


def frames(decoder, samples) -> st.SearchStrategy[list[bytes]]:
    """One message of one to three frames, each rejected by `decoder`."""
    return st.lists(payloads(decoder, samples), min_size=1, max_size=3)


def oversized(seed: int = 0) -> list[bytes]:
    """Two OVERSIZED messages: random bytes, and msgpack of the wrong type (a bin of zeros)."""
    return [random.Random(seed).randbytes(OVERSIZED),
            b"\xc6" + OVERSIZED.to_bytes(4, "big") + bytes(OVERSIZED)]


# the supervisor's control socket: JSON lines

COMMANDS = ("ps", "stop", "restart")
JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=12),
                    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
                    max_leaves=8)


def is_command(data: bytes) -> bool:
    """Whether the control socket would take `data` (its first line) as a real command."""
    try:
        request = json.loads(data.split(b"\n", 1)[0] or b"{}")
    except (ValueError, RecursionError):
        return False
    return isinstance(request, dict) and request.get("cmd") in COMMANDS


def control_requests() -> st.SearchStrategy[bytes]:
    """What a client could write to the control socket that is no command."""
    return st.one_of(
        st.binary(max_size=64),
        JSON.map(lambda v: json.dumps(v).encode() + b"\n"),
        st.fixed_dictionaries({"cmd": JSON}, optional={"role": JSON, "dp": JSON}).map(
            lambda v: json.dumps(v).encode() + b"\n"),
        truncated(b'{"cmd": "ps"}\n'),
        st.integers(*DEPTH).map(lambda depth: b"[" * depth + b"\n"),
    ).filter(lambda data: not is_command(data))
