"""The model's shape, read from a local Hugging Face directory's config.json: the one reader of it.

No torch here and nothing else of the engine: the API server reads a ModelConfig
without importing torch, and `vsup plan` reads the same one (its only import of
the engine), so that the planner and the engine can never read a config apart.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

# HF architecture name -> what its attention projections carry
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
}
SUPPORTED_DTYPES = ("float32", "float16", "bfloat16")
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"  # what serves without a MODEL (default_model.py), by its name here
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


@dataclass(frozen=True)
class RopeScaling:
    """Rotary scaling: `linear` divides positions by `factor`; `llama3` rescales
    frequencies by wavelength between the low and high frequency factors."""

    rope_type: str
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True)
class ModelConfig:
    """One Llama-family decoder (Llama, Mistral, Qwen2, SmolLM2), checked on construction."""

    model_type: str
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # bias on q/k/v
    o_proj_bias: bool = False  # Llama's attention_bias also biases o_proj; Qwen2's never does
    rope_scaling: RopeScaling | None = None
    sliding_window: int | None = None
    dtype: str = "float32"

    def __post_init__(self):
        for name in ("num_layers", "hidden_size", "intermediate_size", "num_heads",
                     "num_kv_heads", "head_dim", "vocab_size", "max_position_embeddings"):
            if getattr(self, name) < 1:
                raise ValueError(f"config.json: {name} must be positive (got {getattr(self, name)})")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"config.json: num_attention_heads {self.num_heads} is not a multiple of "
                             f"num_key_value_heads {self.num_kv_heads}")
        if self.dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"dtype {self.dtype!r} is not supported; use one of {', '.join(SUPPORTED_DTYPES)}")

    @property
    def max_model_len(self) -> int:
        """The longest context served exactly: a sliding window shorter than the
        position limit would change attention past it, so it caps the length."""
        return min(self.max_position_embeddings, self.sliding_window or self.max_position_embeddings)

    @property
    def torch_dtype(self):
        """`dtype` as a torch.dtype (torch is imported only here)."""
        import torch
        return getattr(torch, self.dtype)

    def valid_tp_sizes(self) -> list[int]:
        """The TP sizes that split the heads, the KV heads and the MLP evenly."""
        g = math.gcd(math.gcd(self.num_heads, self.num_kv_heads), self.intermediate_size)
        return [d for d in range(1, g + 1) if g % d == 0]

    def verify_parallel(self, tp_size: int, pp_size: int) -> None:
        """Raise ValueError, naming the valid choices, when the model cannot be
        split into `tp_size` x `pp_size` shards."""
        if tp_size < 1 or pp_size < 1:
            raise ValueError(f"tensor and pipeline parallel sizes must be >= 1 (got tp={tp_size}, pp={pp_size})")
        if tp_size not in self.valid_tp_sizes():
            raise ValueError(
                f"tensor parallel size {tp_size} does not divide the model's {self.num_heads} attention heads, "
                f"{self.num_kv_heads} KV heads and intermediate size {self.intermediate_size}; "
                f"use -tp {' or '.join(map(str, self.valid_tp_sizes()))}")
        if pp_size > self.num_layers:
            raise ValueError(f"pipeline parallel size {pp_size} exceeds the model's {self.num_layers} layers; "
                             f"use at most -pp {self.num_layers}")

    def checkpoint_shapes(self) -> dict[str, tuple[int, ...]]:
        """Hugging Face tensor name -> shape, of every tensor a checkpoint of this config must hold.

        A tied head (tie_word_embeddings) is the embedding, so lm_head.weight is not listed: a
        checkpoint may carry it or not. Tensors beyond these (rotary inv_freq and the like) are
        allowed and ignored by the loader.
        """
        h, q, kv = self.hidden_size, self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        shapes = {"model.embed_tokens.weight": (self.vocab_size, h), "model.norm.weight": (h,)}
        if not self.tie_word_embeddings:
            shapes["lm_head.weight"] = (self.vocab_size, h)
        for i in range(self.num_layers):
            layer = f"model.layers.{i}"
            for proj, rows in (("q_proj", q), ("k_proj", kv), ("v_proj", kv)):
                shapes[f"{layer}.self_attn.{proj}.weight"] = (rows, h)
                if self.attention_bias:
                    shapes[f"{layer}.self_attn.{proj}.bias"] = (rows,)
            shapes[f"{layer}.self_attn.o_proj.weight"] = (h, q)
            if self.o_proj_bias:
                shapes[f"{layer}.self_attn.o_proj.bias"] = (h,)
            mlp = self.intermediate_size
            shapes[f"{layer}.mlp.gate_proj.weight"] = shapes[f"{layer}.mlp.up_proj.weight"] = (mlp, h)
            shapes[f"{layer}.mlp.down_proj.weight"] = (h, mlp)
            shapes[f"{layer}.input_layernorm.weight"] = shapes[f"{layer}.post_attention_layernorm.weight"] = (h,)
        return shapes

    @classmethod
    def from_pretrained(cls, model_dir: str | Path, dtype: str | None = None, strict: bool = True) -> ModelConfig:
        """Read `model_dir`/config.json. `dtype` (float32, float16, bfloat16)
        overrides the checkpoint's own; None or "auto" keeps it."""
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise ValueError(f"{str(model_dir)!r} has no config.json; give a local Hugging Face model directory")
        return cls.from_dict(json.loads(path.read_text()), dtype=dtype, strict=strict)

    @classmethod
    def from_dict(cls, hf: dict, dtype: str | None = None, strict: bool = True) -> ModelConfig:
        """Build from a parsed HF config (transformers 4 and 5 spellings). Not `strict`: the shape of a
        model this engine does not run (another architecture, activation or rope; for a stock vLLM to
        serve), with what it cannot tell taken as a Llama's and an unknown dtype as float32."""
        arch = _architecture(hf, strict)
        if strict and hf.get("hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act {hf['hidden_act']!r} is not supported; Llama-family models use silu")
        if strict and hf.get("mlp_bias"):
            raise ValueError("mlp_bias=true is not supported; Llama-family checkpoints have no MLP bias")
        heads = int(hf["num_attention_heads"])
        hidden = int(hf["hidden_size"])
        rope = dict(hf.get("rope_parameters") or {})  # transformers >= 5 keeps rope_theta in here
        theta = float(hf.get("rope_theta") or rope.get("rope_theta") or 10000.0)
        llama_bias = bool(hf.get("attention_bias", False))
        use_window = hf.get("use_sliding_window", arch != "qwen2")  # Qwen2 lists a window it does not use
        if dtype in (None, "auto"):
            dtype = str(hf.get("torch_dtype") or hf.get("dtype") or "float32")
            if not strict and dtype not in SUPPORTED_DTYPES:
                dtype = "float32"
        return cls(
            model_type=arch,
            num_layers=int(hf["num_hidden_layers"]),
            hidden_size=hidden,
            intermediate_size=int(hf["intermediate_size"]),
            num_heads=heads,
            num_kv_heads=int(hf.get("num_key_value_heads") or heads),
            head_dim=int(hf.get("head_dim") or hidden // heads),
            vocab_size=int(hf["vocab_size"]),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            max_position_embeddings=int(hf.get("max_position_embeddings") or 2048),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            attention_bias=True if arch == "qwen2" else llama_bias,
            o_proj_bias=False if arch == "qwen2" else llama_bias,
            rope_scaling=_rope_scaling(hf.get("rope_scaling") or rope) if strict else None,
            sliding_window=int(hf["sliding_window"]) if use_window and hf.get("sliding_window") else None,
            dtype=dtype,
        )


def _architecture(hf: dict, strict: bool = True) -> str:
    names = hf.get("architectures") or []
    for name in names:
        if name in SUPPORTED_ARCHITECTURES:
            return SUPPORTED_ARCHITECTURES[name]
    if not names and hf.get("model_type") in SUPPORTED_ARCHITECTURES.values():
        return hf["model_type"]
    if not strict:
        return str(hf.get("model_type") or (names[0] if names else "unknown"))
    raise ValueError(
        f"architecture {names or hf.get('model_type')!r} is not supported; vsup serves "
        f"{', '.join(SUPPORTED_ARCHITECTURES)} checkpoints (SmolLM2 is a LlamaForCausalLM)")


def _rope_scaling(spec: dict) -> RopeScaling | None:
    rope_type = spec.get("rope_type") or spec.get("type") or "default"
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"rope scaling {rope_type!r} is not supported; use one of "
                         f"{', '.join(SUPPORTED_ROPE_TYPES)}")
    if rope_type == "default":
        return None
    keys = ("low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
    extra = {k: spec[k] for k in keys if k in spec} if rope_type == "llama3" else {}
    if rope_type == "llama3" and len(extra) < len(keys):
        raise ValueError(f"llama3 rope scaling needs factor and {', '.join(keys)} (got {sorted(spec)})")
    return RopeScaling(rope_type=rope_type, factor=float(spec["factor"]), **extra)


def eos_token_ids(model_dir: str | Path) -> list[int]:
    """The model's end-of-sequence ids: generation_config.json's, else config.json's (one or several)."""
    for name in ("generation_config.json", "config.json"):
        path = Path(model_dir) / name
        if path.is_file():
            eos = json.loads(path.read_text()).get("eos_token_id")
            if eos is not None:
                return [int(e) for e in eos] if isinstance(eos, list) else [int(eos)]
    return []
