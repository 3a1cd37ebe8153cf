"""`StructuredOutputManager`: the engine core's grammars, one state per structured request.

The scheduler asks it whether a waiting request's grammar is ready (skipping
the request until it is, so that a compile never holds up the others), for
the bitmask of each step's structured rows, and to advance a request over
the token it sampled. Requests without structured_outputs never reach it.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from concurrent.futures import FIRST_COMPLETED, wait

from engine.structured.compiler import GrammarCompiler, GrammarError, PendingGrammar
from engine.structured.matcher import RequestGrammar, bitmask_bytes, rebuilt
from engine.wire.scheduler_output import GrammarBitmask


class StructuredOutputManager:
    """Compiles in the background, holds each request's RequestGrammar, fills step bitmasks."""

    def __init__(self, compiler: GrammarCompiler):
        self.compiler = compiler
        self.pending: dict[str, PendingGrammar] = {}
        self.grammars: dict[str, RequestGrammar] = {}

    def add(self, req_id: str, spec) -> None:
        """Start compiling a new request's grammar."""
        self.pending[req_id] = self.compiler.compile(spec)

    def is_ready(self, req_id: str, output_token_ids: Sequence[int], now: float | None = None) -> bool:
        """Whether the request's grammar state exists (built on the first call after its compile, from the
        tokens it already has); raises GrammarError when it failed, timed out or refuses those tokens."""
        if req_id in self.grammars:
            return True
        pending = self.pending.get(req_id)
        if pending is None:
            return True  # not a structured request
        compiled = pending.result(time.monotonic() if now is None else now)
        if compiled is None:
            return False
        del self.pending[req_id]
        grammar = rebuilt(compiled, output_token_ids, self.compiler.eos_token_ids)
        if grammar is None:
            raise GrammarError("the tokens this request already produced do not follow its grammar")
        self.grammars[req_id] = grammar
        return True

    def wait(self, timeout_s: float) -> None:
        """Block up to `timeout_s` for any pending compile (the core has nothing else to do)."""
        futures = [p.future for p in self.pending.values()]
        if futures:
            wait(futures, timeout=timeout_s, return_when=FIRST_COMPLETED)

    def has_pending(self) -> bool:
        return bool(self.pending)

    def bitmask(self, req_ids: Iterable[str]) -> GrammarBitmask | None:
        """The rows of those of `req_ids` that sample under a grammar this step, or None."""
        rows = [r for r in req_ids if r in self.grammars]
        if not rows:
            return None
        import xgrammar

        mask = xgrammar.allocate_token_bitmask(len(rows), self.compiler.vocab_size)
        for i, req_id in enumerate(rows):
            self.grammars[req_id].fill_bitmask(mask, i)
        return GrammarBitmask(rows, bitmask_bytes(mask))

    def accept(self, req_id: str, token_id: int) -> bool | None:
        """Advance over a sampled token: None for a request without a grammar, else whether accepted."""
        grammar = self.grammars.get(req_id)
        return None if grammar is None else grammar.accept((token_id,))

    def is_terminated(self, req_id: str) -> bool:
        grammar = self.grammars.get(req_id)
        return grammar is not None and grammar.is_terminated

    def free(self, req_id: str) -> None:
        self.pending.pop(req_id, None)
        self.grammars.pop(req_id, None)
