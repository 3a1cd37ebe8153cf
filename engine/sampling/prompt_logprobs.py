"""Logprobs of the prompt's own tokens, from the prefill's hidden states (vLLM's prompt_logprobs).

They are the raw model's: a log-softmax of the logits with no penalty,
temperature or filter, as transformers computes them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from engine.wire.scheduler_output import TokenLogprobs

ROWS_PER_SLICE = 256  # [rows, vocab] float32 at a time: a long prompt never holds all its logits at once


def prompt_logprobs(hidden: torch.Tensor, target_ids: Sequence[int], num_top: int,
                    compute_logits: Callable[[torch.Tensor], torch.Tensor]) -> list[TokenLogprobs]:
    """For each row of `hidden` (the position before a prompt token), the logprob and rank of that
    token (`target_ids`, one per row) and the `num_top` likeliest tokens there, most likely first.
    `compute_logits` may give None (a TP rank other than the driver): then so is the answer, []."""
    out: list[TokenLogprobs] = []
    for begin in range(0, len(target_ids), ROWS_PER_SLICE):
        logits = compute_logits(hidden[begin:begin + ROWS_PER_SLICE])
        if logits is None:
            continue
        logits = logits.float()
        targets = torch.tensor(target_ids[begin:begin + ROWS_PER_SLICE], dtype=torch.long, device=logits.device)
        out += logprobs_of(logits, targets, num_top)
    return out


def logprobs_of(logits: torch.Tensor, targets: torch.Tensor, num_top: int) -> list[TokenLogprobs]:
    """Each row's log-softmax at `targets`, the target's rank (1: the likeliest) and the top `num_top`."""
    logprobs = logits.log_softmax(dim=-1)
    chosen = logprobs.gather(1, targets[:, None])
    ranks = (logprobs > chosen).sum(dim=-1) + 1
    num_top = min(num_top, logprobs.shape[-1])
    top_logprobs, top_ids = logprobs.topk(num_top, dim=-1) if num_top else (None, None)
    chosen, ranks = chosen.squeeze(1).tolist(), ranks.tolist()
    top_ids = top_ids.tolist() if num_top else [[] for _ in chosen]
    top_logprobs = top_logprobs.tolist() if num_top else [[] for _ in chosen]
    return [TokenLogprobs(lp, ids, tops, rank) for lp, ids, tops, rank in zip(chosen, top_ids, top_logprobs, ranks)]
