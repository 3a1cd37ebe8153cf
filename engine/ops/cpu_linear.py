"""Linear layers on the CPU through oneDNN, each weight packed once (what vLLM's CPU backend does).

F.linear hands an unpacked weight to MKL on every call. oneDNN with the
weight reordered once into its blocked layout is 1.2-1.7x faster for the
decoder's linears and 2-3x for the LM head at decode batch sizes (SmolLM2,
2 cores, batch 1/16/64: `python -m engine.ops.cpu_linear`). Float32 on the
CPU, and bfloat16 where the CPU computes it (avx512_bf16, AMX): there
oneDNN's packed bf16 kernels are 1.3-2.7x float32's at 1 row and 2.3-7x at
16-512 (an AMX Xeon, bench/gemm_shapes.py), and 1.0-1.3x bf16 F.linear's
at decode sizes; without such a CPU bfloat16 keeps F.linear, as does
anything else. VSUP_PACKED_LINEAR=0 turns it off.

A float32 model may pack its weights in bfloat16 (`--linear-dtype
bfloat16`): each linear then takes its rows cast to bfloat16 and gives
float32 back, while norms, attention and the KV cache stay float32 (what
torch.autocast does on the CPU).
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

BATCH_HINT = 16  # oneDNN picks its blocking for about this many rows; any number of rows works


def computes_bfloat16() -> bool:
    """Whether this CPU has bfloat16 arithmetic (avx512_bf16 or AMX), where oneDNN's bf16 kernels pay."""
    return torch.cpu._is_avx512_bf16_supported()


def enabled(weight: torch.Tensor, dtype: torch.dtype | None = None) -> bool:
    """Whether `weight` is packed, in `dtype` (default: its own)."""
    dtype = dtype or weight.dtype
    packs = dtype == torch.float32 or dtype == torch.bfloat16 and computes_bfloat16()
    return (packs and weight.device.type == "cpu" and torch.backends.mkldnn.is_available()
            and os.environ.get("VSUP_PACKED_LINEAR", "1") != "0")


def pack(weight: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """The weight [out, in] in oneDNN's layout, in `dtype` (default: its own), for `linear`."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().to(dtype or weight.dtype), BATCH_HINT)


def linear(x: torch.Tensor, weight: torch.Tensor, packed: torch.Tensor | None,
           bias: torch.Tensor | None = None, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """x W^T + b, through the packed weight when there is one, in `out_dtype` (default: x's). Rows of
    another dtype than the packed weight's are cast to it, the result to `out_dtype`, and the bias is
    added in that. (Without a packed weight, F.linear: x's dtype.)"""
    if packed is None:
        return F.linear(x, weight, bias)
    out_dtype = out_dtype or x.dtype
    if packed.dtype == x.dtype == out_dtype:
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
    y = torch.ops.mkldnn._linear_pointwise(x.to(packed.dtype), packed, None, "none", [], "").to(out_dtype)
    return y if bias is None else y.add_(bias)


if __name__ == "__main__":  # the figures in the docstring
    import time

    torch.set_num_threads(os.cpu_count() or 1)

    def per_call_ms(f, n=50):
        for _ in range(5):
            f()
        start = time.perf_counter()
        for _ in range(n):
            f()
        return (time.perf_counter() - start) / n * 1e3

    for rows in (1, 16, 64):
        for out_size, in_size in ((960, 576), (576, 576), (3072, 576), (576, 1536), (49152, 576)):
            x, w = torch.randn(rows, in_size), torch.randn(out_size, in_size)
            p = pack(w)
            torch.testing.assert_close(linear(x, w, p), F.linear(x, w), rtol=1e-4, atol=1e-4)
            plain, packed = per_call_ms(lambda: F.linear(x, w)), per_call_ms(lambda: linear(x, w, p))
            print(f"rows {rows:3d}  [{out_size:5d} x {in_size:4d}]  F.linear {plain:7.3f} ms  "
                  f"packed {packed:7.3f} ms  {plain / packed:4.2f}x")
