"""The sampler: greedy is argmax, seeds are per request, filters and penalties as in vLLM."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.sampling.sampler import Sampler, SamplingMetadata, apply_top_k_top_p, make_generator, needs_only_argmax
from engine.wire.sampling_params import SamplingParams

REPO_ROOT = Path(__file__).resolve().parents[2]
VOCAB = 50


def sample(logits, params, outputs=None, generators=None, **kwargs):
    outputs = outputs if outputs is not None else [[] for _ in params]
    metadata = SamplingMetadata.from_params(params, outputs, generators, **kwargs)
    return Sampler()(logits, metadata)


def random_logits(rows, vocab=VOCAB, seed=0):
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 3


# params

def test_defaults_validate_and_round_trip_as_json():
    params = SamplingParams(temperature=0.5, seed=7, stop_token_ids=(3, 4), logprobs=2)
    params.validate()
    decoded = msgspec.json.decode(msgspec.json.encode(params), type=SamplingParams)
    assert decoded == params
    assert SamplingParams(temperature=0).is_greedy and not params.is_greedy


@pytest.mark.parametrize("field, value", [
    ("temperature", -0.1), ("temperature", math.inf), ("top_p", 0.0), ("top_p", 1.5),
    ("top_p", math.nan), ("top_k", -2), ("min_p", 1.5), ("max_tokens", 0), ("min_tokens", -1),
    ("logprobs", -1), ("presence_penalty", 2.5), ("frequency_penalty", -3.0),
    ("repetition_penalty", 0.0), ("seed", 2**64), ("stop_token_ids", (1, -1)),
])
def test_validate_names_the_bad_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value}).validate()


def test_min_tokens_above_max_tokens_is_rejected():
    with pytest.raises(ValueError, match="min_tokens must be <= max_tokens"):
        SamplingParams(min_tokens=5, max_tokens=3).validate()


def test_params_import_without_torch():
    code = ("import sys; from engine.wire.sampling_params import SamplingParams; SamplingParams().validate(); "
            "print('torch' in sys.modules)")
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True,
                            text=True, check=True)
    assert result.stdout.strip() == "False"


# greedy and seeds

def test_greedy_rows_are_exact_argmax_even_beside_sampled_rows():
    logits = random_logits(8)
    params = [SamplingParams(temperature=0.0 if i % 2 == 0 else 1.3) for i in range(8)]
    out = sample(logits, params)
    assert torch.equal(out.sampled_token_ids[::2], logits.argmax(-1)[::2])
    assert torch.equal(sample(logits, [SamplingParams(temperature=0)] * 8).sampled_token_ids,
                       logits.argmax(-1))


def seeded_run(seed, batch_mix, steps=20):
    """Tokens of one seeded request over several steps, inside a batch of other rows."""
    generator = make_generator(seed)
    tokens = []
    for step in range(steps):
        row_logits = random_logits(1, seed=100 + step)
        others = random_logits(len(batch_mix), seed=1000 + step)
        position = len(batch_mix) // 2
        logits = torch.cat([others[:position], row_logits, others[position:]])
        params = list(batch_mix[:position]) + [SamplingParams(seed=seed)] + list(batch_mix[position:])
        generators = [make_generator(p.seed) for p in params]
        generators[position] = generator
        tokens.append(int(sample(logits, params, generators=generators).sampled_token_ids[position]))
    return tokens


def test_same_seed_gives_same_tokens_whatever_the_batch():
    alone = seeded_run(1234, [])
    mixed = seeded_run(1234, [SamplingParams(), SamplingParams(temperature=0), SamplingParams(seed=9)])
    other_mix = seeded_run(1234, [SamplingParams(seed=5, top_k=3)] * 5)
    assert alone == mixed == other_mix


def test_different_seeds_give_different_tokens():
    assert seeded_run(1, []) != seeded_run(2, [])


# filters

def test_top_k_1_and_tiny_top_p_are_greedy():
    logits = random_logits(64)
    argmax = logits.argmax(-1)
    top_k = sample(logits, [SamplingParams(temperature=1.5, top_k=1)] * 64)
    top_p = sample(logits, [SamplingParams(temperature=1.5, top_p=1e-6)] * 64)
    assert torch.equal(top_k.sampled_token_ids, argmax)
    assert torch.equal(top_p.sampled_token_ids, argmax)


def kept(logits, top_k, top_p):
    masked = apply_top_k_top_p(logits, torch.tensor(top_k), torch.tensor(top_p))
    return [set(torch.nonzero(row.isfinite()).flatten().tolist()) for row in masked]


def test_top_k_and_top_p_keep_the_expected_sets():
    probs = torch.tensor([[0.15, 0.5, 0.05, 0.3]] * 4)
    logits = probs.log()
    assert kept(logits, [2, -1, -1, 0], [1.0, 0.75, 0.85, 1.0]) == [{1, 3}, {1, 3}, {1, 3, 0}, {0, 1, 2, 3}]
    # top_p acts on what top_k left: {1: 0.625, 3: 0.375}
    assert kept(logits[:1], [2], [0.6]) == [{1}]


def test_ranking_only_the_top_k_candidates_matches_a_full_sort():
    logits = random_logits(5, vocab=1000)
    top_k = torch.tensor([1, 7, 50, 200, 3])
    top_p = torch.tensor([1.0, 0.5, 0.9, 0.99, 1.0])
    full = apply_top_k_top_p(logits, top_k, top_p)
    assert torch.equal(apply_top_k_top_p(logits, top_k, top_p, max_top_k=200), full)
    assert full.isfinite().sum(-1).tolist()[0::4] == [1, 3]


def test_min_p_drops_unlikely_tokens():
    probs = torch.tensor([0.4, 0.3, 0.19, 0.11])
    logits = probs.log().expand(2000, 4)
    with torch.random.fork_rng():
        torch.manual_seed(0)
        out = sample(logits, [SamplingParams(min_p=0.5)] * 2000)
    assert set(out.sampled_token_ids.tolist()) == {0, 1}


def chi_square(tokens, probs):
    counts = torch.bincount(tokens, minlength=len(probs)).double()
    expected = probs.double() * len(tokens)
    return float(((counts - expected) ** 2 / expected).sum())


def test_temperature_sampling_follows_the_distribution():
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -0.5, -1.0])
    probs = (logits / 0.7).softmax(-1)
    rows = 6000
    params = [SamplingParams(temperature=0.7)] * rows
    with torch.random.fork_rng():
        torch.manual_seed(0)
        unseeded = sample(logits.expand(rows, 6), params).sampled_token_ids
    seeded = sample(logits.expand(rows, 6), params,
                    generators=[make_generator(seed) for seed in range(rows)]).sampled_token_ids
    # 5 degrees of freedom: 20.5 is the 0.1% tail; the draws are fixed by the seeds
    assert chi_square(unseeded, probs) < 20.5
    assert chi_square(seeded, probs) < 20.5


# penalties

def test_presence_and_frequency_penalties_follow_openai():
    logits = random_logits(1)
    out = sample(logits, [SamplingParams(temperature=0, presence_penalty=0.5, frequency_penalty=0.25,
                                         logprobs=VOCAB)], outputs=[[3, 3, 5]])
    expected = logits[0].clone()
    expected[3] -= 2 * 0.25 + 0.5
    expected[5] -= 1 * 0.25 + 0.5
    order = out.top_token_ids[0]
    assert torch.allclose(out.top_logprobs[0], expected.log_softmax(-1)[order], atol=1e-5)


def test_repetition_penalty_shrinks_seen_tokens_from_prompt_and_output():
    logits = torch.tensor([[2.0, -2.0, 1.0, -1.0, 0.5]])
    out = sample(logits, [SamplingParams(temperature=0, repetition_penalty=2.0, logprobs=5)],
                 outputs=[[0]], prompt_token_ids=[[1, 1]])
    expected = torch.tensor([1.0, -4.0, 1.0, -1.0, 0.5])
    order = out.top_token_ids[0]
    assert torch.allclose(out.top_logprobs[0], expected.log_softmax(-1)[order], atol=1e-6)


def test_penalised_greedy_avoids_a_repeated_token():
    logits = torch.tensor([[3.0, 2.9, 0.0]])
    assert sample(logits, [SamplingParams(temperature=0, frequency_penalty=0.2)],
                  outputs=[[0]]).sampled_token_ids.tolist() == [1]


def test_min_tokens_blocks_eos_and_stop_tokens_until_reached():
    logits = torch.tensor([[0.0, 9.0, 8.0, 7.0]] * 3)
    params = [SamplingParams(temperature=0, min_tokens=2, stop_token_ids=(2,)),
              SamplingParams(temperature=0, min_tokens=2, stop_token_ids=(2,), ignore_eos=True),
              SamplingParams(temperature=0, min_tokens=2, stop_token_ids=(2,))]
    out = sample(logits, params, outputs=[[0], [0], [0, 0]], eos_token_id=1)
    assert out.sampled_token_ids.tolist() == [3, 1, 1]


@pytest.mark.parametrize("params, num_outputs, only_argmax", [
    (SamplingParams(temperature=0), 0, True),
    (SamplingParams(temperature=0, min_tokens=2, stop_token_ids=(2,)), 2, True),  # min_tokens reached
    (SamplingParams(temperature=0, min_tokens=2, stop_token_ids=(2,)), 1, False),
    (SamplingParams(temperature=0, logprobs=0), 0, False),
    (SamplingParams(temperature=0, presence_penalty=0.5), 0, False),
    (SamplingParams(temperature=0, frequency_penalty=0.5), 0, False),
    (SamplingParams(temperature=0, repetition_penalty=1.2), 0, False),
    (SamplingParams(temperature=0.7), 0, False),
])
def test_needs_only_argmax_is_exactly_where_the_sampler_returns_the_argmax(params, num_outputs, only_argmax):
    """The model runner's greedy fast path takes the argmax for rows this says need nothing else."""
    assert needs_only_argmax(params, num_outputs) is only_argmax
    if only_argmax:
        logits = random_logits(4)
        out = sample(logits, [params] * 4, outputs=[[0] * num_outputs] * 4, eos_token_id=1)
        assert out.sampled_token_ids.tolist() == logits.argmax(-1).tolist() and out.sampled_logprobs is None


# logprobs

def test_logprobs_agree_with_log_softmax():
    logits = random_logits(6)
    params = [SamplingParams(temperature=1.0, logprobs=3, seed=i) for i in range(3)]
    params += [SamplingParams(temperature=0, logprobs=0)] * 3
    out = sample(logits, params, generators=[make_generator(p.seed) for p in params])
    reference = logits.log_softmax(-1)
    sampled = out.sampled_token_ids
    assert torch.allclose(out.sampled_logprobs, reference.gather(1, sampled[:, None]).squeeze(1))
    top = reference.topk(3, dim=-1)
    assert torch.equal(out.top_token_ids, top.indices)
    assert torch.allclose(out.top_logprobs, top.values)
    expected_ranks = (reference > reference.gather(1, sampled[:, None])).sum(-1) + 1
    assert torch.equal(out.sampled_token_ranks, expected_ranks)
    assert out.sampled_token_ranks[3:].tolist() == [1, 1, 1]


def test_no_logprobs_unless_asked():
    out = sample(random_logits(2), [SamplingParams(), SamplingParams(temperature=0)])
    assert out.sampled_logprobs is None and out.top_logprobs is None


@settings(max_examples=40, deadline=None)
@given(temperature=st.floats(0.05, 3.0), top_k=st.integers(-1, VOCAB + 5),
       top_p=st.floats(0.01, 1.0), min_p=st.floats(0.0, 1.0), seed=st.integers(0, 2**32))
def test_sampled_token_always_survives_the_filters(temperature, top_k, top_p, min_p, seed):
    logits = random_logits(4, seed=seed % 1000)
    params = [SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, seed=seed)] * 4
    out = sample(logits, params, generators=[make_generator(seed + i) for i in range(4)])
    scaled = logits / temperature
    masked = scaled.masked_fill(scaled.softmax(-1) < scaled.softmax(-1).amax(-1, keepdim=True) * min_p,
                                float("-inf"))
    masked = apply_top_k_top_p(masked, torch.tensor([top_k] * 4), torch.tensor([top_p] * 4))
    assert masked.gather(1, out.sampled_token_ids[:, None]).isfinite().all()
