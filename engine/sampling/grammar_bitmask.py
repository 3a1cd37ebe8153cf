"""Grammar bitmasks on logits: tokens a request's grammar forbids get -inf before anything else.

A bitmask row is ceil(vocab / 32) int32 words; bit j of word w allows token
32 * w + j (xgrammar's layout). Pure torch: the workers never import xgrammar.
"""

from __future__ import annotations

import numpy as np
import torch

_BITS = torch.arange(32, dtype=torch.int32)


def bitmask_from_bytes(data: bytes, num_rows: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """[num_rows, words] int32 from the wire's little-endian bytes."""
    words = np.frombuffer(data, dtype="<i4").reshape(num_rows, -1)
    return torch.from_numpy(words.copy()).to(device)


def allowed_tokens(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[rows, vocab_size] bool: True where the row's bitmask allows the token."""
    bits = (bitmask[:, :, None] >> _BITS.to(bitmask.device)) & 1
    return bits.bool().reshape(bitmask.shape[0], -1)[:, :vocab_size]


def apply_grammar_bitmask(logits: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """A copy of `logits` [n, vocab] whose rows `rows` [m] keep only what `bitmask` [m, words] allows."""
    logits = logits.clone()
    allowed = allowed_tokens(bitmask, logits.shape[-1])
    logits[rows] = logits[rows].masked_fill(~allowed, float("-inf"))
    return logits
