"""The contract between vsup and engine: argv, names, config.json and arithmetic both sides must agree on."""

import json
from dataclasses import fields
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.distributed import layer_range
from engine.model.config import ModelConfig
from engine.worker.worker_proc import parse_args
from vsup.errors import UsageError
from vsup.memory import layer_ranges, worker_weight_bytes
from vsup.model_shape import ModelShape, read_model_shape
from vsup.topology import WORKER, ParallelConfig, plan


@given(st.integers(1, 200), st.integers(1, 16))
def test_planner_and_engine_split_layers_alike(num_layers, pp):
    if pp <= num_layers:
        assert layer_ranges(num_layers, pp) == [layer_range(num_layers, pp, s) for s in range(pp)]


def test_worker_accepts_the_argv_the_topology_gives_it():
    p = plan(ParallelConfig(tensor_parallel_size=2, pipeline_parallel_size=2, data_parallel_size=2, device="cuda"),
             engine_args=("--model", "m", "--core-address", "ipc://x"))
    for spec in p.processes:
        if spec.role != WORKER:
            continue
        args = parse_args(list(spec.argv[3:]))
        assert (args.dp_rank, args.pp_rank, args.tp_rank) == (spec.dp, spec.pp, spec.tp)
        assert args.device == spec.device
        assert (args.tensor_parallel_size, args.pipeline_parallel_size, args.data_parallel_size) == (2, 2, 2)


def test_every_role_parses_the_argv_serve_gives_it():
    from engine.api_server.server import parse_args as api_server_args

    from engine.core.engine_core_proc import parse_args as core_args

    p = plan(ParallelConfig(tensor_parallel_size=2, data_parallel_size=2, device="cpu"),
             engine_args=("--model", "m"), run_dir="/run/x", deployment="x")
    for spec in p.processes:
        argv = list(spec.argv[3:])
        if spec.role == "api-server":
            args = api_server_args(argv)
            assert args.engine_address.endswith(f"a{spec.a}-engines.sock") and args.coordinator_address
            assert args.api_server_count == 2 and args.state_file == "/run/x/state.json"
        elif spec.role == "engine-core":
            args = core_args(argv)
            assert args.dp_rank == spec.dp and len(args.api_server_address) == 2
            assert args.ring_prefix == f"vsup-x-dp{spec.dp}" and args.coordinator_address
        elif spec.role == WORKER:
            assert parse_args(argv).core_address.endswith(f"dp{spec.dp}-workers.sock")


CONFIGS = Path(__file__).parent / "model_configs"
# config.json as each checkpoint publishes it, and its published parameter count
PUBLISHED = {"llama-3.2-1b": 1_235_814_400, "qwen2.5-0.5b-instruct": 494_032_768, "mistral-7b-v0.1": 7_241_732_096,
             "smollm2-135m-instruct": 134_515_008}


@pytest.mark.parametrize("name, attention_bias", [(n, None) for n in PUBLISHED] + [
    ("qwen2.5-0.5b-instruct", False), ("qwen2.5-0.5b-instruct", True), ("llama-3.2-1b", True)])
def test_planner_and_engine_read_a_real_config_json_alike(tmp_path, name, attention_bias):
    """vsup plan and the engine read config.json through one reader, and agree on every field of the
    shape; the planner's weight arithmetic gives the checkpoint's published parameter count. Qwen2's
    q/k/v carry a bias whatever its config's attention_bias says, and never its o_proj; Llama's
    attention_bias covers all four."""
    hf = json.loads((CONFIGS / f"{name}.json").read_text())
    if attention_bias is not None:
        hf["attention_bias"] = attention_bias
    (tmp_path / "config.json").write_text(json.dumps(hf))
    engine = ModelConfig.from_pretrained(tmp_path)
    planner = read_model_shape(tmp_path)
    shared = {f.name for f in fields(ModelShape)} - {"name"}
    assert {f: getattr(planner, f) for f in shared} == {f: getattr(engine, f) for f in shared}
    qwen2 = hf["model_type"] == "qwen2"
    assert (engine.attention_bias, engine.o_proj_bias) == ((True, False) if qwen2 else (bool(attention_bias),) * 2)
    params = worker_weight_bytes(planner, tp=1, pp=1, stage=0, dtype_bytes=1)
    if attention_bias is None:
        assert params == PUBLISHED[name]
    elif not qwen2 and attention_bias:
        h = planner.hidden_size
        assert params == PUBLISHED[name] + planner.num_layers * (2 * h + 2 * planner.num_kv_heads * planner.head_dim)


def test_a_model_our_engine_does_not_run_is_refused_by_plan_but_planned_for_a_stock_vllm():
    gemma = {"architectures": ["Gemma2ForCausalLM"], "model_type": "gemma2", "hidden_act": "gelu_pytorch_tanh",
             "hidden_size": 2304, "intermediate_size": 9216, "num_attention_heads": 8, "num_key_value_heads": 4,
             "head_dim": 256, "num_hidden_layers": 26, "vocab_size": 256000, "max_position_embeddings": 8192,
             "torch_dtype": "float32"}
    with pytest.raises(UsageError, match="Gemma2ForCausalLM.*not supported"):
        ModelShape.from_config(gemma)
    assert ModelShape.from_config(gemma, strict=False).head_dim == 256


def test_max_grammar_bytes_reaches_the_api_server_and_the_engine_core():
    from engine.api_server.server import parse_args as api_server_args
    from vsup.serve_flags import ServeFlags, engine_args

    from engine.core.engine_core_proc import parse_args as core_args

    flags = ServeFlags(model="m", served_model_name="m", host="h", port=1, dtype="auto", max_num_seqs=4, seed=0,
                       drain_timeout=1.0, gpu_memory_utilization=0.9, kv_cache_bytes=1 << 20, max_grammar_bytes=1234)
    argv = list(engine_args(flags))
    assert api_server_args([*argv, "--engine-address", "ipc://x"]).max_grammar_bytes == 1234
    core = core_args([*argv, "--worker-address", "a", "--control-address", "b", "--ring-prefix", "c",
                      "--wakeup-address", "d"])
    assert core.max_grammar_bytes == 1234 and core.grammar_compile_timeout == 10.0


@settings(deadline=None)  # (the first example's time is the imports')
@given(status=st.sampled_from([400, 401, 404, 405, 413, 422, 429, 500, 502, 503, 504]), message=st.text(max_size=40),
       param=st.none() | st.sampled_from(["model", "top_p"]), code=st.none() | st.just("model_not_found"))
def test_the_engine_and_the_front_answer_errors_in_one_shape(status, message, param, code):
    """Each writes OpenAI's error body itself (neither imports the other): the engine's shape is the one."""
    from engine.api_server.errors import error_body as engines
    from vsup.front.errors import error_body as fronts

    assert fronts(status, message, param, code) == engines(status, message, param, code)
