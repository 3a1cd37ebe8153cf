"""engine/ops' decoder stack (a decode step's layer loop in C++) against the Python loop it replaces:
the same hidden states, residuals and KV cache writes within float32 tolerance, over ragged batches,
contexts that end at a block's edge or one token into the next, sequences that share their first
blocks (prefix-cache hits), q/k/v and o_proj biases, a stage that starts from a residual, and the
steps it must leave to Python."""

from __future__ import annotations

import random

import pytest
import torch

from engine.model import decode_stack
from engine.model.attention import AttentionMetadata
from engine.model.loader import load_model
from engine.ops import cpu_linear
from tests.engine.cpu_kernels import built  # noqa: F401 (built: autouse)

BLOCK_SIZE = 16


def decode_batch(model, seq_lens: list[int], shared_blocks: int = 0, seed: int = 0, cache_dtype=torch.float32):
    """Random caches holding each sequence's context, and a decode step adding its last token."""
    gen = torch.Generator().manual_seed(seed)
    config = model.config
    needed = [-(-n // BLOCK_SIZE) for n in seq_lens]
    num_blocks = 1 + shared_blocks + sum(max(0, n - shared_blocks) for n in needed)
    free = list(range(1 + shared_blocks, num_blocks))
    random.Random(seed).shuffle(free)
    tables = [list(range(1, 1 + min(shared_blocks, n))) + [free.pop() for _ in range(max(0, n - shared_blocks))]
              for n in needed]
    shape = (num_blocks, BLOCK_SIZE, config.num_kv_heads, config.head_dim)
    caches = [(torch.randn(shape, generator=gen).to(cache_dtype), torch.randn(shape, generator=gen).to(cache_dtype))
              for _ in range(config.num_layers)]
    metadata = AttentionMetadata.build([n - 1 for n in seq_lens], [1] * len(seq_lens), tables, BLOCK_SIZE)
    input_ids = torch.randint(0, config.vocab_size, (len(seq_lens),), generator=gen)
    positions = torch.tensor([n - 1 for n in seq_lens])
    return input_ids, positions, caches, metadata


def copied(caches):
    return [(k.clone(), v.clone()) for k, v in caches]


@pytest.fixture
def python_loop(monkeypatch):
    """Run the code below with the layers' Python loop."""
    def switch():
        monkeypatch.setattr(decode_stack, "applies", lambda *args: False)
    return switch


@pytest.mark.parametrize("variant", ["llama", "llama3", "qwen2"])  # no bias; q/k/v and o_proj bias; q/k/v bias
@pytest.mark.parametrize("seq_lens,shared", [
    ([1], 0),  # a sequence's first token
    ([16, 17, 32, 33], 0),  # a block filled exactly, one token into the next
    ([5, 40, 1, 23, 64, 9, 17], 0),  # ragged, more sequences than threads
    ([33, 40, 48, 49], 2),  # prefix-cache hits: the first two blocks shared
])
@pytest.mark.parametrize("linear_dtype", [None, "bfloat16"])  # bfloat16: linears cast around, the rest float32
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16])  # bfloat16: --kv-cache-dtype
def test_the_stack_computes_what_the_python_loop_does(variant, seq_lens, shared, linear_dtype, cache_dtype,
                                                      tiny_model, python_loop, monkeypatch):
    if linear_dtype and not cpu_linear.computes_bfloat16():
        pytest.skip("this CPU has no avx512_bf16: no bfloat16 linears")
    model = load_model(tiny_model(variant), dtype="float32", linear_dtype=linear_dtype)
    input_ids, positions, caches, metadata = decode_batch(model, seq_lens, shared, cache_dtype=cache_dtype)
    runs, real_run = [], decode_stack.run
    monkeypatch.setattr(decode_stack, "run", lambda *args: runs.append(1) or real_run(*args))
    theirs_caches = copied(caches)
    ours = model(input_ids, positions, caches, metadata)
    assert runs == [1], "the decode step did not go through the stack"
    python_loop()
    theirs = model(input_ids, positions, theirs_caches, metadata)
    # the same casts on both sides; a float32 difference of the fused kernels can still round a bfloat16
    # input of the next linear the other way
    tol = 1e-5 if linear_dtype is None else 2e-2
    torch.testing.assert_close(ours, theirs, atol=tol, rtol=tol)
    tol = tol if cache_dtype == torch.float32 else max(tol, 1e-2)  # one rounding of K/V to bfloat16 may differ
    for (k, v), (k2, v2) in zip(caches, theirs_caches):  # this step's K/V written to the same slots
        assert k.dtype == cache_dtype
        torch.testing.assert_close(k, k2, atol=tol, rtol=tol)
        torch.testing.assert_close(v, v2, atol=tol, rtol=tol)



def test_a_stage_that_starts_from_a_residual(tiny_model):
    """A later pipeline stage gets (hidden, residual) from the one before: the stack adds that residual
    as the Python layers do."""
    model = load_model(tiny_model("llama"), dtype="float32")
    _, positions, caches, metadata = decode_batch(model, [7, 16, 30], seed=1)
    gen = torch.Generator().manual_seed(5)
    hidden, residual = (torch.randn(3, model.config.hidden_size, generator=gen) for _ in range(2))
    rope = model.model.rotary_emb(positions)
    layers = list(model.model.layers.values())
    stack = decode_stack.build(layers, model.config.rms_norm_eps)
    theirs_caches = copied(caches)
    with torch.inference_mode():
        ours = decode_stack.run(stack, hidden.clone(), residual.clone(), rope, caches, metadata)
        theirs = (hidden.clone(), residual.clone())
        for layer, kv_cache in zip(layers, theirs_caches):
            theirs = layer(rope, *theirs, kv_cache, metadata)
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_prefill_and_other_ranks_stay_in_python(tiny_model):
    model = load_model(tiny_model("llama"), dtype="float32")
    _, _, caches, decode = decode_batch(model, [5, 9])
    hidden = torch.zeros(2, model.config.hidden_size)
    assert decode_stack.applies(hidden, caches, decode, tp_size=1)
    mixed = AttentionMetadata.build([4, 0], [1, 8], [[1], [2]], BLOCK_SIZE)  # a decode and a prompt
    assert not decode_stack.applies(hidden, caches, mixed, tp_size=1)
    assert not decode_stack.applies(hidden, caches, decode, tp_size=2)  # collectives between the linears
    assert not decode_stack.applies(hidden.double(), caches, decode, tp_size=1)
    with pytest.raises(RuntimeError, match="one key and one value cache per layer"):
        with torch.inference_mode():
            decode_stack.run(model.model._decode_stack(hidden, caches, decode), hidden, None,
                             model.model.rotary_emb(torch.tensor([4, 8])), caches[:-1], decode)


def test_no_stack_without_packed_linears(tiny_model, monkeypatch):
    """VSUP_PACKED_LINEAR=0 (or a dtype oneDNN is not packed for): the Python loop runs."""
    monkeypatch.setenv("VSUP_PACKED_LINEAR", "0")
    model = load_model(tiny_model("llama"), dtype="float32")
    assert decode_stack.build(list(model.model.layers.values()), model.config.rms_norm_eps) is None
    input_ids, positions, caches, metadata = decode_batch(model, [3, 17])
    assert model(input_ids, positions, caches, metadata).shape == (2, model.config.hidden_size)
