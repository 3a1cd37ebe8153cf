"""The one check of a model directory (vsup/model_dir.py), from its files alone, for plan and serve alike:
real checkpoints of every shape we serve pass, and each way a directory can be incomplete is one line."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors import safe_open

from engine.model.config import ModelConfig
from tests.conftest import VARIANTS
from tests.local_deployment import with_test_tokenizer
from tests.model_dirs import header_only_model
from vsup.errors import UsageError
from vsup.model_dir import check_model_dir
from vsup.model_shape import read_model_shape

SMOLLM2 = json.loads((Path(__file__).parents[1] / "model_configs" / "smollm2-135m-instruct.json").read_text())


def check(path, engine="vsup", vllm_args=()):
    check_model_dir(path, read_model_shape(path, strict=engine != "vllm"), engine, vllm_args)


@pytest.fixture
def served(tiny_model, tmp_path):
    """served(variant) -> a copy of that tiny checkpoint with a tokenizer: what serve takes."""
    return lambda variant: with_test_tokenizer(tiny_model(variant), tmp_path / variant)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_every_checkpoint_we_serve_passes(served, variant):
    """Tied heads (lm_head absent), Qwen2's q/k/v biases, Llama's attention_bias on o_proj, and shards listed
    in model.safetensors.index.json, as transformers writes them."""
    check(served(variant))


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_config_json_names_every_tensor_transformers_writes(tiny_model, variant):
    """ModelConfig.checkpoint_shapes() is what transformers saves for that config.json, less a tied head."""
    path = tiny_model(variant)
    written = {}
    for file in path.glob("*.safetensors"):
        with safe_open(file, "np") as f:
            written.update({name: tuple(f.get_slice(name).get_shape()) for name in f.keys()})
    config = ModelConfig.from_pretrained(path)
    if config.tie_word_embeddings:
        written.pop("lm_head.weight", None)
    assert config.checkpoint_shapes() == written


def test_a_header_only_model_passes_and_the_default_model_would(tmp_path):
    check(header_only_model(tmp_path / "smollm2", SMOLLM2))


def refused(path, *needles, engine="vsup", vllm_args=()):
    with pytest.raises(UsageError) as e:
        check(path, engine, vllm_args)
    message = str(e.value)
    assert "\n" not in message and str(path) in message
    for needle in needles:
        assert needle in message, message
    return message


def test_no_tokenizer(served):
    model = served("llama")
    (model / "tokenizer.json").unlink()
    refused(model, "has no tokenizer.json", "the API server needs")
    check(model, engine="vllm")  # a stock vLLM has tokenizers of its own kinds: not ours to judge


def test_a_tokenizer_config_that_is_not_json(served):
    model = served("llama")
    (model / "tokenizer_config.json").write_text("{not json")
    refused(model, "tokenizer_config.json cannot be read")


def test_no_weights(served):
    model = served("llama")
    (model / "model.safetensors").unlink()
    refused(model, "has no weights (*.safetensors)")
    refused(model, "has no weights", engine="vllm")
    check(model, engine="vllm", vllm_args=("--load-format", "dummy"))
    (model / "pytorch_model.bin").write_bytes(b"pickle")
    refused(model, "only PyTorch weights", "safe_serialization=True")
    check(model, engine="vllm")


def test_weights_of_another_shape(served):
    model = served("llama")
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "intermediate_size": 256}))
    refused(model, "model.layers.0.mlp.gate_proj.weight is [128, 64] in model.safetensors but config.json makes it "
                   "[256, 64]")
    check(model, engine="vllm")  # another architecture may name and shape its tensors otherwise


def test_weights_that_lack_a_layer(served):
    model = served("llama")
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 5}))
    refused(model, "the weights lack 9 of the", "first: model.layers.4.")


def test_an_untied_config_over_tied_weights(served):
    model = served("llama_tied")
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": False}))
    refused(model, "first: lm_head.weight")


def test_a_cut_short_download(served):
    model = served("llama")
    file = model / "model.safetensors"
    size = file.stat().st_size
    with open(file, "r+b") as f:
        f.truncate(size - 4)
    refused(model, "model.safetensors is cut short", "download it again")
    refused(model, "is cut short", engine="vllm")


def test_a_file_that_is_no_safetensors(served):
    model = served("llama")
    (model / "model.safetensors").write_bytes(b"<html>404 Not Found</html>")
    refused(model, "does not start with a safetensors header")
    (model / "model.safetensors").write_bytes((20).to_bytes(8, "little") + b"x" * 20)
    refused(model, "header that is not JSON")
    header = json.dumps({"a": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 8]}}).encode()
    (model / "model.safetensors").write_bytes(len(header).to_bytes(8, "little") + header + bytes(8))
    refused(model, "holds 8 bytes for a, whose F32 shape [2, 2] takes 16")


def test_a_sharded_checkpoint_whose_index_or_shards_are_wrong(served):
    model = served("sharded_bf16")
    index = json.loads((model / "model.safetensors.index.json").read_text())
    first = sorted(set(index["weight_map"].values()))[0]
    (model / first).rename(model / "elsewhere")
    refused(model, f"model.safetensors.index.json lists {first}, which is not there")
    (model / "elsewhere").rename(model / first)
    name = next(n for n, f in index["weight_map"].items() if f == first)
    index["weight_map"][name] = sorted(set(index["weight_map"].values()))[1]
    (model / "model.safetensors.index.json").write_text(json.dumps(index))
    refused(model, f"puts {name} in")
    (model / "model.safetensors.index.json").write_text("{}")
    refused(model, "model.safetensors.index.json cannot be read")


def test_plan_refuses_a_directory_without_a_tokenizer_in_one_line(tiny_model, tmp_path):
    """The issue's case, as a user runs it: config.json and weights, no tokenizer.json."""
    model = shutil.copytree(tiny_model("llama"), tmp_path / "no-tokenizer")
    result = subprocess.run([sys.executable, "-m", "vsup", "plan", str(model), "--device", "cpu"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr == f"vsup plan: error: MODEL {str(model)!r} has no tokenizer.json, which the API server " \
                            f"needs (the model's fast tokenizer); copy it from the model's repository beside " \
                            f"config.json\n"
