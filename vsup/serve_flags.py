"""The serving flags both engines take, and the argv our own engine's processes get from them."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ServeFlags:
    """What `vsup serve` was told about serving, whichever engine serves: vsup's flags that map to
    our engine's arguments (`engine_args`) and to vLLM's (vsup/vllm/args.py)."""

    model: str
    served_model_name: str
    host: str
    port: int
    dtype: str
    max_num_seqs: int
    seed: int
    drain_timeout: float
    gpu_memory_utilization: float
    max_model_len: int | None = None
    kv_cache_bytes: int | None = None
    max_grammar_bytes: int | None = None  # our engine's limit on a structured request's grammar (default 64 KiB)
    linear_dtype: str | None = None  # our engine's: the dtype a float32 model's linears compute in
    kv_cache_dtype: str | None = None  # our engine's: the dtype a float32 model's KV cache stores
    uds: str | None = None  # a Unix socket to serve on instead of host and port (vLLM behind vsup's front)
    asked: frozenset[str] = frozenset()  # the flags of these the user gave (`vllm serve` gets no others)


def engine_args(flags: ServeFlags, *, multiprocessing: bool = True, dp_lockstep: bool = False) -> tuple[str, ...]:
    """The flags every process of our engine receives (topology.plan puts them after its own)."""
    return ("--model", flags.model, "--served-model-name", flags.served_model_name, "--host", flags.host,
            "--port", str(flags.port), "--dtype", flags.dtype, "--max-num-seqs", str(flags.max_num_seqs),
            "--kv-cache-bytes", str(flags.kv_cache_bytes), "--seed", str(flags.seed),
            "--drain-timeout", str(flags.drain_timeout),
            *(("--max-model-len", str(flags.max_model_len)) if flags.max_model_len else ()),
            *(("--max-grammar-bytes", str(flags.max_grammar_bytes)) if flags.max_grammar_bytes else ()),
            *(("--linear-dtype", flags.linear_dtype) if flags.linear_dtype else ()),
            *(("--kv-cache-dtype", flags.kv_cache_dtype) if flags.kv_cache_dtype else ()),
            *(() if multiprocessing else ("--no-multiprocessing",)),
            *(("--dp-lockstep",) if dp_lockstep else ()))
