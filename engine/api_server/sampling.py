"""The SamplingParams of each of a request's n choices. Pure.

A request's own SamplingParams come from its typed body
(`openai_models.SamplingFields.sampling_params`).
"""

from __future__ import annotations

import msgspec

from engine.wire.sampling_params import SamplingParams

SEED_SPACE = 2**64


def choice_params(params: SamplingParams, index: int) -> SamplingParams:
    """The params of the `index`-th of n choices: a seed gives each choice its own, repeatable stream."""
    if params.seed is None or index == 0:
        return params
    seed = params.seed + index
    if seed >= SEED_SPACE:
        seed -= SEED_SPACE
    return msgspec.structs.replace(params, seed=seed)
