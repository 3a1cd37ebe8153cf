"""Text views of a plan: the process tree per node and the memory figures. Formatting only."""

from __future__ import annotations

from typing import TYPE_CHECKING

from vsup.roles import ENGINE_CORE, WORKER

if TYPE_CHECKING:  # (`vsup ps` draws its tree without the planner's classes)
    from vsup.topology import Plan
    from vsup.memory import MemoryPlan
    from vsup.model_shape import ModelShape


def tree_rows(processes: list, role=lambda p: p.role, group=lambda p: (p.r, p.dp)) -> list[tuple[str, object]]:
    """(branch prefix, process) rows: workers hang under their engine core (the same replica and DP rank,
    `group`). `plan` draws ProcessSpecs, `ps` its live rows (dicts, with their own `role` and `group`).

    In-process mode has no engine core, so its workers hang under the API server; so do a vLLM's headless
    node's, under its `vllm serve --headless` (the first of the node's processes, which starts them)."""
    workers = [p for p in processes if role(p) == WORKER]
    has_core = any(role(p) == ENGINE_CORE for p in processes)
    top = [p for p in processes if role(p) != WORKER]
    if not top:  # a node with only workers of a group that spans nodes: their core is on node 0
        top, workers = workers, []
    rows = []
    for i, parent in enumerate(top):
        last = i == len(top) - 1
        rows.append(("└── " if last else "├── ", parent))
        if role(parent) == ENGINE_CORE:
            children = [w for w in workers if group(w) == group(parent)]
        else:
            children = [] if has_core or i > 0 else workers
        for j, child in enumerate(children):
            rows.append((("    " if last else "│   ") + ("└── " if j == len(children) - 1 else "├── "), child))
    return rows


def render_plan(plan: Plan, placement: dict | None = None) -> str:
    """The tree under the supervisor of each node, then the formula; with `placement` (name ->
    vsup.placement.Placement), each process's CPUs."""
    lines = []
    many_nodes = len(plan.nodes()) > 1 or plan.config.headless
    for node in plan.nodes():
        processes = plan.on_node(node)
        rows = tree_rows(processes)
        width = max(len(prefix) + len(p.name) for prefix, p in rows)
        cpus_width = max(len(placement[p.name].describe()) for p in processes) if placement else 0
        where = f"node {node}" + (" (head)" if node == 0 else " (headless)")
        lines.append(f"supervisor (vsup serve{', ' + where if many_nodes else ''})")
        for prefix, p in rows:
            cpus = f"  cpus {placement[p.name].describe():<{cpus_width}}" if placement else ""
            lines.append(f"{prefix}{p.name:<{width - len(prefix)}}  {p.device or '-':<8}{cpus}  {p.title}")
        if many_nodes:
            share = type(plan)(plan.config, tuple(processes), plan.roles)  # (no dataclasses import: `ps` draws too)
            lines.append(f"{where}: {share.formula}")
        lines.append("")
    lines.append(plan.formula)
    if plan.config.headless:
        rest = "engine core" if plan.config.nnodes > 1 else "coordinator"
        lines.append(f"(this node only: the API servers and the {rest} run on the head node)")
    return "\n".join(lines)


def render_memory(shape: ModelShape, memory: MemoryPlan, max_model_len: int | None) -> str:
    """Per-worker weights and KV figures, and the token capacity of each DP rank."""
    from vsup.sizes import format_bytes

    lines = [f"model {shape.name}: {shape.num_layers} layers, hidden {shape.hidden_size}, "
             f"{shape.num_heads} heads ({shape.num_kv_heads} KV), vocab {shape.vocab_size}, {memory.dtype}"
             + (f" (linears {memory.linear_dtype})" if memory.linear_dtype else "")
             + (f" (KV cache {memory.kv_cache_dtype})" if memory.kv_cache_dtype else "")]
    for s in memory.stages:
        lines.append(f"  worker pp{s.stage} (each tp rank): layers {s.layers.start}-{s.layers.stop - 1}, "
                     f"weights {format_bytes(s.weight_bytes)}, KV {format_bytes(s.kv_bytes_per_token)}/token, "
                     f"KV cache {format_bytes(s.kv_cache_bytes)}")
    lines.append(f"  KV cache per DP rank: {format_bytes(memory.kv_bytes_per_token)} per token, "
                 f"{memory.tokens_per_dp_rank:,} tokens "
                 f"(max-model-len {max_model_len or shape.max_position_embeddings:,})")
    return "\n".join(lines)
