"""ModelConfig parsing and its errors; the pipeline layer split rule."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from engine.distributed import layer_range
from engine.model.config import ModelConfig, RopeScaling

LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
         "intermediate_size": 128, "num_hidden_layers": 4, "num_attention_heads": 4,
         "num_key_value_heads": 2, "vocab_size": 256, "rms_norm_eps": 1e-5,
         "max_position_embeddings": 2048, "torch_dtype": "bfloat16"}


def test_transformers_4_spelling():
    config = ModelConfig.from_dict({**LLAMA, "rope_theta": 500000.0, "rope_scaling": {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192}})
    assert config.rope_theta == 500000.0
    assert config.rope_scaling == RopeScaling("llama3", 8.0, 1.0, 4.0, 8192)
    assert (config.head_dim, config.num_kv_heads, config.dtype) == (16, 2, "bfloat16")
    assert not config.tie_word_embeddings and not config.attention_bias


def test_transformers_5_spelling_from_a_directory(tmp_path):
    hf = {k: v for k, v in LLAMA.items() if k != "torch_dtype"}
    hf.update(dtype="float32", head_dim=32, rope_parameters={"rope_theta": 100000.0, "rope_type": "default"})
    (tmp_path / "config.json").write_text(json.dumps(hf))
    config = ModelConfig.from_pretrained(tmp_path)
    assert (config.rope_theta, config.rope_scaling, config.head_dim, config.dtype) == (100000.0, None, 32, "float32")
    assert ModelConfig.from_pretrained(tmp_path, dtype="bfloat16").dtype == "bfloat16"


def test_qwen2_has_qkv_bias_but_no_o_proj_bias_and_ignores_its_unused_window():
    config = ModelConfig.from_dict({**LLAMA, "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2",
                                    "sliding_window": 4096, "use_sliding_window": False})
    assert config.attention_bias and not config.o_proj_bias
    assert config.sliding_window is None and config.max_model_len == 2048


def test_llama_attention_bias_covers_o_proj_and_mistral_window_caps_length():
    assert ModelConfig.from_dict({**LLAMA, "attention_bias": True}).o_proj_bias
    mistral = ModelConfig.from_dict({**LLAMA, "architectures": ["MistralForCausalLM"], "sliding_window": 1024})
    assert (mistral.model_type, mistral.max_model_len) == ("mistral", 1024)


@pytest.mark.parametrize("change, message", [
    ({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}, "GPT2LMHeadModel.*not supported.*LlamaForCausalLM"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "'yarn' is not supported"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "llama3 rope scaling needs"),
    ({"hidden_act": "gelu"}, "gelu"),
    ({"num_key_value_heads": 3}, "not a multiple"),
])
def test_unsupported_config_is_a_clear_error(change, message):
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_dict({**LLAMA, **change})


def test_bad_dtype_and_missing_config_json(tmp_path):
    with pytest.raises(ValueError, match="use one of float32, float16, bfloat16"):
        ModelConfig.from_dict(LLAMA, dtype="int8")
    with pytest.raises(ValueError, match="no config.json"):
        ModelConfig.from_pretrained(tmp_path)


def test_parallel_sizes_are_checked_with_the_fix_in_the_message():
    config = ModelConfig.from_dict(LLAMA)
    config.verify_parallel(2, 4)
    with pytest.raises(ValueError, match="tensor parallel size 3 does not divide .* use -tp 1 or 2"):
        config.verify_parallel(3, 1)
    with pytest.raises(ValueError, match="pipeline parallel size 5 exceeds the model's 4 layers; use at most -pp 4"):
        config.verify_parallel(1, 5)
    smollm = ModelConfig.from_dict({**LLAMA, "num_attention_heads": 9, "num_key_value_heads": 3,
                                    "hidden_size": 576, "intermediate_size": 1536})
    assert smollm.valid_tp_sizes() == [1, 3]


def test_layer_range_gives_the_remainder_to_the_first_stages():
    assert [layer_range(30, 4, s) for s in range(4)] == [range(0, 8), range(8, 16), range(16, 23), range(23, 30)]
    assert [layer_range(4, 3, s) for s in range(3)] == [range(0, 2), range(2, 3), range(3, 4)]
    with pytest.raises(ValueError):
        layer_range(2, 3, 0)


@given(st.integers(1, 200).flatmap(lambda n: st.tuples(st.just(n), st.integers(1, n))))
def test_layer_ranges_tile_the_model(shape):
    num_layers, pp_size = shape
    ranges = [layer_range(num_layers, pp_size, s) for s in range(pp_size)]
    assert [layer for r in ranges for layer in r] == list(range(num_layers))
    sizes = [len(r) for r in ranges]
    assert sizes == sorted(sizes, reverse=True) and sizes[0] - sizes[-1] <= 1
