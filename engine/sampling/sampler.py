"""Turn a batch of logits into next tokens: penalties, filters, seeded draws, logprobs.

Every step is batched over rows and the vocabulary; the only per-row Python
work is drawing noise for rows that carry their own seeded generator.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from engine.ops import cpu_extension
from engine.sampling.grammar_bitmask import apply_grammar_bitmask
from engine.wire.sampling_params import GREEDY_TEMPERATURE, SamplingParams


def make_generator(seed: int | None, device: torch.device | str = "cpu") -> torch.Generator | None:
    """A generator for one request's seed, or None without one.

    Create it once when the request arrives and pass the same object every
    step: its stream then depends on the seed alone, not on the batch.
    """
    if seed is None:
        return None
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    return generator


@dataclass
class SamplingMetadata:
    """One batch's per-row sampling settings as tensors on the logits' device.

    Build it with `from_params`. `generators[i]` is row i's seeded generator
    or None (global RNG); `output_token_ids[i]` are the tokens row i has
    generated so far (all penalties) and `prompt_token_ids[i]` its prompt
    (repetition penalty only). `blocked_token_ids` maps a row still short of
    its min_tokens to the stop tokens it may not sample yet. `grammar_rows`
    [m] are the rows under a grammar and `grammar_bitmask` [m, words] what
    each may sample (engine/sampling/grammar_bitmask.py). The is_/has_
    flags and max_top_k only let the sampler skip work that no row needs.
    """

    temperature: torch.Tensor  # [n] float32
    top_p: torch.Tensor  # [n] float32
    top_k: torch.Tensor  # [n] int64, <= 0 is off
    min_p: torch.Tensor  # [n] float32
    presence_penalty: torch.Tensor  # [n] float32
    frequency_penalty: torch.Tensor  # [n] float32
    repetition_penalty: torch.Tensor  # [n] float32
    generators: list[torch.Generator | None]
    output_token_ids: Sequence[Sequence[int]]
    prompt_token_ids: Sequence[Sequence[int]] | None = None
    blocked_token_ids: dict[int, list[int]] = field(default_factory=dict)
    grammar_rows: torch.Tensor | None = None  # [m] int64
    grammar_bitmask: torch.Tensor | None = None  # [m, ceil(vocab / 32)] int32
    max_num_logprobs: int | None = None
    max_top_k: int | None = None  # largest top_k when every sampled row has one
    is_all_greedy: bool = False
    has_penalties: bool = True
    has_top_k_top_p: bool = True
    has_min_p: bool = True

    @classmethod
    def from_params(cls, params: Sequence[SamplingParams], output_token_ids: Sequence[Sequence[int]],
                    generators: Sequence[torch.Generator | None] | None = None, *,
                    prompt_token_ids: Sequence[Sequence[int]] | None = None,
                    eos_token_id: int | None = None,
                    device: torch.device | str = "cpu") -> SamplingMetadata:
        """Gather validated `params` (one per row) into batch tensors on `device`."""
        num_rows = len(params)
        if len(output_token_ids) != num_rows:
            raise ValueError(f"got {len(output_token_ids)} output_token_ids rows for {num_rows} params")

        def column(name: str, dtype: torch.dtype = torch.float32) -> torch.Tensor:
            return torch.tensor([getattr(p, name) for p in params], dtype=dtype, device=device)

        blocked = {}
        for i, p in enumerate(params):
            if len(output_token_ids[i]) < p.min_tokens:
                stops = list(p.stop_token_ids)
                if eos_token_id is not None and not p.ignore_eos:
                    stops.append(eos_token_id)
                if stops:
                    blocked[i] = stops
        sampled = [p for p in params if not p.is_greedy]
        return cls(
            temperature=column("temperature"), top_p=column("top_p"),
            top_k=column("top_k", torch.int64), min_p=column("min_p"),
            presence_penalty=column("presence_penalty"),
            frequency_penalty=column("frequency_penalty"),
            repetition_penalty=column("repetition_penalty"),
            generators=list(generators) if generators is not None else [None] * num_rows,
            output_token_ids=output_token_ids, prompt_token_ids=prompt_token_ids,
            blocked_token_ids=blocked,
            max_num_logprobs=max((p.logprobs for p in params if p.logprobs is not None), default=None),
            max_top_k=(max(p.top_k for p in sampled)
                       if sampled and all(p.top_k > 0 for p in sampled) else None),
            is_all_greedy=not sampled,
            has_penalties=any(p.has_penalties for p in params),
            has_top_k_top_p=any(p.top_k > 0 or p.top_p < 1 for p in sampled),
            has_min_p=any(p.min_p > 0 for p in sampled),
        )


def needs_only_argmax(params: SamplingParams, num_output_tokens: int) -> bool:
    """True when a row's next token is the argmax of its logits and nothing else is asked: greedy,
    no penalties, no logprobs, no stop token held back by min_tokens. A batch of such rows (and no
    grammar) skips SamplingMetadata and the Sampler: the Sampler would return that argmax."""
    return (params.is_greedy and params.logprobs is None and not params.has_penalties
            and num_output_tokens >= params.min_tokens)


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """logits [N, V] -> long [N], their argmax: on the CPU (float32, or bfloat16 as the LM head gave them)
    engine/ops' vectorized kernel, several times faster than torch's at a decode batch's width of
    vocabulary. 64 x 49,152 bfloat16 logits read as they are: 0.9 ms on 2 cores, against 3.5 widened
    to float32 first and 6.0 for torch's bf16 argmax."""
    if cpu_extension.takes_rows(logits) and logits.dim() == 2 and logits.shape[1] and logits.stride(1) == 1:
        out = torch.empty(logits.shape[0], dtype=torch.long)
        torch.ops.vsup_cpu.argmax_rows(logits, out)
        return out
    if logits.dtype == torch.bfloat16 and logits.device.type == "cpu":
        logits = logits.float()  # (exact: the same index; torch's bf16 argmax is the slower)
    return logits.argmax(dim=-1)


@dataclass
class SamplerOutput:
    """The sampled token of each row and, when any row asked, logprobs.

    Logprobs are those of the model's distribution after penalties and
    before temperature and filtering. The top_* tensors have
    max_num_logprobs columns, most likely first; a row that asked for fewer
    uses its first n. Ranks count from 1 (the most likely token).
    """

    sampled_token_ids: torch.Tensor  # [n] int64
    sampled_logprobs: torch.Tensor | None = None  # [n] float32
    sampled_token_ranks: torch.Tensor | None = None  # [n] int64
    top_token_ids: torch.Tensor | None = None  # [n, k] int64
    top_logprobs: torch.Tensor | None = None  # [n, k] float32


class Sampler:
    """Sample one token per row of `logits` [n, vocab] under a SamplingMetadata.

    Order (vLLM's): a grammar's bitmask, stop tokens blocked for min_tokens and penalties on the
    raw logits; logprobs from that distribution; greedy rows take its
    argmax; the other rows divide by temperature, apply min_p, then top-k
    and top-p, and draw by argmax(p / q) with q ~ Exp(1), an exact sample
    of p that needs one noise draw per row from that row's generator.
    """

    def __call__(self, logits: torch.Tensor, metadata: SamplingMetadata) -> SamplerOutput:
        logits = logits.float()
        if metadata.grammar_bitmask is not None:
            logits = apply_grammar_bitmask(logits, metadata.grammar_rows, metadata.grammar_bitmask)
        if metadata.blocked_token_ids:
            logits = logits.clone()  # the caller's logits stay untouched
            for row, token_ids in metadata.blocked_token_ids.items():
                logits[row, token_ids] = float("-inf")
        if metadata.has_penalties:
            logits = apply_penalties(logits, metadata)

        greedy = logits.argmax(dim=-1)
        if metadata.is_all_greedy:
            sampled = greedy
        else:
            is_greedy = metadata.temperature < GREEDY_TEMPERATURE
            sampled = torch.where(is_greedy, greedy, self._sample_random(logits, metadata))

        output = SamplerOutput(sampled_token_ids=sampled)
        if metadata.max_num_logprobs is not None:
            logprobs = logits.log_softmax(dim=-1)
            sampled_logprobs = logprobs.gather(1, sampled[:, None])
            output.sampled_logprobs = sampled_logprobs.squeeze(1)
            output.sampled_token_ranks = (logprobs > sampled_logprobs).sum(dim=-1) + 1
            num_top = min(metadata.max_num_logprobs, logprobs.shape[-1])
            output.top_logprobs, output.top_token_ids = logprobs.topk(num_top, dim=-1)
        return output

    def _sample_random(self, logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
        # greedy rows ride along with temperature 1; their result is discarded
        temperature = metadata.temperature
        temperature = torch.where(temperature < GREEDY_TEMPERATURE, 1.0, temperature)
        logits = logits / temperature[:, None]
        if metadata.has_min_p:
            logits = apply_min_p(logits, metadata.min_p)
        if metadata.has_top_k_top_p:
            logits = apply_top_k_top_p(logits, metadata.top_k, metadata.top_p, metadata.max_top_k)
        probs = logits.softmax(dim=-1)
        return probs.div_(exponential_noise(probs, metadata.generators)).argmax(dim=-1)


def exponential_noise(like: torch.Tensor, generators: Sequence[torch.Generator | None]) -> torch.Tensor:
    """Exp(1) noise shaped like `like`; row i comes from generators[i] when it has one.

    Drawn as -log(U), U uniform in [0, 1): several times faster on CPU than
    exponential_, never 0 (so p / q is never inf or nan); U = 0 gives inf,
    which only makes that one token lose this step (odds 2**-24).
    """
    noise = torch.empty_like(like)
    seeded = [i for i, generator in enumerate(generators) if generator is not None]
    if len(seeded) < len(generators):
        noise.uniform_()
    for i in seeded:
        noise[i].uniform_(generator=generators[i])
    return noise.log_().neg_()


def apply_penalties(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """OpenAI presence/frequency penalties and the CTRL repetition penalty.

    presence and frequency count generated tokens only: logit -= frequency *
    count + presence * (count > 0). repetition divides positive logits (and
    multiplies negative ones) of tokens seen in the prompt or the output.
    """
    vocab_size = logits.shape[-1]
    counts = token_counts(metadata.output_token_ids, vocab_size, logits.device)
    is_seen = counts > 0
    if metadata.prompt_token_ids is not None:
        is_seen |= token_counts(metadata.prompt_token_ids, vocab_size, logits.device) > 0
    repetition = metadata.repetition_penalty[:, None]
    repeated = torch.where(logits > 0, logits / repetition, logits * repetition)
    logits = torch.where(is_seen, repeated, logits)
    logits -= metadata.frequency_penalty[:, None] * counts
    logits -= metadata.presence_penalty[:, None] * (counts > 0).to(logits.dtype)
    return logits


def token_counts(token_ids: Sequence[Sequence[int]], vocab_size: int,
                 device: torch.device | str) -> torch.Tensor:
    """How often each vocabulary entry occurs in each row: [rows, vocab] float32."""
    max_len = max((len(row) for row in token_ids), default=0)
    # rows are padded with an extra id (vocab_size) whose column is dropped
    padded = torch.tensor([list(row) + [vocab_size] * (max_len - len(row)) for row in token_ids],
                          dtype=torch.int64, device=device).view(len(token_ids), max_len)
    counts = torch.zeros(len(token_ids), vocab_size + 1, dtype=torch.float32, device=device)
    counts.scatter_add_(1, padded, torch.ones_like(padded, dtype=torch.float32))
    return counts[:, :vocab_size]


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drop tokens less likely than min_p times the row's most likely token."""
    probs = logits.softmax(dim=-1)
    threshold = probs.amax(dim=-1, keepdim=True) * min_p[:, None]
    return logits.masked_fill(probs < threshold, float("-inf"))


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                      max_top_k: int | None = None) -> torch.Tensor:
    """Keep each row's top_k tokens (<= 0: all), then the smallest set reaching top_p mass.

    top_p acts on the distribution left after top_k, as in vLLM. When every
    row has a top_k, `max_top_k` (their maximum) lets it rank only that many
    candidates instead of sorting the whole vocabulary, by far the costliest
    step on CPU. Ties at the cut are broken arbitrarily.
    """
    vocab_size = logits.shape[-1]
    if max_top_k is not None and max_top_k < vocab_size:
        ranked, order = logits.topk(max_top_k, dim=-1)
    else:
        ranked, order = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(ranked.shape[-1], device=logits.device)
    k = torch.where(top_k > 0, top_k, vocab_size)
    ranked = ranked.masked_fill(ranks[None, :] >= k[:, None], float("-inf"))
    probs = ranked.softmax(dim=-1)
    # a token goes when the more likely ones already reach top_p; the first never does
    mass_before = probs.cumsum(dim=-1) - probs
    p = top_p[:, None]
    ranked = ranked.masked_fill((mass_before >= p) & (p < 1), float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter_(-1, order, ranked)
