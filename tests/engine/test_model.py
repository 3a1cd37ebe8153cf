"""The model on one rank against transformers: full prompts, incremental decoding
through the paged cache, dtypes, and the loader reading only this rank's slices."""

from __future__ import annotations

import random

import pytest
import torch
from safetensors import safe_open

from engine.distributed import ParallelGroups
from engine.model.attention import AttentionMetadata, allocate_kv_caches
from engine.model.config import ModelConfig
from engine.model.llama import LlamaForCausalLM
from engine.model.loader import checkpoint_files, load_model, load_weights

BLOCK_SIZE = 4
PROMPT = random.Random(1).choices(range(250), k=37)


def full_logits(model: LlamaForCausalLM, token_ids: list[int]) -> torch.Tensor:
    """Logits of every position of one prompt, in one prefill step."""
    num_blocks = -(-len(token_ids) // BLOCK_SIZE)
    caches = allocate_kv_caches(model.config, model.groups, num_blocks + 1, BLOCK_SIZE)
    metadata = AttentionMetadata.build([0], [len(token_ids)], [list(range(1, num_blocks + 1))], BLOCK_SIZE)
    hidden = model(torch.tensor(token_ids), torch.arange(len(token_ids)), caches, metadata)
    return model.compute_logits(hidden)


@pytest.mark.parametrize("variant", ["llama", "llama_tied", "llama3", "qwen2", "sharded_bf16"])
def test_logits_match_transformers(variant, tiny_model, hf_logits):
    path = tiny_model(variant)
    model = load_model(path, dtype="float32")
    reference = hf_logits(path, PROMPT)
    assert reference.std() > 0.3, "logits this small would make the tolerance meaningless"
    torch.testing.assert_close(full_logits(model, PROMPT), reference, atol=1e-4, rtol=0)


def test_incremental_decoding_matches_full_forward(tiny_model, hf_logits):
    """Prefill, a chunked prefill whose second chunk shares a step with a
    decode, then decode-only steps of unequal lengths, in shuffled blocks."""
    path = tiny_model("llama3")
    model = load_model(path)
    seqs = [random.Random(2).choices(range(256), k=30), random.Random(3).choices(range(256), k=24)]
    free = list(range(40))
    random.Random(4).shuffle(free)
    tables = [[free.pop() for _ in range(-(-len(s) // BLOCK_SIZE))] for s in seqs]
    caches = allocate_kv_caches(model.config, model.groups, 40, BLOCK_SIZE)
    got: list[list[torch.Tensor]] = [[], []]
    done = [0, 0]
    # (new tokens of seq 0, new tokens of seq 1) per step
    steps = [(26, 12), (1, 9)] + [(1, 1)] * 3
    for step in steps:
        ids, positions = [], []
        for i, n in enumerate(step):
            ids += seqs[i][done[i]:done[i] + n]
            positions += range(done[i], done[i] + n)
        metadata = AttentionMetadata.build(done, list(step), tables, BLOCK_SIZE)
        assert metadata.is_decode_only == (step == (1, 1))
        logits = model.compute_logits(model(torch.tensor(ids), torch.tensor(positions), caches, metadata))
        got[0].append(logits[:step[0]])
        got[1].append(logits[step[0]:])
        done = [d + n for d, n in zip(done, step)]
    assert done == [len(s) for s in seqs]
    for i, seq in enumerate(seqs):
        torch.testing.assert_close(torch.cat(got[i]), hf_logits(path, seq), atol=1e-4, rtol=0)


def test_pipeline_stages_chained_in_process_match_one_stage(tiny_model):
    """Two stages' forwards, the first's intermediate fed to the second,
    equal the unsplit model (the send/recv itself is tested in test_parallel)."""
    path = tiny_model("llama_tied")
    whole = full_logits(load_model(path), PROMPT)
    stages = [load_model(path, ParallelGroups(pp_size=2, pp_rank=r)) for r in range(2)]
    n = len(PROMPT)
    metadata = AttentionMetadata.build([0], [n], [list(range(10))], BLOCK_SIZE)
    inputs = (torch.tensor(PROMPT), torch.arange(n))
    intermediate = stages[0](*inputs, allocate_kv_caches(stages[0].config, stages[0].groups, 10, BLOCK_SIZE),
                             metadata)
    hidden = stages[1](*inputs, allocate_kv_caches(stages[1].config, stages[1].groups, 10, BLOCK_SIZE),
                       metadata, intermediate)
    torch.testing.assert_close(stages[1].compute_logits(hidden), whole, atol=1e-5, rtol=0)


def test_bfloat16_file_loads_into_float32_and_float32_file_into_bfloat16(tiny_model, hf_logits):
    bf16_file = load_model(tiny_model("sharded_bf16"), dtype="float32")
    assert {p.dtype for p in bf16_file.parameters()} == {torch.float32}
    as_bf16 = load_model(tiny_model("llama"), dtype="bfloat16")
    assert {p.dtype for p in as_bf16.parameters()} == {torch.bfloat16}
    reference = hf_logits(tiny_model("llama"), PROMPT)
    logits = full_logits(as_bf16, PROMPT).float()
    assert (logits - reference).abs().max() < 0.25
    assert (logits.argmax(-1) == reference.argmax(-1)).float().mean() > 0.8


def test_pipeline_stage_reads_only_its_layers(tiny_model):
    path = tiny_model("llama_tied")
    config = ModelConfig.from_pretrained(path)
    first, last = (LlamaForCausalLM(config, ParallelGroups(pp_size=3, pp_rank=r)) for r in (0, 2))
    read_first, read_last = load_weights(first, path), load_weights(last, path)
    layers = lambda names: {int(n.split(".")[2]) for n in names if n.startswith("model.layers.")}  # noqa: E731
    assert layers(read_first) == {0, 1} and first.layer_range == range(0, 2)
    assert layers(read_last) == {3} and last.layer_range == range(3, 4)
    assert "model.norm.weight" not in read_first and "model.norm.weight" in read_last
    # tied: the last stage reads the embedding matrix, as its LM head
    assert "model.embed_tokens.weight" in read_last and last.model.embed_tokens is None
    assert not any(".layers.3." in n for n, _ in first.named_parameters())
    assert {n.split(".")[2] for n, _ in last.named_parameters() if ".layers." in n} == {"3"}


def test_tensor_parallel_rank_reads_only_its_slices(tiny_model):
    """TP rank 1 of 2 reads half of each split tensor, and the right half
    (the qwen2 vocabulary of 251 pads the last shard with a zero row)."""
    path = tiny_model("qwen2")
    config = ModelConfig.from_pretrained(path)
    model = LlamaForCausalLM(config, ParallelGroups(tp_size=2, tp_rank=1))
    read = load_weights(model, path)
    assert read["model.layers.0.self_attn.q_proj.weight"] == (32, 64)
    assert read["model.layers.0.self_attn.k_proj.bias"] == (16,)
    assert read["model.layers.0.self_attn.o_proj.weight"] == (64, 32)
    assert read["model.layers.0.mlp.down_proj.weight"] == (64, 64)
    assert read["model.embed_tokens.weight"] == (125, 64)
    attn = model.model.layers["0"].self_attn
    assert attn.qkv_proj.weight.shape == (64, 64) and attn.o_proj.weight.shape == (64, 32)
    assert model.model.layers["0"].mlp.gate_up_proj.weight.shape == (128, 64)
    assert model.model.embed_tokens.weight.shape == (126, 64)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    with safe_open(checkpoint_files(path)["model.layers.0.self_attn.k_proj.weight"], "pt") as f:
        k_full = f.get_tensor("model.layers.0.self_attn.k_proj.weight")
        embed = f.get_tensor("model.embed_tokens.weight")
    torch.testing.assert_close(attn.qkv_proj.weight[32:48], k_full[16:32], atol=0, rtol=0)
    torch.testing.assert_close(model.model.embed_tokens.weight[:125], embed[126:], atol=0, rtol=0)
    assert not model.model.embed_tokens.weight[125:].any()


def test_sharded_checkpoint_uses_its_index(tiny_model):
    path = tiny_model("sharded_bf16")
    assert (path / "model.safetensors.index.json").is_file()
    files = checkpoint_files(path)
    assert len(set(files.values())) > 1


def test_missing_tensor_is_a_clear_error(tiny_model, tmp_path):
    from safetensors.torch import save_file
    path = tiny_model("llama")
    (tmp_path / "config.json").write_text((path / "config.json").read_text())
    with safe_open(path / "model.safetensors", "pt") as f:
        tensors = {n: f.get_tensor(n) for n in f.keys() if n != "model.layers.2.mlp.up_proj.weight"}
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match=r"lacks 1 tensors .*model\.layers\.2\.mlp\.up_proj\.weight"):
        load_model(tmp_path)
    # a stage without layer 2 does not need it
    load_model(tmp_path, ParallelGroups(pp_size=2, pp_rank=0))


def test_tensor_of_the_wrong_shape_is_a_clear_error(tiny_model, tmp_path):
    path = tiny_model("llama")
    (tmp_path / "model.safetensors").write_bytes((path / "model.safetensors").read_bytes())
    (tmp_path / "config.json").write_text((path / "config.json").read_text().replace(
        '"intermediate_size": 128', '"intermediate_size": 96'))
    with pytest.raises(ValueError, match="checkpoint and its config.json disagree"):
        load_model(tmp_path)
