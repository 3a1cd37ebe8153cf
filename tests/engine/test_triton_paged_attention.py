"""The paged-attention decode kernel against its torch reference, and the reference against a loop.

The kernel runs on CPU under the Triton interpreter. TRITON_INTERPRET has to
be set before triton is imported and would change every other test's triton,
so the kernel cases run together in one child process that has it set.
"""

from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from engine.ops.triton_paged_attention import paged_attention_decode_reference

REPO_ROOT = Path(__file__).resolve().parents[2]

# num_seqs, num_heads, num_kv_heads, head_dim, block_size, seq_lens, dtype
CASES = {
    "gqa1": (3, 4, 4, 64, 16, [1, 17, 33], "float32"),
    "gqa3": (4, 9, 3, 64, 16, [5, 16, 31, 47], "float32"),
    "gqa3-fp16": (2, 6, 2, 64, 16, [13, 29], "float16"),
    "padded-row-odd-dim": (3, 6, 2, 48, 8, [7, 0, 9], "float32"),
}


def make_inputs(num_seqs, num_heads, num_kv_heads, head_dim, block_size, seq_lens, dtype, seed=0):
    """Random caches, a query per sequence and scattered block tables; one case's tensors."""
    generator = torch.Generator().manual_seed(seed)
    dtype = getattr(torch, dtype)
    max_blocks = max(1, max(-(-n // block_size) for n in seq_lens)) + 1
    num_blocks = num_seqs * max_blocks + 3

    def randn(*shape):
        return torch.randn(*shape, generator=generator).to(dtype)
    key_cache = randn(num_blocks, block_size, num_kv_heads, head_dim)
    value_cache = randn(num_blocks, block_size, num_kv_heads, head_dim)
    query = randn(num_seqs, num_heads, head_dim)
    # scattered physical blocks, as after a while of allocating and freeing
    block_tables = torch.randperm(num_blocks, generator=generator)[:num_seqs * max_blocks]
    block_tables = block_tables.view(num_seqs, max_blocks).to(torch.int32)
    seq_lens = torch.tensor(seq_lens, dtype=torch.int32)
    return query, key_cache, value_cache, block_tables, seq_lens, head_dim ** -0.5


# the child gets make_inputs' source, so both processes build the same tensors
KERNEL_SCRIPT = "import torch\n" + inspect.getsource(make_inputs) + """
import json, sys
from engine.ops import triton_paged_attention as ops

if not ops.is_available():
    print(json.dumps({"skip": ops.unavailable_reason()}))
    sys.exit(0)
errors = {}
for name, case in json.loads(sys.argv[1]).items():
    inputs = make_inputs(*case)
    out = torch.full_like(inputs[0], float("nan"))
    result = ops.paged_attention_decode(*inputs, out=out)
    expected = ops.paged_attention_decode_reference(*inputs)
    assert result is out and result.dtype == expected.dtype, name
    errors[name] = (result.float() - expected.float()).abs().max().item()
print(json.dumps({"errors": errors}))
"""


def naive_decode_attention(query, key_cache, value_cache, block_tables, seq_lens, scale):
    """One sequence and one head at a time, token by token through the block table."""
    num_seqs, num_heads, head_dim = query.shape
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    out = torch.zeros(num_seqs, num_heads, head_dim)
    for seq in range(num_seqs):
        length = int(seq_lens[seq])
        if length == 0:
            continue
        slots = [(int(block_tables[seq, t // block_size]), t % block_size) for t in range(length)]
        for head in range(num_heads):
            kv_head = head // (num_heads // num_kv_heads)
            keys = torch.stack([key_cache[b, o, kv_head].float() for b, o in slots])
            values = torch.stack([value_cache[b, o, kv_head].float() for b, o in slots])
            weights = (keys @ query[seq, head].float() * scale).softmax(-1)
            out[seq, head] = weights @ values
    return out


@pytest.mark.parametrize("name", list(CASES))
def test_reference_matches_naive_attention(name):
    inputs = make_inputs(*CASES[name])
    expected = naive_decode_attention(*inputs)
    result = paged_attention_decode_reference(*inputs)
    tolerance = 2e-3 if inputs[0].dtype == torch.float16 else 1e-5
    assert result.dtype == inputs[0].dtype
    torch.testing.assert_close(result.float(), expected, atol=tolerance, rtol=tolerance)


def test_reference_rejects_mismatched_heads():
    query, key_cache, value_cache, block_tables, seq_lens, scale = make_inputs(*CASES["gqa1"])
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        paged_attention_decode_reference(query[:, :3], key_cache, value_cache, block_tables, seq_lens, scale)


def run_child(code: str, *args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code, *args], cwd=REPO_ROOT, text=True,
                          capture_output=True, env={**os.environ, **env}, timeout=240)


@pytest.fixture(scope="module")
def interpreter_errors() -> dict[str, float]:
    result = run_child(KERNEL_SCRIPT, json.dumps(CASES), TRITON_INTERPRET="1")
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    if "skip" in report:
        pytest.skip(f"the Triton interpreter cannot run the kernel here: {report['skip']}")
    return report["errors"]


@pytest.mark.parametrize("name", list(CASES))
def test_kernel_matches_reference_under_interpreter(interpreter_errors, name):
    tolerance = 2e-3 if CASES[name][-1] == "float16" else 1e-5
    assert interpreter_errors[name] < tolerance


COMPILE_SCRIPT = """
import json, sys
try:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from engine.ops.triton_paged_attention import _paged_attention_decode_kernel as kernel
except Exception as error:
    print(json.dumps({"skip": f"cannot compile ahead of time with this triton: {error}"}))
    sys.exit(0)
compiled = []
for dtype in ("fp32", "fp16", "bf16"):
    for queries_per_kv in (1, 3, 8):
        pointers = {"out_ptr", "query_ptr", "key_cache_ptr", "value_cache_ptr"}
        signature = {name: "constexpr" if name.isupper() else f"*{dtype}" if name in pointers
                     else "*i32" if name.endswith("_ptr") else "fp32" if name == "scale_log2" else "i32"
                     for name in kernel.arg_names}
        constants = {"QUERIES_PER_KV": queries_per_kv, "HEAD_DIM": 64, "BLOCK_SIZE": 16,
                     "PADDED_QUERIES": triton.next_power_of_2(queries_per_kv), "PADDED_DIM": 64}
        source = ASTSource(fn=kernel, signature=signature,
                           constexprs={(kernel.arg_names.index(k),): v for k, v in constants.items()})
        binary = triton.compile(source, target=GPUTarget("cuda", 90, 32))
        compiled.append(f"{dtype}/{queries_per_kv}:{'cubin' in binary.asm}")
print(json.dumps({"compiled": compiled}))
"""


def test_kernel_compiles_for_a_hopper_gpu(tmp_path):
    # the interpreter ignores what only the real compiler checks (layouts, shapes, types)
    result = run_child(COMPILE_SCRIPT, TRITON_CACHE_DIR=str(tmp_path))
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    if "skip" in report:
        pytest.skip(report["skip"])
    assert len(report["compiled"]) == 9 and all(entry.endswith("True") for entry in report["compiled"])


def test_module_imports_without_triton():
    code = """
import sys
sys.modules["triton"] = None  # makes `import triton` fail
from engine.ops import triton_paged_attention as ops
assert not ops.is_available()
print(ops.unavailable_reason())
try:
    ops.paged_attention_decode(None, None, None, None, None, 1.0)
except RuntimeError as error:
    print(error)
"""
    result = run_child(code)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "triton cannot be imported" in result.stdout
    assert "kernel cannot run" in result.stdout
