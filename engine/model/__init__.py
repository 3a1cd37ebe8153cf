"""The model side of a worker: config, sharded layers, paged attention, loader.

Names are imported on first use, so `engine.model.config` stays importable
without torch (the API server reads ModelConfig and never imports torch).
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "ModelConfig": "engine.model.config",
    "RopeScaling": "engine.model.config",
    "AttentionMetadata": "engine.model.attention",
    "allocate_kv_caches": "engine.model.attention",
    "kv_cache_block_bytes": "engine.model.attention",
    "paged_attention": "engine.model.attention",
    "LlamaForCausalLM": "engine.model.llama",
    "load_model": "engine.model.loader",
    "load_weights": "engine.model.loader",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'engine.model' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
