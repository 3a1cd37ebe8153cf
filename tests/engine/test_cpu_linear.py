"""Linears from oneDNN-packed weights (engine/ops/cpu_linear.py) against F.linear, in float32 and, where
the CPU computes bfloat16 (avx512_bf16, AMX), in bfloat16 and with bfloat16 weights under float32 rows
(--linear-dtype bfloat16)."""

import pytest
import torch
import torch.nn.functional as F

from engine.model.loader import load_model
from engine.ops import cpu_linear

BF16_CPU = cpu_linear.computes_bfloat16()


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


needs_bf16 = pytest.mark.skipif(not BF16_CPU, reason="this CPU has no avx512_bf16: no bfloat16 linears")


@needs_bf16
@pytest.mark.parametrize("rows", [1, 7, 64, 300])
def test_bfloat16_weights_under_float32_rows_give_float32_back(rows):
    torch.manual_seed(rows)
    weight, bias, x = torch.randn(200, 96), torch.randn(200), torch.randn(rows, 96)
    assert cpu_linear.enabled(weight, torch.bfloat16)
    packed = cpu_linear.pack(weight, torch.bfloat16)
    assert packed.dtype == torch.bfloat16
    for b in (None, bias):
        got = cpu_linear.linear(x, weight, packed, b)
        assert got.dtype == torch.float32 and got.shape == (rows, 200)
        want = F.linear(x.bfloat16(), weight.bfloat16()).float()  # rows and weights rounded, summed in float32
        want = want if b is None else want + b
        torch.testing.assert_close(got, want, rtol=2**-8, atol=1e-2)


@needs_bf16
def test_a_float32_model_with_bfloat16_linears(tiny_model):
    model = load_model(tiny_model("llama3"), dtype="float32", linear_dtype="bfloat16")  # q/k/v and o_proj biases
    layer = next(iter(model.model.layers.values()))
    assert model.dtype == torch.float32 and layer.input_layernorm.weight.dtype == torch.float32
    for linear in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj,
                   model.lm_head):
        assert linear.packed.dtype == torch.bfloat16
    assert layer.self_attn.qkv_proj.bias.dtype == torch.float32  # added after the linear, in float32


@needs_bf16
def test_a_bfloat16_linear_hands_its_own_rows_on_when_asked():
    """out_dtype=bfloat16: the rows oneDNN computed, not cast to float32 and back by the next linear."""
    torch.manual_seed(0)
    weight, x = torch.randn(200, 96), torch.randn(64, 96)
    packed = cpu_linear.pack(weight, torch.bfloat16)
    got = cpu_linear.linear(x, weight, packed, out_dtype=torch.bfloat16)
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, cpu_linear.linear(x, weight, packed).bfloat16())  # the same sums, rounded once
    assert cpu_linear.linear(x, weight, packed).dtype == torch.float32  # (by default: the rows' dtype)


@needs_bf16
def test_a_float32_model_with_bfloat16_linears_keeps_the_mlp_in_bfloat16(tiny_model):
    """Prefill through the Python loop: gate/up, SiLU and down in bfloat16 (no cast between them, as
    the C++ decode stack does), the residual and what the model returns in float32, and the result
    the same as with a cast around every linear, within bfloat16's rounding."""
    model = load_model(tiny_model("llama"), dtype="float32", linear_dtype="bfloat16")
    mlp = next(iter(model.model.layers.values())).mlp
    seen = {}
    mlp.down_proj.register_forward_hook(lambda mod, args, out: seen.update(down_in=args[0].dtype, down_out=out.dtype))
    x = torch.randn(20, model.config.hidden_size)
    out = mlp(x)
    assert seen == {"down_in": torch.bfloat16, "down_out": torch.bfloat16} and out.dtype == torch.bfloat16
    gate, up = cpu_linear.linear(x, mlp.gate_up_proj.weight, mlp.gate_up_proj.packed).chunk(2, dim=-1)
    cast_around = cpu_linear.linear(F.silu(gate) * up, mlp.down_proj.weight, mlp.down_proj.packed)
    torch.testing.assert_close(out.float(), cast_around, rtol=2e-2, atol=2e-2)


def test_bfloat16_linears_are_refused_where_they_cannot_run(tiny_model, monkeypatch):
    with pytest.raises(ValueError, match="for a float32 model"):
        load_model(tiny_model("llama"), dtype="float16", linear_dtype="bfloat16")
    monkeypatch.setattr(cpu_linear, "computes_bfloat16", lambda: False)
    with pytest.raises(ValueError, match="avx512_bf16 or AMX"):
        load_model(tiny_model("llama"), dtype="float32", linear_dtype="bfloat16")
