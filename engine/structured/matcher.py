"""`RequestGrammar`: one request's place in its grammar, advanced by the tokens it samples.

The engine core holds one per structured request. Its state is a function of
the request's output tokens alone, so a preempted request keeps it and a
request resubmitted with the tokens produced so far rebuilds it from them.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np


class RequestGrammar:
    """A GrammarMatcher over a compiled grammar, and what it has accepted."""

    def __init__(self, compiled, eos_token_ids: Iterable[int] = ()):
        import xgrammar

        stop = sorted(eos_token_ids)
        self.matcher = xgrammar.GrammarMatcher(compiled, override_stop_tokens=stop or None)
        self.num_accepted = 0

    def accept(self, token_ids: Iterable[int]) -> bool:
        """Advance over `token_ids`; False (and no further) at the first one the grammar refuses."""
        for token_id in token_ids:
            if self.is_terminated or not self.matcher.accept_token(token_id):
                return False
            self.num_accepted += 1
        return True

    @property
    def is_terminated(self) -> bool:
        """The grammar is complete and its stop token (EOS) was accepted: the request is done."""
        return self.matcher.is_terminated()

    def fill_bitmask(self, bitmask, row: int) -> None:
        """Write which tokens may come next into row `row` of an xgrammar bitmask tensor."""
        self.matcher.fill_next_token_bitmask(bitmask, row)


def rebuilt(compiled, output_token_ids: Iterable[int], eos_token_ids: Iterable[int] = ()) -> RequestGrammar | None:
    """A grammar state that has accepted `output_token_ids` (a resubmitted request's tokens so far);
    None if the grammar refuses them."""
    grammar = RequestGrammar(compiled, eos_token_ids)
    return grammar if grammar.accept(output_token_ids) else None


def bitmask_bytes(bitmask) -> bytes:
    """The wire form (engine.wire.scheduler_output.GrammarBitmask) of an int32 bitmask tensor."""
    return np.ascontiguousarray(bitmask.numpy(), dtype="<i4").tobytes()
