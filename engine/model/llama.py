"""A Llama-family decoder (Llama, Mistral, Qwen2, SmolLM2), holding one rank's shard.

Stage pp of pp_size holds its layer range (named by their global index, as
in the checkpoint); the first stage also the embedding, the last the final
norm and the LM head. Tokens of a step are packed: input_ids [num_tokens].
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.distributed import IntermediateTensors, ParallelGroups, layer_range
from engine.model import decode_stack
from engine.model.attention import AttentionMetadata, paged_attention, write_kv
from engine.model.config import ModelConfig
from engine.model.layers import (ColumnParallelLinear, ParallelLMHead, RMSNorm, RotaryEmbedding,
                                 RowParallelLinear, VocabParallelEmbedding, rotate)
from engine.ops import cpu_extension

KVCache = tuple[torch.Tensor, torch.Tensor]


class LlamaAttention(nn.Module):
    """Self-attention over this rank's heads, with a merged q/k/v projection."""

    def __init__(self, config: ModelConfig, groups: ParallelGroups, dtype: torch.dtype):
        super().__init__()
        tp = groups.tp_size
        self.num_heads, self.num_kv_heads = config.num_heads // tp, config.num_kv_heads // tp
        self.head_dim = config.head_dim
        self.q_size, self.kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.scale = self.head_dim ** -0.5
        q_full, kv_full = config.num_heads * self.head_dim, config.num_kv_heads * self.head_dim
        self.qkv_proj = ColumnParallelLinear(config.hidden_size, [q_full, kv_full, kv_full],
                                             config.attention_bias, groups, dtype)
        self.o_proj = RowParallelLinear(q_full, config.hidden_size, config.o_proj_bias, groups, dtype)

    def forward(self, rope: tuple[torch.Tensor, torch.Tensor], hidden: torch.Tensor, kv_cache: KVCache,
                metadata: AttentionMetadata) -> torch.Tensor:
        num_tokens = hidden.shape[0]
        qk, v = self.qkv_proj(hidden).split([self.q_size + self.kv_size, self.kv_size], dim=-1)
        qk = rotate(qk.view(num_tokens, self.num_heads + self.num_kv_heads, self.head_dim), rope)
        q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        key_cache, value_cache = kv_cache
        write_kv(k, v, key_cache, value_cache, metadata.slot_mapping)
        out = paged_attention(q, key_cache, value_cache, metadata, self.scale, k, v)
        return self.o_proj(out.reshape(num_tokens, self.q_size), native=True)


class LlamaMLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)), gate and up merged in one column-parallel linear. With
    bfloat16 linears (--linear-dtype bfloat16) the rows stay bfloat16 from gate/up to down's output."""

    def __init__(self, config: ModelConfig, groups: ParallelGroups, dtype: torch.dtype):
        super().__init__()
        size = config.intermediate_size
        self.gate_up_proj = ColumnParallelLinear(config.hidden_size, [size, size], False, groups, dtype)
        self.down_proj = RowParallelLinear(size, config.hidden_size, False, groups, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x, native=True)
        if cpu_extension.takes_rows(gate_up) and gate_up.dim() == 2:
            out = gate_up.new_empty(gate_up.shape[0], gate_up.shape[1] // 2)
            torch.ops.vsup_cpu.silu_and_mul(gate_up, out)
            return self.down_proj(out, native=True)
        gate, up = gate_up.chunk(2, dim=-1)
        return self.down_proj(F.silu(gate).mul_(up), native=True)


class LlamaDecoderLayer(nn.Module):
    """Pre-norm attention and MLP; the residual add is fused into the next norm. The hidden rows it
    returns may be of the linears' dtype (bfloat16 ones), the residual's are the model's."""

    def __init__(self, config: ModelConfig, groups: ParallelGroups, dtype: torch.dtype):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, groups, dtype)
        self.self_attn = LlamaAttention(config, groups, dtype)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, groups, dtype)
        self.mlp = LlamaMLP(config, groups, dtype)

    def forward(self, rope, hidden, residual, kv_cache, metadata):
        if residual is None:
            residual, hidden = hidden, self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(rope, hidden, kv_cache, metadata)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class LlamaModel(nn.Module):
    """The decoder stack of one stage: embedding (first), layers, final norm (last)."""

    def __init__(self, config: ModelConfig, groups: ParallelGroups, dtype: torch.dtype):
        super().__init__()
        self.layer_range = layer_range(config.num_layers, groups.pp_size, groups.pp_rank)
        self.rotary_emb = RotaryEmbedding(config.head_dim, config.max_position_embeddings, config.rope_theta,
                                          config.rope_scaling, groups, dtype)
        self.embed_tokens = (VocabParallelEmbedding(config.vocab_size, config.hidden_size, groups, dtype)
                             if groups.is_first_stage else None)
        # keyed by global index, so parameter names match the checkpoint's
        self.layers = nn.ModuleDict({str(i): LlamaDecoderLayer(config, groups, dtype)
                                     for i in self.layer_range})
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, groups, dtype) if groups.is_last_stage else None
        self.tp_size, self.eps = groups.tp_size, config.rms_norm_eps
        self.stack = None  # the layers' decode loop in C++ (decode_stack.py), once the linears are packed

    def forward(self, input_ids, positions, kv_caches, metadata, intermediate):
        if self.embed_tokens is not None:
            hidden, residual = self.embed_tokens(input_ids), None
        else:
            hidden, residual = intermediate.hidden, intermediate.residual
        rope = self.rotary_emb(positions)
        stack = self._decode_stack(hidden, kv_caches, metadata)
        if stack is not None:
            hidden, residual = decode_stack.run(stack, hidden, residual, rope, kv_caches, metadata)
        else:
            for layer, kv_cache in zip(self.layers.values(), kv_caches, strict=True):
                hidden, residual = layer(rope, hidden, residual, kv_cache, metadata)
            hidden = hidden.to(residual.dtype)  # (bfloat16 linears' rows: the next stage and the head take the model's)
        if self.norm is None:
            return IntermediateTensors(hidden=hidden, residual=residual)
        return self.norm(hidden, residual)[0]

    def _decode_stack(self, hidden, kv_caches, metadata):
        """The layers' C++ decode loop where it applies to this step (decode_stack.py), built on first use."""
        if not decode_stack.applies(hidden, kv_caches, metadata, self.tp_size):
            return None
        if self.stack is None:
            self.stack = decode_stack.build(list(self.layers.values()), self.eps)
        return self.stack


class LlamaForCausalLM(nn.Module):
    """One rank's shard of the model; build it, then fill it with
    `engine.model.loader.load_weights`."""

    def __init__(self, config: ModelConfig, groups: ParallelGroups | None = None, dtype: torch.dtype | None = None):
        super().__init__()
        groups = groups or ParallelGroups.single()
        config.verify_parallel(groups.tp_size, groups.pp_size)
        self.config, self.groups = config, groups
        self.dtype = dtype or config.torch_dtype
        self.model = LlamaModel(config, groups, self.dtype)
        self.lm_head = None
        if groups.is_last_stage:
            self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, groups, self.dtype)
            if config.tie_word_embeddings and self.model.embed_tokens is not None:
                self.lm_head.weight = self.model.embed_tokens.weight

    @property
    def layer_range(self) -> range:
        return self.model.layer_range

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[KVCache],
                attn_metadata: AttentionMetadata,
                intermediate: IntermediateTensors | None = None) -> torch.Tensor | IntermediateTensors:
        """Run this stage on one step's packed tokens.

        input_ids, positions: long [num_tokens] (input_ids unused past the
        first stage); kv_caches: one (key, value) pair per layer of this
        stage, in order; intermediate: what the previous stage returned
        (stages after the first). Returns the final hidden states
        [num_tokens, hidden] on the last stage, else IntermediateTensors.
        """
        if self.model.embed_tokens is None and intermediate is None:
            raise ValueError(f"pipeline stage {self.groups.pp_rank} needs the previous stage's intermediate")
        return self.model(input_ids, positions, kv_caches, attn_metadata, intermediate)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """Full-vocabulary logits [N, vocab] for hidden [N, hidden] (usually
        each sequence's last token) on TP rank 0 of the last stage; every TP
        rank of that stage must call it; the others get None."""
        if self.lm_head is None:
            raise RuntimeError(f"pipeline stage {self.groups.pp_rank} has no LM head; only the last stage does")
        return self.lm_head.logits(hidden)

    def checkpoint_weights(self) -> dict[str, list[tuple[nn.Module, str, int]]]:
        """Checkpoint tensor name -> the (module, parameter name, shard id)
        that take it: only the tensors this rank holds a part of."""
        plan: dict[str, list[tuple[nn.Module, str, int]]] = {}

        def add(name, module, param="weight", shard_id=0):
            plan.setdefault(name, []).append((module, param, shard_id))

        if self.model.embed_tokens is not None:
            add("model.embed_tokens.weight", self.model.embed_tokens)
        for i, layer in zip(self.layer_range, self.model.layers.values()):
            prefix = f"model.layers.{i}"
            attn, mlp = layer.self_attn, layer.mlp
            params = ["weight"] + (["bias"] if self.config.attention_bias else [])
            for shard_id, proj in enumerate(("q_proj", "k_proj", "v_proj")):
                for param in params:
                    add(f"{prefix}.self_attn.{proj}.{param}", attn.qkv_proj, param, shard_id)
            add(f"{prefix}.self_attn.o_proj.weight", attn.o_proj)
            if self.config.o_proj_bias:
                add(f"{prefix}.self_attn.o_proj.bias", attn.o_proj, "bias")
            add(f"{prefix}.mlp.gate_proj.weight", mlp.gate_up_proj, "weight", 0)
            add(f"{prefix}.mlp.up_proj.weight", mlp.gate_up_proj, "weight", 1)
            add(f"{prefix}.mlp.down_proj.weight", mlp.down_proj)
            add(f"{prefix}.input_layernorm.weight", layer.input_layernorm)
            add(f"{prefix}.post_attention_layernorm.weight", layer.post_attention_layernorm)
        if self.lm_head is not None:
            add("model.norm.weight", self.model.norm)
            if not self.config.tie_word_embeddings:
                add("lm_head.weight", self.lm_head)
            elif self.model.embed_tokens is None:  # tied, but the embedding lives on another stage
                add("model.embed_tokens.weight", self.lm_head)
        return plan
