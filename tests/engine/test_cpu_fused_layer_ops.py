"""engine/ops' fused CPU layer kernels (norm + residual, rotary, SiLU-and-mul, the KV write)
against the plain-torch code they replace, and the fallback when the kernels cannot be built."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from engine.distributed import ParallelGroups
from engine.model.attention import AttentionMetadata, write_kv
from engine.model.layers import RMSNorm, RotaryEmbedding, rotate
from engine.ops import cpu_extension
from tests.engine.cpu_kernels import built, spy  # noqa: F401 (built: autouse)

GEN = torch.Generator().manual_seed(0)


def randn(*shape):
    return torch.randn(*shape, generator=GEN)


@pytest.fixture
def plain_torch(monkeypatch):
    """Run the code below as if the kernels could not be built."""
    def switch():
        monkeypatch.setattr(cpu_extension, "is_available", lambda tensor: False)
    return switch


@pytest.fixture
def two_threads():
    """torch on two threads (pytest's workers run one each), so that large enough rows are split."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize("rows", [1, 7, 64])
def test_add_rms_norm_equals_add_then_rms_norm(rows, plain_torch, two_threads):
    norm = RMSNorm(576, 1e-5, ParallelGroups.single(), torch.float32)
    norm.weight.data.copy_(randn(576))
    x, residual = randn(rows, 576), randn(rows, 576) * 3
    out, new_residual = norm(x.clone(), residual.clone())
    plain_torch()
    expected, expected_residual = norm(x, residual)
    torch.testing.assert_close(new_residual, expected_residual)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("tokens", [1, 5, 33])
def test_rotary_in_place_equals_the_torch_rotation(tokens, plain_torch):
    rope = RotaryEmbedding(64, 4096, 10000.0, None, ParallelGroups.single(), torch.float32)
    positions = torch.randint(0, 4096, (tokens,), generator=GEN)
    # q and k heads of the fused projection's output, as the model rotates them: a strided view
    qkv = randn(tokens, (9 + 3 + 3) * 64)
    qk = qkv[:, :12 * 64].view(tokens, 12, 64)
    v_before = qkv[:, 12 * 64:].clone()
    expected_input = qk.clone()
    out = rotate(qk, rope(positions))
    assert out.data_ptr() == qk.data_ptr()
    torch.testing.assert_close(qkv[:, 12 * 64:], v_before)  # v untouched
    plain_torch()
    expected = rotate(expected_input, rope(positions))
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("rows", [1, 3, 64])
def test_silu_and_mul_equals_silu_times_up(rows, two_threads):
    gate_up = randn(rows, 2 * 1536) * 8  # large |gate| too: e^-g must neither overflow nor lose silu's sign
    gate_up[0, :4] = torch.tensor([0.0, -100.0, 100.0, -1e-3])
    out = torch.empty(rows, 1536)
    torch.ops.vsup_cpu.silu_and_mul(gate_up, out)
    gate, up = gate_up.chunk(2, dim=-1)
    torch.testing.assert_close(out, F.silu(gate) * up, atol=1e-5, rtol=1e-5)


BF16_ROUNDING = dict(rtol=2**-7, atol=1e-3)  # a float32 difference may round a bfloat16 the other way: one step


@pytest.mark.parametrize("x_dtype,out_dtype", [(torch.bfloat16, torch.bfloat16), (torch.float32, torch.bfloat16),
                                               (torch.bfloat16, torch.float32)])
def test_silu_and_mul_reads_and_writes_bfloat16_rows(x_dtype, out_dtype):
    """The rows of bfloat16 linears (--linear-dtype bfloat16): widened as read, the math in float32, rounded
    to nearest even as written, as torch's casts around the float32 kernel would."""
    gate_up = (randn(64, 2 * 1536) * 8).to(x_dtype)
    gate_up[0, :3] = torch.tensor([float("nan"), -100.0, 100.0])
    out = torch.empty(64, 1536, dtype=out_dtype)
    torch.ops.vsup_cpu.silu_and_mul(gate_up, out)
    gate, up = gate_up.float().chunk(2, dim=-1)
    expected = (F.silu(gate) * up).to(out_dtype)
    assert out[0, 0].isnan()  # a NaN stays one
    torch.testing.assert_close(out[:, 1:].float(), expected[:, 1:].float(), **BF16_ROUNDING)
    if out_dtype == torch.bfloat16:  # rounded as torch rounds, but for the odd float32 difference
        assert (out[:, 1:] == expected[:, 1:]).float().mean() > 0.99


def test_add_rms_norm_of_bfloat16_rows_keeps_a_float32_residual():
    weight, x, residual = randn(576), randn(64, 576).bfloat16(), randn(64, 576) * 3
    expected_residual = residual + x.float()
    expected = (expected_residual * torch.rsqrt(expected_residual.pow(2).mean(-1, keepdim=True) + 1e-5) * weight)
    torch.ops.vsup_cpu.add_rms_norm_(x, residual, weight, 1e-5)
    torch.testing.assert_close(residual, expected_residual)
    assert x.dtype == torch.bfloat16
    torch.testing.assert_close(x.float(), expected.bfloat16().float(), **BF16_ROUNDING)


@pytest.mark.parametrize("block_size", [1, 16])
def test_write_kv_stores_rows_where_index_copy_does(block_size, plain_torch, monkeypatch):
    # slots at a block's end and at the start of the next, from two sequences sharing a first block
    metadata = AttentionMetadata.build([15, 16, 3], [1, 2, 1], [[2, 5], [2, 7], [4]], block_size=16)
    num_blocks = 8 * 16 // block_size
    qkv = randn(4, 5 * 2 * 64)
    key = qkv[:, :5 * 64].view(4, 5, 64)[:, 1:3]  # a strided view, as the model's k
    value = qkv[:, 5 * 64:].view(4, 5, 64)[:, :2].contiguous()
    caches = [torch.zeros(num_blocks, block_size, 2, 64) for _ in range(4)]
    calls = spy(monkeypatch, "write_kv")
    write_kv(key, value, caches[0], caches[1], metadata.slot_mapping)
    assert calls == ["write_kv"]
    plain_torch()
    write_kv(key, value, caches[2], caches[3], metadata.slot_mapping)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])


def test_write_kv_of_a_decode_batch_on_two_threads_stores_every_row(two_threads):
    # 64 new rows (past the grain where the threads share them), each into a random slot
    slots = torch.randperm(32 * 16)[:64]
    qkv = randn(64, 9 * 64)
    key, value = qkv[:, :3 * 64].view(64, 3, 64), qkv[:, 6 * 64:].view(64, 3, 64)
    key_cache, value_cache = torch.zeros(32, 16, 3, 64), torch.zeros(32, 16, 3, 64)
    torch.ops.vsup_cpu.write_kv(key, value, key_cache, value_cache, slots)
    assert torch.equal(key_cache.view(-1, 3, 64)[slots], key) and torch.equal(value_cache.view(-1, 3, 64)[slots], value)
    untouched = torch.ones(32 * 16, dtype=torch.bool)
    untouched[slots] = False
    assert not key_cache.view(-1, 3, 64)[untouched].any() and not value_cache.view(-1, 3, 64)[untouched].any()


def test_write_kv_rejects_a_slot_outside_the_cache():
    cache = torch.zeros(2, 16, 2, 64)
    with pytest.raises(RuntimeError, match="slot out of range"):
        torch.ops.vsup_cpu.write_kv(randn(1, 2, 64), randn(1, 2, 64), cache, cache.clone(), torch.tensor([32]))


def test_a_failed_build_leaves_plain_torch(monkeypatch):
    from torch.utils import cpp_extension

    def fail(**kwargs):
        raise RuntimeError("no compiler")
    monkeypatch.setenv("PATH", os.environ["PATH"])  # load() may put pip's ninja on it
    monkeypatch.setattr(cpp_extension, "load", fail)
    assert cpu_extension.load.__wrapped__() is False
    monkeypatch.setattr(cpp_extension, "load", lambda **kwargs: None)  # a build that works ...
    assert cpu_extension.load.__wrapped__() is True
    monkeypatch.setenv("VSUP_CPU_KERNELS", "0")  # ... is not even tried when switched off
    assert cpu_extension.load.__wrapped__() is False



def test_every_process_builds_with_the_ninja_beside_its_python(monkeypatch, tmp_path):
    """Another ninja first on the PATH (a system's 1.11) hashes the build commands otherwise than pip's:
    a worker that used it would rebuild the whole extension, and the next one with pip's again."""
    import shutil
    import sysconfig

    other = tmp_path / "ninja"
    other.write_text("#!/bin/sh\nexit 1\n")
    other.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    cpu_extension._put_ninja_on_path()
    assert shutil.which("ninja") == os.path.join(sysconfig.get_path("scripts"), "ninja")
    first = os.environ["PATH"]
    cpu_extension._put_ninja_on_path()
    assert os.environ["PATH"] == first  # not put first twice
