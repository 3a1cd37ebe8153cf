"""The default model (SmolLM2-135M-Instruct) through our loader and paged cache, against transformers."""

import pytest
import torch

from engine.model.attention import AttentionMetadata, allocate_kv_caches
from engine.model.default_model import default_model_dir
from engine.model.loader import load_model
from engine.ops import cpu_linear
from engine.worker.worker import Worker, WorkerConfig

from .test_worker import drive  # noqa: E402  (the test core that feeds a Worker)

PROMPTS = {
    "short": [1, 504, 3458, 314, 260, 3575, 282, 4649, 47],
    "chat": [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3511, 308, 34519, 28, 7018, 411, 407, 19712, 8182,
             2, 198, 1, 4093, 198, 1780, 314, 260, 3575, 282, 4649, 47, 2, 198, 1, 520, 9531, 198],
    "long": list(range(1000, 1200)),
}


@pytest.fixture(scope="module")
def model_dir():
    return default_model_dir()


def test_logits_match_transformers(model_dir):
    from transformers import AutoModelForCausalLM

    prompt = PROMPTS["chat"]
    ours = load_model(model_dir, dtype="float32")
    caches = allocate_kv_caches(ours.config, ours.groups, num_blocks=8, block_size=16)
    metadata = AttentionMetadata.build([0], [len(prompt)], [list(range(8))], 16)
    ids = torch.tensor(prompt)
    hidden = ours(ids, torch.arange(len(prompt)), caches, metadata)
    logits = ours.compute_logits(hidden)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        expected = hf(ids[None]).logits[0]
    assert (logits - expected).abs().max() <= 1e-4 * expected.abs().max()


def test_greedy_32_tokens_equal_transformers(model_dir, hf_greedy):
    worker = Worker(WorkerConfig(model=str(model_dir), kv_cache_bytes=64 << 20, block_size=16))
    worker.init_device()
    worker.load_model()
    worker.initialize_cache(worker.ready_report().num_blocks)
    outputs = drive(worker.execute, PROMPTS, 32, chunk=48, block_size=16)
    assert outputs == hf_greedy(model_dir, {k: (p, 32) for k, p in PROMPTS.items()})


def test_a_bfloat16_kv_cache_holds_twice_the_blocks_and_keeps_greedy_outputs(model_dir, hf_greedy):
    """--kv-cache-dtype bfloat16: K and V rounded as they are stored; the same bytes hold twice the blocks, and
    prefill, chunked prefill and the decode stack over the rounded cache still give transformers' tokens here."""
    def worker_of(kv_cache_dtype):
        worker = Worker(WorkerConfig(model=str(model_dir), kv_cache_dtype=kv_cache_dtype, kv_cache_bytes=64 << 20,
                                     block_size=16))
        worker.init_device()
        worker.load_model()
        return worker

    rounded, exact = worker_of("bfloat16"), worker_of(None)
    assert rounded.ready_report().num_blocks == 2 * exact.ready_report().num_blocks
    rounded.initialize_cache(rounded.ready_report().num_blocks)
    assert {t.dtype for pair in rounded.runner.kv_caches for t in pair} == {torch.bfloat16}
    outputs = drive(rounded.execute, PROMPTS, 16, chunk=48, block_size=16)
    assert outputs == hf_greedy(model_dir, {k: (p, 16) for k, p in PROMPTS.items()})


@pytest.mark.skipif(not cpu_linear.computes_bfloat16(), reason="this CPU has no avx512_bf16")
def test_bfloat16_linears_stay_near_transformers(model_dir, hf_logits):
    """--linear-dtype bfloat16 rounds the linears' inputs and weights: its logits are near float32's, not
    equal, and the next token is mostly the same; prefill and the decode stack both run it."""
    prompt = PROMPTS["chat"]
    worker = Worker(WorkerConfig(model=str(model_dir), linear_dtype="bfloat16", kv_cache_bytes=64 << 20,
                                 block_size=16))
    worker.init_device()
    worker.load_model()
    model = worker.runner.model
    caches = allocate_kv_caches(model.config, model.groups, num_blocks=8, block_size=16)
    metadata = AttentionMetadata.build([0], [len(prompt)], [list(range(8))], 16)
    logits = model.compute_logits(model(torch.tensor(prompt), torch.arange(len(prompt)), caches, metadata))
    expected = hf_logits(model_dir, prompt)
    error = ((logits - expected).abs().max() / expected.abs().max()).item()
    same_next = (logits.argmax(-1) == expected.argmax(-1)).float().mean().item()
    assert error < 0.05 and same_next > 0.9, (error, same_next)
    worker.initialize_cache(worker.ready_report().num_blocks)
    outputs = drive(worker.execute, PROMPTS, 8, chunk=48, block_size=16)
    # Greedy over rounded logits may take the runner-up where transformers' two best are nearly tied (the chat
    # prompt's first token: 25.33 against 25.24 in float32, both 25.125 in bfloat16 on a CPU without AMX). So
    # each token ours picked is one transformers, fed the same tokens, puts within 2% of its best logit.
    for key, prompt in PROMPTS.items():
        tokens = outputs[key]
        assert len(tokens) == 8
        steps = hf_logits(model_dir, prompt + tokens)[len(prompt) - 1:-1]
        best = steps.max(-1).values
        picked = steps[torch.arange(8), torch.tensor(tokens)]
        assert ((best - picked) <= 0.02 * best.abs()).all(), (key, tokens, (best - picked).tolist())


def test_the_default_bfloat16_parts_answer_the_same_from_a_chunked_prefill(model_dir, hf_logits):
    """vsup's default on a CPU with avx512_bf16, both bfloat16 parts together (linears and KV cache; the tests
    above take one each): the whole prompt in one step, and in small chunks after cached tokens (what a
    prefix-cache hit runs: the last chunk 5 tokens), each give tokens that transformers, fed the same tokens,
    puts within 2% of its best logit."""
    if not cpu_linear.computes_bfloat16():
        pytest.skip("this CPU has no avx512_bf16: the default is float32 there")
    worker = Worker(WorkerConfig(model=str(model_dir), linear_dtype="bfloat16", kv_cache_dtype="bfloat16",
                                 kv_cache_bytes=64 << 20, block_size=16))
    worker.init_device()
    worker.load_model()
    worker.initialize_cache(worker.ready_report().num_blocks)
    prompt = PROMPTS["chat"]  # 37 tokens: chunks of 16, 16 and 5
    for chunk in (64, 16):
        tokens = drive(worker.execute, {f"chat-{chunk}": prompt}, 12, chunk=chunk, block_size=16)[f"chat-{chunk}"]
        steps = hf_logits(model_dir, prompt + tokens)[len(prompt) - 1:-1]
        best = steps.max(-1).values
        picked = steps[torch.arange(12), torch.tensor(tokens)]
        assert ((best - picked) <= 0.02 * best.abs()).all(), (chunk, tokens, (best - picked).tolist())
