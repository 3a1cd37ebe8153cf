"""engine/ops' CPU argmax (the greedy token) against torch's: ties, NaN, -inf rows, strided rows."""

from __future__ import annotations

import pytest
import torch

from engine.sampling.sampler import greedy_tokens
from tests.engine.cpu_kernels import built  # noqa: F401 (autouse)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])  # (bfloat16 rounds many values to ties)
@pytest.mark.parametrize("rows", [1, 3, 64])
@pytest.mark.parametrize("size", [1, 7, 49152])
def test_greedy_tokens_equal_torch_argmax(rows, size, dtype):
    logits = torch.randn(rows, size, generator=torch.Generator().manual_seed(rows * size)).to(dtype)
    assert torch.equal(greedy_tokens(logits), logits.argmax(-1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_ties_nan_and_minus_inf_as_torch(dtype):
    logits = torch.zeros(5, 40, dtype=dtype)
    logits[0, [3, 17]] = 2.0  # a tie: the first
    logits[1, 30], logits[1, 5] = float("nan"), 9.0  # a NaN after the maximum wins
    logits[2, [8, 20]] = float("nan")  # the first NaN
    logits[3] = float("-inf")
    logits[4, 39] = float("inf")
    assert torch.equal(greedy_tokens(logits), logits.argmax(-1))


def test_rows_of_a_padded_vocabulary():
    padded = torch.randn(4, 100, generator=torch.Generator().manual_seed(1))
    logits = padded[:, :90]  # what the LM head returns when its shard is padded
    assert torch.equal(greedy_tokens(logits), logits.argmax(-1))
