"""Sampling: the batched sampler (torch). What a request asks is engine/wire/sampling_params.py."""
