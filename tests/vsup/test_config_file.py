"""`--config FILE` for plan and serve, run as an operator runs it: flag > VSUP_* > file > default."""

import json
import os
import subprocess
import sys

import pytest

from tests.model_dirs import header_only_model

VSUP = [sys.executable, "-m", "vsup"]
SMOLLM2 = {  # the default model's config.json (SmolLM2-135M-Instruct)
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 576,
    "intermediate_size": 1536, "num_hidden_layers": 30, "num_attention_heads": 9,
    "num_key_value_heads": 3, "vocab_size": 49152, "rope_theta": 100000.0,
    "max_position_embeddings": 8192, "tie_word_embeddings": True, "torch_dtype": "bfloat16",
}


def vsup(*args, cwd, env=None):
    clean = {k: v for k, v in os.environ.items() if not k.startswith("VSUP_")}
    return subprocess.run([*VSUP, *args], capture_output=True, text=True, timeout=60, cwd=cwd,
                          env={**clean, "VSUP_HOME": str(cwd / "home"), **(env or {})})


def total(*args, cwd, env=None) -> int:
    result = vsup("plan", "--json", *args, cwd=cwd, env=env)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)["total"]


def write(path, text: str):
    path.write_text(text)
    return path.name


def test_toml_sets_options_and_flags_and_variables_win(tmp_path):
    name = write(tmp_path / "deploy.toml", 'tensor-parallel-size = 2\ndevice = "cpu"\n')
    assert total(cwd=tmp_path) == 3  # the default
    assert total("--config", name, cwd=tmp_path) == 4  # the file over the default
    env = {"VSUP_TENSOR_PARALLEL_SIZE": "3"}
    assert total("--config", name, cwd=tmp_path, env=env) == 5  # the variable over the file
    assert total("--config", name, "-tp", "4", cwd=tmp_path, env=env) == 6  # the flag over both
    assert total("-tp", "4", "--config", name, cwd=tmp_path) == 6  # wherever the flag stands


@pytest.mark.parametrize("suffix", [".yaml", ".yml"])
def test_yaml_with_underscored_keys(tmp_path, suffix):
    name = write(tmp_path / f"deploy{suffix}",
                 "tensor_parallel_size: 2\ndata_parallel_size: 2\napi-server-count: 1\ndevice: CPU\n")
    assert total("--config", name, cwd=tmp_path) == 1 + 2 + 4 + 1


def test_boolean_flag_in_the_file_and_its_overrides(tmp_path):
    name = write(tmp_path / "one.toml", 'multiprocessing = false\ndevice = "cpu"\n')
    assert total("--config", name, cwd=tmp_path) == 1
    assert total("--config", name, "--multiprocessing", cwd=tmp_path) == 3
    assert total("--config", name, cwd=tmp_path, env={"VSUP_ENABLE_MULTIPROCESSING": "1"}) == 3


def test_model_key_and_json_key(tmp_path):
    model = header_only_model(tmp_path / "smollm2", SMOLLM2)
    name = write(tmp_path / "deploy.toml",
                 f'model = "{model}"\ntensor-parallel-size = 3\ndevice = "cpu"\njson = true\n')
    result = vsup("plan", "--config", name, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout)
    assert out["total"] == 5 and len(out["memory"]["workers"]) == 1


def test_one_file_for_plan_and_serve(tmp_path):
    name = write(tmp_path / "deploy.toml",
                 'tensor-parallel-size = 2\ndevice = "cpu"\nport = 8123\nrestart-policy = "always"\n')
    assert total("--config", name, cwd=tmp_path) == 4  # plan skips what only serve takes


def test_config_from_the_environment_and_the_flag_wins(tmp_path):
    two = write(tmp_path / "two.toml", 'tensor-parallel-size = 2\ndevice = "cpu"\n')
    four = write(tmp_path / "four.toml", 'tensor-parallel-size = 4\ndevice = "cpu"\n')
    assert total(cwd=tmp_path, env={"VSUP_CONFIG": two}) == 4
    assert total("--config", four, cwd=tmp_path, env={"VSUP_CONFIG": two}) == 6


def test_empty_files_change_nothing(tmp_path):
    assert total("--device", "cpu", "--config", write(tmp_path / "empty.yaml", ""), cwd=tmp_path) == 3
    assert total("--device", "cpu", "--config", write(tmp_path / "empty.toml", ""), cwd=tmp_path) == 3


@pytest.mark.parametrize("filename,text,needles", [
    ("bad.toml", "tensor-paralel-size = 2\n", ["unknown key 'tensor-paralel-size'", "tensor-parallel-size"]),
    ("bad.toml", "tp = 2\n", ["unknown key 'tp'"]),
    ("bad.toml", "port = 8000\nprot = 1\n", ["unknown key 'prot'", "'port'"]),
    ("bad.toml", 'tensor-parallel-size = "abc"\n', ["tensor-parallel-size", "'abc'"]),
    ("bad.toml", "tensor-parallel-size = 2.5\n", ["tensor-parallel-size must be an integer"]),
    ("bad.toml", "tensor-parallel-size = true\n", ["tensor-parallel-size must be an integer"]),
    ("bad.toml", "tensor-parallel-size = [2]\n", ["tensor-parallel-size must be an integer"]),
    ("bad.toml", "headless = 3\n", ["headless must be true or false"]),
    ("bad.toml", 'device = "gpu"\n', ["device", "'gpu'", "cpu"]),
    ("bad.toml", 'port = "abc"\n', ["port", "'abc'"]),  # only serve takes it, plan still checks it
    ("bad.toml", "tensor-parallel-size = 2\ntensor_parallel_size = 3\n", ["tensor_parallel_size is given twice"]),
    ("bad.toml", "tensor-parallel-size = \n", ["not valid TOML", "line 1"]),
    ("bad.yaml", "tensor-parallel-size: [2\n", ["not valid YAML", "line 2"]),
    ("bad.yaml", "- 2\n", ["mapping of option names"]),
    ("bad.json", "{}", [".toml, .yaml or .yml"]),
    ("bad.toml", "tensor-parallel-size = 0\n",  # refused after parsing, still blamed on the file
     ["-tp/--tensor-parallel-size must be at least 1", "set by tensor-parallel-size in --config bad.toml"]),
    ("bad.toml", "headless = true\ndata-parallel-size = 2\n", ["--headless needs --dp-start-rank", "set by headless"]),
])
def test_mistakes_exit_2_with_one_line_naming_the_file(tmp_path, filename, text, needles):
    write(tmp_path / filename, text)
    result = vsup("plan", "--device", "cpu", "--config", filename, cwd=tmp_path)
    assert result.returncode == 2, result
    assert result.stdout == ""
    assert len(result.stderr.splitlines()) == 1, result.stderr
    line = result.stderr.strip()
    assert line.startswith("vsup plan: error: ") and filename in line, line
    for needle in needles:
        assert needle in line, line


def test_a_missing_file(tmp_path):
    result = vsup("plan", "--config", "nowhere.toml", cwd=tmp_path)
    assert result.returncode == 2
    assert result.stderr.strip() == "vsup plan: error: --config nowhere.toml: No such file or directory"


def test_a_value_the_flag_replaced_is_not_blamed_on_the_file(tmp_path):
    name = write(tmp_path / "deploy.toml", "tensor-parallel-size = 2\n")
    result = vsup("plan", "--device", "cpu", "--config", name, "-tp", "0", cwd=tmp_path)
    assert result.returncode == 2
    assert "must be at least 1" in result.stderr and "deploy.toml" not in result.stderr


def test_serve_reads_the_file_and_a_variable_wins(tmp_path):
    # an out-of-range port is refused before anything starts, so serve's reading is seen without a launch
    name = write(tmp_path / "serve.toml", 'port = 70000\ndevice = "cpu"\n')
    result = vsup("serve", "--config", name, cwd=tmp_path)
    assert result.returncode == 2
    assert result.stderr.strip() == ("vsup serve: error: --port must be between 1 and 65535 (got 70000) "
                                     "(set by port in --config serve.toml)")
    result = vsup("serve", "--config", name, cwd=tmp_path, env={"VSUP_PORT": "0"})
    assert result.returncode == 2
    assert "(got 0)" in result.stderr and "serve.toml" not in result.stderr
    result = vsup("serve", "--config", write(tmp_path / "typo.yaml", "max-num-seq: 8\n"), cwd=tmp_path)
    assert result.returncode == 2
    assert "unknown key 'max-num-seq'; did you mean 'max-num-seqs'?" in result.stderr
    assert not (tmp_path / "home").exists()  # nothing was started, not even a run dir


def test_help_names_the_option():
    for command in ("plan", "serve"):
        result = subprocess.run([*VSUP, command, "--help"], capture_output=True, text=True, timeout=60)
        assert "--config FILE" in result.stdout and "VSUP_CONFIG" in result.stdout


def test_plan_imports_a_parser_only_for_a_file(tmp_path):
    name = write(tmp_path / "deploy.toml", 'device = "cpu"\n')
    probe = ("import atexit, sys; atexit.register(lambda: print(*(m in sys.modules for m in "
             "('vsup.cli.config_file', 'yaml', 'torch', 'engine')), file=sys.stderr)); "
             "sys.argv = ['vsup', 'plan', *sys.argv[1:]]; from vsup.cli.main import run; run()")
    for args, expected in ((["--device", "cpu"], "False False False False"),
                           (["--config", name], "True False False False")):
        result = subprocess.run([sys.executable, "-c", probe, *args], capture_output=True, text=True, timeout=60,
                                cwd=tmp_path)
        assert result.returncode == 0, result.stderr
        assert result.stderr.strip() == expected
