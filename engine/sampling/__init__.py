"""Sampling: what a request asks (params, torch-free) and the batched sampler.

`SamplingParams` imports without torch, so the API server can build and
check requests; the sampler's names load torch on first access.
"""

from engine.sampling.params import GREEDY_TEMPERATURE, SamplingParams

_SAMPLER_NAMES = ("Sampler", "SamplerOutput", "SamplingMetadata", "make_generator")

__all__ = ["GREEDY_TEMPERATURE", "SamplingParams", *_SAMPLER_NAMES]


def __getattr__(name: str):
    if name in _SAMPLER_NAMES:
        from engine.sampling import sampler
        return getattr(sampler, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
