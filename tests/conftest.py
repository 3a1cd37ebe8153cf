"""What every test shares: nothing a test starts may outlive it, and tiny random-weight models.

The tiny Llama-family checkpoints are written by transformers with weights
re-drawn large enough (std 0.1, norms around 1, non-zero biases) that logits
are O(1), so a 1e-4 tolerance catches a wrongly mapped tensor. Each variant
is built once per session, on first use.
"""

import time
from pathlib import Path

import psutil
import pytest
import torch


@pytest.fixture(autouse=True)
def no_orphans():
    """Fail a test that leaves child processes behind (and end them, so the next test starts clean)."""
    me = psutil.Process()
    before = {p.pid for p in me.children(recursive=True)}
    yield
    deadline = time.monotonic() + 5
    while True:
        left = [p for p in me.children(recursive=True) if p.pid not in before and _alive(p)]
        if not left or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    for p in left:
        p.kill()
    assert not left, f"processes left behind: {[(p.pid, _cmdline(p)) for p in left]}"


def _alive(p: psutil.Process) -> bool:
    try:
        return p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _cmdline(p: psutil.Process) -> str:
    try:
        return " ".join(p.cmdline())[:200]
    except psutil.Error:
        return "?"


BASE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=256, max_position_embeddings=512, rms_norm_eps=1e-6)

VARIANTS = {
    "llama": ("llama", dict(tie_word_embeddings=False)),
    "llama_tied": ("llama", dict(tie_word_embeddings=True)),
    # llama3 rope scaling, and attention_bias, which Llama also puts on o_proj
    "llama3": ("llama", dict(tie_word_embeddings=False, attention_bias=True, rope_theta=500000.0,
                             rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                                               high_freq_factor=4.0, original_max_position_embeddings=64))),
    # q/k/v bias, tied head, and a vocabulary that TP=2 must pad
    "qwen2": ("qwen2", dict(tie_word_embeddings=True, vocab_size=251)),
    # several files plus model.safetensors.index.json, stored as bfloat16
    "sharded_bf16": ("llama", dict(tie_word_embeddings=False, save_dtype=torch.bfloat16, max_shard_size="40KB")),
}


def build_checkpoint(path: Path, family: str, seed: int = 0, **overrides) -> Path:
    """Write a tiny random model of `family` (llama, qwen2) to `path` with transformers."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    save_dtype = overrides.pop("save_dtype", torch.float32)
    max_shard_size = overrides.pop("max_shard_size", "50GB")
    config_cls, model_cls = {"llama": (LlamaConfig, LlamaForCausalLM),
                             "qwen2": (Qwen2Config, Qwen2ForCausalLM)}[family]
    torch.manual_seed(seed)
    model = model_cls(config_cls(**{**BASE, **overrides}))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.copy_(1 + 0.1 * torch.randn_like(param))
            else:
                param.copy_(0.1 * torch.randn_like(param))
    model.to(save_dtype).save_pretrained(path, safe_serialization=True, max_shard_size=max_shard_size)
    return path


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """tiny_model(variant) -> the directory of that checkpoint (see VARIANTS)."""
    built: dict[str, Path] = {}

    def get(variant: str) -> Path:
        if variant not in built:
            family, overrides = VARIANTS[variant]
            built[variant] = build_checkpoint(tmp_path_factory.mktemp(variant), family, **overrides)
        return built[variant]

    return get


@pytest.fixture(scope="session")
def hf_logits():
    """hf_logits(model_dir, token_ids) -> transformers' float32 logits [len, vocab]: the reference."""
    from transformers import AutoModelForCausalLM

    models = {}

    def run(model_dir: Path, token_ids: list[int]) -> torch.Tensor:
        if model_dir not in models:
            models[model_dir] = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        with torch.no_grad():
            return models[model_dir](torch.tensor([token_ids])).logits[0]

    return run


@pytest.fixture(scope="session")
def hf_greedy():
    """hf_greedy(model_dir, prompts: dict[id, (token_ids, n)]) -> {id: the n argmax tokens transformers picks}.

    Plain argmax of transformers' logits, token by token: unlike `generate`
    with min_new_tokens, it does not hold back EOS, as ignore_eos does not.
    """
    from transformers import AutoModelForCausalLM

    def run(model_dir: Path, prompts: dict) -> dict:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        out = {}
        with torch.no_grad():
            for key, (prompt, n) in prompts.items():
                ids = list(prompt)
                for _ in range(n):  # a full forward per token: slow, but no cache API to depend on
                    ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
                out[key] = ids[len(prompt):]
        return out

    return run
