"""The scheduler's limits, one dataclass that checks itself."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class SchedulerConfig:
    """Batch limits, KV cache shape and stop rules shared by every request of one engine core.

    `num_blocks` is what the workers found room for; `eos_token_id` is the
    model's end-of-sequence id (some models have several), None for none.
    """

    num_blocks: int
    block_size: int = 16
    max_model_len: int = 2048
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    enable_prefix_caching: bool = True
    eos_token_id: int | Sequence[int] | None = None

    def __post_init__(self) -> None:
        for name in ("num_blocks", "block_size", "max_model_len", "max_num_seqs",
                     "max_num_batched_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")

    @property
    def eos_token_ids(self) -> frozenset[int]:
        """The end-of-sequence ids as a set: empty, one, or several."""
        if self.eos_token_id is None:
            return frozenset()
        if isinstance(self.eos_token_id, int):
            return frozenset((self.eos_token_id,))
        return frozenset(self.eos_token_id)
