"""Every message that crosses a process boundary, as msgspec structs (msgpack, never pickle).

The bottom layer: it imports nothing of the engine, and every role imports it
(docs/ARCHITECTURE.md, the wire).
"""
