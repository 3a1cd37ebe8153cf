"""The Triton paged-attention kernel compiled for the GPU, against its torch path on the same GPU.

tests/engine/test_triton_paged_attention.py runs the kernel under Triton's interpreter and only
compiles it for Hopper; here it runs for real, on its own small cases and on serving-sized ones
(the default model's GQA 3 with 64 sequences up to 2,000 tokens, a Llama-8B-like GQA 4 at
head_dim 128, a block size of 32), in every dtype the engine serves.
"""

from __future__ import annotations

import os
import random

import pytest
import torch

from engine.ops import triton_paged_attention as ops
from tests.engine.test_triton_paged_attention import CASES, make_inputs

_lens = random.Random(0)
# num_seqs, num_heads, num_kv_heads, head_dim, block_size, seq_lens, dtype
GPU_CASES = {
    **CASES,
    **{f"smollm2-64seqs-{dtype}": (64, 9, 3, 64, 16, [_lens.randint(1, 2000) for _ in range(64)], dtype)
       for dtype in ("float32", "bfloat16", "float16")},
    "llama8b-gqa4-bf16": (8, 32, 8, 128, 16, [1, 15, 16, 17, 255, 256, 1000, 3001], "bfloat16"),
    "block32-fp32": (5, 8, 8, 64, 32, [1, 31, 32, 33, 700], "float32"),
}
# what a dtype's rounding of the output allows (torch.testing's defaults for the half types)
TOLERANCE = {"float32": (2e-5, 2e-5), "float16": (1e-5, 1e-3), "bfloat16": (1e-5, 1.6e-2)}


@pytest.fixture(scope="module")
def errors(cuda, figures):
    """Run every case once; {case: max |kernel - torch path|}, written to the figures."""
    assert os.environ.get("TRITON_INTERPRET") != "1", "the kernel must run compiled, not under the interpreter"
    assert ops.is_available(), ops.unavailable_reason()
    results, found = {}, {}
    for name, case in GPU_CASES.items():
        inputs = [x.to(cuda) if isinstance(x, torch.Tensor) else x for x in make_inputs(*case)]
        out = torch.full_like(inputs[0], float("nan"))
        result = ops.paged_attention_decode(*inputs, out=out)
        expected = ops.paged_attention_decode_reference(*inputs)
        torch.cuda.synchronize()
        found[name] = (result, expected)
        results[name] = (result.float() - expected.float()).abs().max().item()
    figures("cuda_kernel_errors", {"max_abs_error": results, "device": torch.cuda.get_device_name(cuda),
                                   "triton": getattr(ops.triton, "__version__", None)})
    return found


@pytest.mark.parametrize("name", list(GPU_CASES))
def test_kernel_matches_the_torch_path_on_the_gpu(errors, name):
    result, expected = errors[name]
    assert result.is_cuda and result.dtype == expected.dtype and not result.isnan().any()
    atol, rtol = TOLERANCE[GPU_CASES[name][-1]]
    torch.testing.assert_close(result, expected, atol=atol, rtol=rtol)


def test_times_of_the_kernel_and_the_torch_path(cuda, figures):
    # a figure, not a promise (no test asserts a speed): what the kernel saves over gathering every block
    case = GPU_CASES["smollm2-64seqs-bfloat16"]
    inputs = [x.to(cuda) if isinstance(x, torch.Tensor) else x for x in make_inputs(*case)]

    def median_ms(fn, repeats=30):
        fn()
        times = []
        for _ in range(repeats):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        return sorted(times)[len(times) // 2]

    kernel = median_ms(lambda: ops.paged_attention_decode(*inputs))
    reference = median_ms(lambda: ops.paged_attention_decode_reference(*inputs))
    figures("cuda_kernel_time", {"case": "smollm2-64seqs-bfloat16", "kernel_ms": kernel, "torch_path_ms": reference,
                                 "torch_path_over_kernel": reference / kernel})
    assert kernel > 0 and reference > 0
