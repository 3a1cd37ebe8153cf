"""Linears from oneDNN-packed weights (engine/ops/cpu_linear.py) against F.linear, in float32 and, where
the CPU computes bfloat16 (avx512_bf16, AMX), in bfloat16."""

import pytest
import torch
import torch.nn.functional as F

from engine.model.loader import load_model
from engine.ops import cpu_linear

BF16_CPU = torch.cpu._is_avx512_bf16_supported()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 7, 64, 300])
def test_a_packed_linear_gives_what_f_linear_gives(dtype, rows):
    if dtype == torch.bfloat16 and not BF16_CPU:
        pytest.skip("this CPU has no avx512_bf16: bfloat16 keeps F.linear")
    torch.manual_seed(rows)
    weight, bias = torch.randn(200, 96, dtype=dtype), torch.randn(200, dtype=dtype)
    x = torch.randn(rows, 96, dtype=dtype)
    assert cpu_linear.enabled(weight)
    packed = cpu_linear.pack(weight)
    for b in (None, bias):
        got, want = cpu_linear.linear(x, weight, packed, b), F.linear(x, weight, b)
        assert got.dtype == dtype and got.shape == (rows, 200)
        if dtype == torch.float32:
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        else:  # both sum in float32 and round once to bfloat16: at most one rounding apart
            torch.testing.assert_close(got.float(), want.float(), rtol=2**-8, atol=1e-2)


def test_a_bfloat16_model_runs_packed_linears_only_where_the_cpu_computes_bfloat16(tiny_model):
    model = load_model(tiny_model("llama"), dtype="bfloat16")
    qkv = next(iter(model.model.layers.values())).self_attn.qkv_proj
    assert (qkv.packed is not None) == BF16_CPU
    assert qkv.packed is None or qkv.packed.dtype == torch.bfloat16
