"""Every decoder of the tree rejects malformed input with msgspec.DecodeError and nothing else: the
receivers drop and log exactly those (tests/e2e/test_socket_fuzz.py sends them over the sockets)."""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from engine.wire import protocol
from engine.wire import worker_messages as messages
from engine.wire.scheduler_output import ModelRunnerOutput, SchedulerOutput
from tests.malformed import ANY, DEPTH, FUZZ, encode, misshapen, nested_too_deep, oversized, struct_types

# each decoder, with real messages of its type
DECODERS = {
    "to_core": (protocol.to_core, [protocol.AbortRequests(["r1"]), protocol.Refused("no")]),
    "from_core": (protocol.from_core, [protocol.Ready(0, "i", 256, 8, 16), protocol.Failed(0, "x")]),
    "control": (protocol.control, [protocol.WorkersLost("x"), protocol.Shutdown()]),
    "coordinator_out": (protocol.coordinator_out, [protocol.LoadStats({0: [1, 2]}, 1.0)]),
    "to_coordinator": (protocol.to_coordinator,
                       [protocol.CoreLoad(0, 1, 2, 3), protocol.WaveReport(0, "e", 1, 2, True)]),
    "from_waves": (protocol.from_waves, [protocol.WaveGo("e", 1, 2, [0, 1]), protocol.WaveEnd("e", 1)]),
    "to_worker": (messages.to_worker, [messages.GroupEpoch("e"), messages.InitializeCache(8, "ring", "ipc://w"),
                                       messages.Shutdown()]),
    "from_ring": (messages.from_ring, [SchedulerOutput(step_id=1), messages.Shutdown()]),
    "from_worker": (messages.from_worker, [messages.JoinGroup("w", 1), ModelRunnerOutput(step_id=1),
                                           messages.CacheReady("w", 8, 64)]),
}


@pytest.mark.parametrize("name", DECODERS)
def test_a_message_nested_too_deep_is_a_decode_error(name):
    """msgspec itself raises RecursionError here; a receiver catching DecodeError would die of it."""
    decoder, samples = DECODERS[name]
    for sample in samples:
        raw = nested_too_deep(encode(sample), DEPTH[0])
        with pytest.raises(msgspec.DecodeError, match="nested deeper"):
            decoder.decode(raw)
        assert decoder.decode(nested_too_deep(encode(sample), 10)) == sample  # shallow: an ignored extra field


@pytest.mark.parametrize("name", DECODERS)
def test_any_input_decodes_or_is_a_decode_error(name):
    decoder, samples = DECODERS[name]
    types = struct_types(decoder)
    frame = st.one_of(st.binary(max_size=64), ANY.map(encode), st.sampled_from(types).flatmap(misshapen),
                      st.tuples(st.sampled_from([encode(s) for s in samples]), st.integers(0, 2 * DEPTH[0])).map(
                          lambda t: nested_too_deep(*t)))

    @FUZZ
    @given(frame)
    def check(raw):
        try:
            assert isinstance(decoder.decode(raw), types)
        except msgspec.DecodeError:
            pass

    check()
    for raw in oversized():
        with pytest.raises(msgspec.DecodeError):
            decoder.decode(raw)
