"""A decode step through a stage's layers in one C++ call (engine/ops/csrc/decoder_stack.cpp).

On the CPU in float32, with the kernels built and every linear packed, a step whose sequences each
add one token runs the layers' loop in C++: the same kernels and oneDNN linears as the Python loop
in llama.py, which stays the path for prefill, tensor parallelism (collectives between the linears),
other devices and dtypes, and the reference the stack is tested against.
"""

from __future__ import annotations

import torch

from engine.model.attention import CPU_KERNEL_CACHE_DTYPES
from engine.ops import cpu_extension


def build(layers: list, eps: float):
    """The stack of these decoder layers, or None where it cannot run them (an unpacked linear:
    not float32 on the CPU, or VSUP_PACKED_LINEAR=0)."""
    attn = [layer.self_attn for layer in layers]
    mlp = [layer.mlp for layer in layers]
    linears = [m for a, f in zip(attn, mlp) for m in (a.qkv_proj, a.o_proj, f.gate_up_proj, f.down_proj)]
    if not layers or any(m.packed is None for m in linears) or any(m.bias is not None for m in (
            *(f.gate_up_proj for f in mlp), *(f.down_proj for f in mlp))):
        return None
    first = attn[0]
    return torch.classes.vsup_cpu.DecoderStack(
        [layer.input_layernorm.weight for layer in layers], [a.qkv_proj.packed for a in attn],
        [a.qkv_proj.bias for a in attn] if first.qkv_proj.bias is not None else [],
        [a.o_proj.packed for a in attn], [a.o_proj.bias for a in attn] if first.o_proj.bias is not None else [],
        [layer.post_attention_layernorm.weight for layer in layers], [f.gate_up_proj.packed for f in mlp],
        [f.down_proj.packed for f in mlp], first.num_heads, first.num_kv_heads, first.head_dim, eps, first.scale)


def applies(hidden: torch.Tensor, kv_caches: list, metadata, tp_size: int) -> bool:
    """A decode-only step, on one rank, where the kernels take the activations and the caches."""
    return (metadata.is_decode_only and tp_size == 1 and bool(kv_caches) and cpu_extension.is_available(hidden)
            and all(k.dtype in CPU_KERNEL_CACHE_DTYPES and k.is_contiguous() and v.is_contiguous()
                    for k, v in kv_caches))


def run(stack, hidden: torch.Tensor, residual: torch.Tensor | None, rope: tuple[torch.Tensor, torch.Tensor],
        kv_caches: list, metadata) -> tuple[torch.Tensor, torch.Tensor]:
    """(hidden, residual) after the stage's last layer, as the Python loop returns them."""
    cos, sin = rope
    return stack.forward(hidden, residual, cos.squeeze(1), sin.squeeze(1), [k for k, _ in kv_caches],
                         [v for _, v in kv_caches], metadata.slot_mapping, metadata.block_tables, metadata.seq_lens)
