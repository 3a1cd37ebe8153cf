"""`vsup plan` as an operator runs it: a real subprocess, its stdout, stderr and exit status."""

import json
import os
import subprocess
import sys

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.model_dirs import header_only_model

VSUP = [sys.executable, "-m", "vsup"]
SMOLLM2 = {  # the default model's config.json (SmolLM2-135M-Instruct)
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 576,
    "intermediate_size": 1536, "num_hidden_layers": 30, "num_attention_heads": 9,
    "num_key_value_heads": 3, "vocab_size": 49152, "rope_theta": 100000.0,
    "max_position_embeddings": 8192, "tie_word_embeddings": True, "torch_dtype": "bfloat16",
}


def vsup(*args, env=None):
    return subprocess.run([*VSUP, *args], capture_output=True, text=True, timeout=60, env=env)


@pytest.fixture
def smollm2_dir(tmp_path):
    return header_only_model(tmp_path / "smollm2", SMOLLM2)


@pytest.mark.parametrize("flags,total", [
    ([], 3),
    (["-tp", "4"], 6),
    (["-tp", "2", "-pp", "2"], 6),
    (["-tp", "2", "-dp", "4"], 17),
    (["-dp", "2", "--api-server-count", "1"], 6),
    (["--headless", "-dp", "4", "--dp-size-local", "2", "--dp-start-rank", "2", "-tp", "2",
      "--dp-address", "10.0.0.1:29550"], 6),
    (["--no-multiprocessing"], 1),
])
def test_plan_json_counts(flags, total):
    result = vsup("plan", "--device", "cpu", "--json", *flags)
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout)
    assert set(out) == {"total", "formula", "processes"}
    assert out["total"] == total == len(out["processes"])
    assert out["formula"].endswith(f"= {total} process{'' if total == 1 else 'es'}")
    for p in out["processes"]:
        assert set(p) == {"name", "role", "dp", "pp", "tp", "device", "title", "node"}


def test_plan_text_shows_tree_and_formula():
    result = vsup("plan", "--device", "cpu", "-tp", "4")
    assert result.returncode == 0
    lines = result.stdout.splitlines()
    assert lines[-1] == "1 api-server + 1 engine-core + 4 workers = 6 processes"
    worker_lines = [line for line in lines if "worker dp0 pp0 tp" in line]
    assert len(worker_lines) == 4 and all("vsup::worker_dp0_pp0_tp" in line for line in worker_lines)
    assert "engine-core dp0" in result.stdout and "api-server a0" in result.stdout


def test_environment_sets_an_option_and_a_flag_wins():
    import os
    env = dict(os.environ, VSUP_TENSOR_PARALLEL_SIZE="2", VSUP_ENABLE_MULTIPROCESSING="1")
    assert json.loads(vsup("plan", "--device", "cpu", "--json", env=env).stdout)["total"] == 4
    assert json.loads(vsup("plan", "--device", "cpu", "--json", "-tp", "1", env=env).stdout)["total"] == 3
    env["VSUP_ENABLE_MULTIPROCESSING"] = "0"
    assert json.loads(vsup("plan", "--device", "cpu", "--json", "-tp", "1", env=env).stdout)["total"] == 1


@pytest.mark.parametrize("flags,needle", [
    (["-tp", "0"], "-tp/--tensor-parallel-size must be at least 1"),
    (["-tp", "abc"], "--tensor-parallel-size"),
    (["-pp", "0"], "-pp/--pipeline-parallel-size"),
    (["--device", "gpu"], "--device"),
    (["--no-multiprocessing", "-dp", "2"], "--no-multiprocessing"),
    (["--no-multiprocessing", "--api-server-count", "2"], "--api-server-count 1"),
    (["--headless", "-dp", "2"], "--headless needs --dp-start-rank"),
    (["-dp", "2", "--dp-size-local", "1"], "give --dp-address HOST:PORT"),
    (["-dp", "2", "--dp-address", "10.0.0.1"], "--dp-address: expected HOST:PORT"),
    (["/nonexistent/model"], "not a directory"),
    (["--bogus"], "--bogus"),
])
def test_mistakes_exit_2_with_one_line(flags, needle):
    result = vsup("plan", "--device", "cpu", *flags)
    assert result.returncode == 2, result
    assert result.stdout == ""
    assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr
    assert needle in result.stderr


def test_more_gpus_than_visible_is_planned_with_a_note_and_refused_by_serve(tmp_path):
    """A plan is for the target, which need not be this machine: plan prints it and says in a note on stderr
    that this node could not run it; serve refuses it, before anything starts."""
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="0,1")
    result = vsup("plan", "--device", "cuda", "-tp", "4", "--json", env=env)
    assert result.returncode == 0 and json.loads(result.stdout)["total"] == 6
    assert result.stderr == "note: this node needs 4 GPUs (dp-size-local x tp x pp) but 2 are visible: " \
                            "`vsup serve` would refuse this plan here\n"
    assert vsup("plan", "--device", "cuda", "-tp", "2", env=env).stderr == ""
    serve = vsup("serve", "--device", "cuda", "-tp", "4", env={**env, "VSUP_HOME": str(tmp_path)})
    assert serve.returncode == 2 and "needs 4 GPUs" in serve.stderr and "2 are visible" in serve.stderr


def test_auto_device_without_gpu_is_cpu():
    import os
    result = vsup("plan", "--json", env=dict(os.environ, CUDA_VISIBLE_DEVICES=""))
    workers = [p for p in json.loads(result.stdout)["processes"] if p["role"] == "worker"]
    assert [w["device"] for w in workers] == ["cpu"]


def test_model_memory_figures(smollm2_dir):
    result = vsup("plan", str(smollm2_dir), "--device", "cpu", "--json", "--kv-cache-memory", "1GiB",
                  "--dtype", "float32")
    assert result.returncode == 0, result.stderr
    memory = json.loads(result.stdout)["memory"]
    worker = memory["workers"][0]
    assert worker["weight_bytes"] == 134_515_008 * 4  # SmolLM2-135M's parameters, float32 throughout
    assert worker["kv_bytes_per_token"] == 2 * 30 * 3 * 64 * 4
    assert memory["tokens_per_dp_rank"] == 2**30 // (2 * 30 * 3 * 64 * 4)


LINEARS = 30 * (576 * (576 + 2 * 192) + 576 * 576 + 3 * 576 * 1536)  # q/k/v, o, gate/up, down (the head is tied)


def test_the_cpus_default_is_bfloat16_linears_and_kv_cache_where_it_computes_them(smollm2_dir):
    """--dtype auto on a CPU with avx512_bf16: float32 weights around bfloat16 linears and KV cache (vLLM-CPU's
    default there is bfloat16); without it, or under --dtype float32, float32 throughout. Each part opts out."""
    from vsup.devices import cpu_computes_bfloat16

    def memory(*flags):
        result = vsup("plan", str(smollm2_dir), "--device", "cpu", "--json", *flags)
        assert result.returncode == 0, result.stderr
        m = json.loads(result.stdout)["memory"]
        return m["dtype"], m["linear_dtype"], m["kv_cache_dtype"], m["workers"][0]["weight_bytes"]

    f32 = ("float32", "float32", "float32", 134_515_008 * 4)
    assert memory("--dtype", "float32") == f32
    if not cpu_computes_bfloat16():
        assert memory() == f32
        return
    bf16_weights = LINEARS * 2 + (134_515_008 - LINEARS) * 4
    assert memory() == ("float32", "bfloat16", "bfloat16", bf16_weights)
    assert memory("--linear-dtype", "float32") == ("float32", "float32", "bfloat16", 134_515_008 * 4)
    assert memory("--kv-cache-dtype", "float32") == ("float32", "bfloat16", "float32", bf16_weights)
    assert memory("--engine", "vllm") == f32  # vLLM chooses its own: vsup gives it no dtype

    from vsup.cli.sizing import model_memory
    from vsup.topology import ParallelConfig

    def parts(cpu_here: bool):  # --k8s: a pod's CPU is not this one, so its pod is sized for float32
        plan = model_memory(str(smollm2_dir), ParallelConfig(device="cpu"), "auto", None, None, 0.9,
                            cpu_here=cpu_here)[1]
        return plan.linear_dtype, plan.kv_cache_dtype
    assert parts(cpu_here=True) == ("bfloat16", "bfloat16") and parts(cpu_here=False) == (None, None)


def test_cpu_auto_parts():
    from vsup.memory import cpu_auto_parts

    assert cpu_auto_parts("auto", "cpu", True, "auto", "auto") == ("bfloat16", "bfloat16")
    assert cpu_auto_parts("auto", "cpu", True, "float32", "auto") == ("float32", "bfloat16")
    assert cpu_auto_parts("auto", "cpu", False, "auto", "auto") == ("auto", "auto")
    assert cpu_auto_parts("float32", "cpu", True, "auto", "auto") == ("auto", "auto")
    assert cpu_auto_parts("auto", "cuda", True, "auto", "auto") == ("auto", "auto")


def test_bfloat16_linears_halve_the_linears_weights_where_the_cpu_computes_them(smollm2_dir):
    from vsup.devices import cpu_computes_bfloat16

    result = vsup("plan", str(smollm2_dir), "--device", "cpu", "--json", "--linear-dtype", "bfloat16", "--dtype",
                  "float32")
    if not cpu_computes_bfloat16():
        assert result.returncode == 2 and "needs a CPU with avx512_bf16 or AMX" in result.stderr
        return
    assert result.returncode == 0, result.stderr
    memory = json.loads(result.stdout)["memory"]
    assert (memory["dtype"], memory["linear_dtype"]) == ("float32", "bfloat16")
    assert memory["workers"][0]["weight_bytes"] == LINEARS * 2 + (134_515_008 - LINEARS) * 4
    assert memory["workers"][0]["kv_bytes_per_token"] == 2 * 30 * 3 * 64 * 4  # the KV cache stays float32
    for flags, needle in ((["--dtype", "float16"], "give --dtype float32 with it"),
                          (["--engine", "vllm"], "--linear-dtype not supported with --engine vllm")):
        result = vsup("plan", str(smollm2_dir), "--device", "cpu", "--linear-dtype", "bfloat16", *flags)
        assert result.returncode == 2 and needle in result.stderr, result.stderr


def test_bfloat16_linears_are_for_the_cpu():
    from vsup.errors import UsageError
    from vsup.memory import resolve_linear_dtype

    assert resolve_linear_dtype("auto", "float32", "cpu", cpu_bfloat16=True) is None
    assert resolve_linear_dtype("bfloat16", "bfloat16", "cuda", cpu_bfloat16=False) is None  # what --dtype gives
    with pytest.raises(UsageError, match="is for the CPU; on CUDA give --dtype bfloat16"):
        resolve_linear_dtype("bfloat16", "float32", "cuda", cpu_bfloat16=True)


def test_a_bfloat16_kv_cache_holds_twice_the_tokens(smollm2_dir):
    result = vsup("plan", str(smollm2_dir), "--device", "cpu", "--json", "--kv-cache-dtype", "bfloat16",
                  "--dtype", "float32")
    assert result.returncode == 0, result.stderr
    memory = json.loads(result.stdout)["memory"]
    assert (memory["dtype"], memory["linear_dtype"], memory["kv_cache_dtype"]) == ("float32", "float32", "bfloat16")
    assert memory["workers"][0]["weight_bytes"] == 134_515_008 * 4  # the weights stay float32
    assert memory["workers"][0]["kv_bytes_per_token"] == 2 * 30 * 3 * 64 * 2
    assert memory["tokens_per_dp_rank"] == 2**30 // (2 * 30 * 3 * 64 * 2)
    text = vsup("plan", str(smollm2_dir), "--device", "cpu", "--kv-cache-dtype", "bfloat16", "--dtype",
                "float32").stdout
    assert "float32 (KV cache bfloat16)" in text and "22.5 KiB per token, 46,603 tokens" in text
    for flags, needle in ((["--dtype", "float16"], "give --dtype float32 with it"),
                          (["--engine", "vllm"], "--kv-cache-dtype not supported with --engine vllm")):
        result = vsup("plan", str(smollm2_dir), "--device", "cpu", "--kv-cache-dtype", "bfloat16", *flags)
        assert result.returncode == 2 and needle in result.stderr, result.stderr


def test_a_bfloat16_kv_cache_is_for_the_cpu():
    from vsup.errors import UsageError
    from vsup.memory import resolve_kv_cache_dtype

    assert resolve_kv_cache_dtype("auto", "float32", "cpu") is None
    assert resolve_kv_cache_dtype("bfloat16", "bfloat16", "cuda") is None  # what --dtype gives
    with pytest.raises(UsageError, match="is for the CPU; on CUDA give --dtype bfloat16"):
        resolve_kv_cache_dtype("bfloat16", "float32", "cuda")


def test_model_tp_must_divide_heads(smollm2_dir):
    result = vsup("plan", str(smollm2_dir), "--device", "cpu", "-tp", "2")
    assert result.returncode == 2
    assert "-tp 1 or 3" in result.stderr
    assert vsup("plan", str(smollm2_dir), "--device", "cpu", "-tp", "3").returncode == 0
    assert "exceeds the model's 30 layers" in vsup("plan", str(smollm2_dir), "--device", "cpu", "-pp", "31").stderr


def test_model_that_does_not_fit_says_by_how_much(smollm2_dir):
    result = vsup("plan", str(smollm2_dir), "--device", "cpu", "--kv-cache-memory", "64MiB", "--dtype", "float32")
    assert result.returncode == 2
    # 64 MiB holds 1,456 tokens of 45 KiB (30 layers x K,V x 3 heads x 64 x 4 B); the model allows 8,192
    assert "won't fit" in result.stderr and "short by 6,736 tokens" in result.stderr
    assert vsup("plan", str(smollm2_dir), "--device", "cpu", "--kv-cache-memory", "64MiB",
                "--max-model-len", "1024").returncode == 0


def test_directory_without_config_is_not_a_model(tmp_path):
    result = vsup("plan", str(tmp_path), "--device", "cpu")
    assert result.returncode == 2 and "no config.json" in result.stderr


def test_plan_imports_no_torch_transformers_engine_or_other_commands(tmp_path):
    """`vsup plan` is the command run before every launch: it loads neither the model stack nor the
    modules of the commands it has nothing to do with. Of the engine it reads only the model's config
    (engine/model/config.py, the one reader of config.json)."""
    model = header_only_model(tmp_path / "smollm2", SMOLLM2)
    code = (f"import sys; sys.argv = ['vsup', 'plan', {str(model)!r}, '--device', 'cpu', '--json']\n"
            "from vsup.cli.main import run\n"
            "try:\n    run()\nexcept SystemExit:\n    pass\n"
            "heavy = [m for m in sys.modules if m in ('torch', 'transformers', 'vsup.cli.ps', 'vsup.cli.logs',\n"
            "         'vsup.cli.stop') or m.startswith('engine') and m not in ('engine', 'engine.model',\n"
            "         'engine.model.config')]\n"
            "print('HEAVY', heavy, 'engine.model.config' in sys.modules, file=sys.stderr)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert "HEAVY [] True" in result.stderr, result.stderr
    assert json.loads(result.stdout)["total"] >= 3


def test_ps_of_a_stopped_deployment_imports_only_what_it_draws(tmp_path):
    """`vsup ps` is typed again and again (issue 20: at most 1.3x `import typer`): for a deployment whose
    supervisor is gone it reads state.json and draws, without the planner's classes, the socket module
    (no control socket to ask), tempfile or the engine."""
    (tmp_path / "gone").mkdir(mode=0o700)
    (tmp_path / "gone" / "state.json").write_text(json.dumps(
        {"supervisor": {"name": "gone", "state": "stopped", "model": "m", "url": "u", "pid": 1, "started_at": 0},
         "processes": [{"name": "api-server a0", "role": "api-server", "a": 0, "dp": None, "pp": None, "tp": None,
                        "node": 0, "device": None, "title": "vsup: api-server a0", "unit": "api-server a0",
                        "pid": None, "state": "stopped", "restarts": 0, "last_exit": 0, "started_at": 0}]}))
    code = ("import sys; sys.argv = ['vsup', 'ps', '--name', 'gone']\n"
            "from vsup.cli.main import run\n"
            "try:\n    run()\nexcept SystemExit:\n    pass\n"
            "heavy = [m for m in sys.modules if m in ('vsup.topology', 'vsup.memory', 'dataclasses', 'socket',\n"
            "         'tempfile', 'torch') or m.startswith('engine')]\n"
            "print('HEAVY', heavy, file=sys.stderr)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                            env={**os.environ, "VSUP_HOME": str(tmp_path)})
    assert "HEAVY []" in result.stderr and "api-server a0" in result.stdout, (result.stdout, result.stderr)


def test_every_command_is_found_under_its_own_name():
    """main.COMMANDS (which modules to import for a command) names exactly the commands each module defines."""
    import importlib

    from vsup.cli.main import COMMANDS
    for module in set(COMMANDS.values()):
        app = importlib.import_module(f"vsup.cli.{module}").app
        defined = {c.name or c.callback.__name__.replace("_", "-") for c in app.registered_commands} | \
            {g.typer_instance.info.name for g in app.registered_groups}  # (a command with subcommands)
        assert defined == {command for command, its_module in COMMANDS.items() if its_module == module}
    for command in COMMANDS:
        assert vsup(command, "--help").returncode == 0
    assert vsup("stpo").returncode == 2


def test_version_and_help():
    from vsup import __version__
    assert vsup("--version").stdout.strip() == f"vsup {__version__}"
    helptext = vsup("plan", "--help").stdout
    for flag in ("--tensor-parallel-size", "--pipeline-parallel-size", "--data-parallel-size",
                 "--api-server-count", "--dp-size-local", "--dp-start-rank", "--headless", "--device",
                 "--no-multiprocessing", "--kv-cache-memory", "--gpu-memory-utilization", "--json"):
        assert flag in helptext


def test_serve_refuses_what_it_cannot_run_before_starting_anything(tmp_path):
    import os
    env = dict(os.environ, VSUP_HOME=str(tmp_path))
    for flags, needle in ((["--no-multiprocessing", "-dp", "2"], "--no-multiprocessing"),
                          (["--port", "0"], "--port must be between 1 and 65535"),
                          (["--restart-policy", "sometimes"], "--restart-policy")):
        result = vsup("serve", "--device", "cpu", *flags, env=env)
        assert result.returncode == 2 and needle in result.stderr, result.stderr
    assert not list(tmp_path.iterdir())  # no run dir was made


BAD_VALUES = [  # (flags, the option the one line names): plan without a model once printed a plan for each
    (["--kv-cache-memory", "12XB"], "--kv-cache-memory"),
    (["--kv-cache-memory", "-5"], "--kv-cache-memory"),
    (["--kv-cache-memory", "0"], "--kv-cache-memory"),
    (["--max-model-len", "-1"], "--max-model-len"),
    (["--max-model-len", "0"], "--max-model-len"),
    (["--gpu-memory-utilization", "5"], "--gpu-memory-utilization"),
    (["--gpu-memory-utilization", "nan"], "--gpu-memory-utilization"),
    (["--gpu-memory-utilization", "0"], "--gpu-memory-utilization"),
]


@pytest.mark.parametrize("flags,option", BAD_VALUES, ids=[" ".join(f) for f, _ in BAD_VALUES])
def test_plan_refuses_what_serve_refuses_with_one_line_naming_the_option(flags, option, tmp_path):
    """The value checks are one function for both commands, with or without a model; `serve` (its run dir
    impossible here, so it could start nothing) says the same of the value before anything else."""
    plan = vsup("plan", "--device", "cpu", *flags)
    assert plan.returncode == 2 and plan.stdout == "", plan
    assert plan.stderr.count("\n") == 1 and option in plan.stderr and "Traceback" not in plan.stderr
    (tmp_path / "file").write_text("")
    serve = vsup("serve", "--device", "cpu", *flags, env=dict(os.environ, VSUP_HOME=str(tmp_path / "file" / "home")))
    assert serve.returncode == 2 and serve.stderr.replace("vsup serve", "vsup plan") == plan.stderr, serve


VALUES = {  # each a value check's option, with values good and bad, as a user types them
    "--kv-cache-memory": st.sampled_from(["1GiB", "512MiB", "4G", "12XB", "-5", "0", "1e3", "nan", "", "2 GiB"]),
    "--max-model-len": st.sampled_from(["512", "1", "-1", "0", "8k", "100000000000"]),
    "--gpu-memory-utilization": st.sampled_from(["0.9", "1", "0.01", "5", "nan", "inf", "0", "-0.5"]),
    "--max-num-seqs": st.sampled_from(["1", "256", "0", "-3"]),
    "--port": st.sampled_from(["8000", "1", "65535", "0", "65536", "-1"]),
    "--max-restarts": st.sampled_from(["0", "5", "-1"]),
}


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(chosen=st.dictionaries(st.sampled_from(sorted(VALUES)), st.none(), min_size=1, max_size=3).flatmap(
    lambda keys: st.fixed_dictionaries({k: VALUES[k] for k in keys})))
def test_plans_exit_is_serves_verdict_on_the_values(chosen, tmp_path):
    """Whatever values a user gives, `plan` refuses (exit 2, one line) exactly what `serve` refuses before it
    looks at the machine, with the same line; what plan takes, serve takes too, and goes on to the run dir
    (impossible here, so that it starts nothing)."""
    flags = [part for option, value in chosen.items() for part in (option, value)]
    plan = vsup("plan", "--device", "cpu", *flags)
    (tmp_path / "file").write_text("")
    serve = vsup("serve", "--device", "cpu", *flags, env=dict(os.environ, VSUP_HOME=str(tmp_path / "file" / "h")))
    assert plan.returncode in (0, 2) and serve.returncode == 2 and "Traceback" not in plan.stderr + serve.stderr
    if plan.returncode == 2:
        assert serve.stderr.replace("vsup serve", "vsup plan") == plan.stderr and plan.stderr.count("\n") == 1
    else:
        assert "the run dir" in serve.stderr, (flags, serve.stderr)


def test_plan_takes_every_option_of_serve_and_says_which_do_not_change_it(tmp_path):
    """A user who swaps `serve` for `plan` keeps the flags: every option of serve is one of plan's (one option
    set, by construction); those that do not shape the tree say so in plan's --help, and are checked."""
    from typer.main import get_command

    from vsup.cli.main import make_app

    commands = get_command(make_app()).commands
    plans = {opt: p for p in commands["plan"].params for opt in p.opts}
    missing = [opt for p in commands["serve"].params for opt in p.opts if opt not in plans]
    assert not missing, missing
    assert plans["--vllm-bin"].help.startswith("[serve's: checked, kept, no change to the plan]")
    assert not plans["-tp"].help.startswith("[serve's")  # what shapes the tree is plan's own
    taken = vsup("plan", "--engine", "vllm", "--device", "cpu", "--vllm-bin", str(tmp_path / "nowhere"), "--api-key",
                 "k", "--port", "9000", "--restart-policy", "always", "--name", "other", "--json")
    assert taken.returncode == 0, taken.stderr
    assert json.loads(taken.stdout)["processes"][0]["name"] == "front"
    refused = vsup("plan", "--device", "cpu", "--max-restarts", "-1")
    assert refused.returncode == 2 and "--max-restarts" in refused.stderr  # checked as serve checks it
