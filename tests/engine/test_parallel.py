"""TP and PP in real processes (gloo over 127.0.0.1, or a file:// rendezvous):
the same steps give the same logits as one rank, and each rank holds only its shard."""

from __future__ import annotations

import json
import random
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from engine.distributed import ParallelGroups, gloo_interface, interface_of
from engine.model.attention import AttentionMetadata, allocate_kv_caches
from engine.model.config import ModelConfig
from engine.model.llama import LlamaForCausalLM
from engine.model.loader import load_weights

BLOCK_SIZE = 4
SEQS = [random.Random(5).choices(range(250), k=30), random.Random(6).choices(range(250), k=24)]
# new tokens of each sequence per step: prefill + first chunk, decode + second chunk, decodes
STEPS = [(26, 12), (1, 9), (1, 1), (1, 1)]
JOIN_TIMEOUT_S = 60


def run_steps(model: LlamaForCausalLM) -> torch.Tensor | None:
    """Run STEPS on this rank; the driver (TP rank 0, last stage) returns the
    logits of every token computed, the other ranks None."""
    groups = model.groups
    caches = allocate_kv_caches(model.config, groups, 32, BLOCK_SIZE)
    tables = [list(range(0, 8)), list(range(31, 24, -1))]
    done, outputs = [0, 0], []
    for step in STEPS:
        ids = [t for i, n in enumerate(step) for t in SEQS[i][done[i]:done[i] + n]]
        positions = [p for i, n in enumerate(step) for p in range(done[i], done[i] + n)]
        metadata = AttentionMetadata.build(done, list(step), tables, BLOCK_SIZE)
        intermediate = None
        if not groups.is_first_stage:
            intermediate = groups.recv_intermediate(len(ids), model.config.hidden_size, model.dtype)
        out = model(torch.tensor(ids), torch.tensor(positions), caches, metadata, intermediate)
        if groups.is_last_stage:
            outputs.append(model.compute_logits(out))
        else:
            groups.send_intermediate(out)
        done = [d + n for d, n in zip(done, step)]
    return torch.cat(outputs) if groups.is_driver else None


def _rank_main(rank: int, tp: int, pp: int, init_method: str, model_dir: str, out_dir: str) -> None:
    torch.set_num_threads(1)  # several ranks share 2 cores
    groups = ParallelGroups.init(tp, pp, rank, init_method, timeout_s=JOIN_TIMEOUT_S)
    try:
        model = LlamaForCausalLM(ModelConfig.from_pretrained(model_dir), groups)
        read = load_weights(model, model_dir)
        logits = run_steps(model)
        shapes = {name: tuple(p.shape) for name, p in model.named_parameters()}
        torch.save({"logits": logits, "shapes": shapes, "read": read}, Path(out_dir) / f"rank{rank}.pt")
    finally:
        groups.destroy()


def _join_init_alone(init_method: str, out_dir: str) -> None:
    try:
        ParallelGroups.init(2, 1, 0, init_method, timeout_s=2)
    except Exception as e:  # noqa: BLE001 - whatever torch raises, it must raise
        Path(out_dir, "error").write_text(type(e).__name__)


def spawn_ranks(target: str, args_per_rank: list[tuple], log_dir: Path) -> None:
    """Run `target` (a function of this module) in one fresh interpreter per
    args tuple; wait for all, kill any left after the timeout, and fail,
    showing its stderr, unless every one exited 0."""
    here = str(Path(__file__).parent)
    child = ("import sys, json; sys.path.insert(0, sys.argv[1]); import test_parallel; "
             f"test_parallel.{target}(*json.loads(sys.argv[2]))")
    procs, logs = [], []
    for i, args in enumerate(args_per_rank):
        logs.append(log_dir / f"{target}{i}.stderr")
        with open(logs[-1], "wb") as err:
            procs.append(subprocess.Popen([sys.executable, "-c", child, here, json.dumps(args)],
                                          stdout=subprocess.DEVNULL, stderr=err))
    deadline = time.monotonic() + JOIN_TIMEOUT_S + 30
    try:
        for p in procs:
            p.wait(max(0.1, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        pass
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(5)
    assert all(p.poll() is not None for p in procs), "a rank outlived the test"
    for p, log in zip(procs, logs):
        assert p.returncode == 0, f"rank exited {p.returncode}:\n{log.read_text()[-3000:]}"


def free_tcp_init() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


def run_parallel(model_dir: Path, tp: int, pp: int, init_method: str, out_dir: Path) -> list[dict]:
    spawn_ranks("_rank_main", [(r, tp, pp, init_method, str(model_dir), str(out_dir)) for r in range(tp * pp)], out_dir)
    return [torch.load(out_dir / f"rank{r}.pt") for r in range(tp * pp)]


def one_rank_logits(model_dir: Path) -> torch.Tensor:
    model = LlamaForCausalLM(ModelConfig.from_pretrained(model_dir))
    load_weights(model, model_dir)
    return run_steps(model)


def test_tensor_parallel_2_matches_one_rank(tiny_model, tmp_path):
    """qwen2: q/k/v bias, tied head, and a vocabulary of 251 split 126 + 125."""
    path = tiny_model("qwen2")
    results = run_parallel(path, 2, 1, free_tcp_init(), tmp_path)
    expected = one_rank_logits(path)
    assert expected.shape == (sum(sum(s) for s in zip(*STEPS)), 251)
    torch.testing.assert_close(results[0]["logits"], expected, atol=1e-4, rtol=0)
    assert results[1]["logits"] is None
    for result in results:
        shapes = result["shapes"]
        assert shapes["model.layers.0.self_attn.qkv_proj.weight"] == (32 + 16 + 16, 64)
        assert shapes["model.layers.0.self_attn.qkv_proj.bias"] == (64,)
        assert shapes["model.layers.3.self_attn.o_proj.weight"] == (64, 32)
        assert shapes["model.layers.3.mlp.gate_up_proj.weight"] == (64 + 64, 64)
        assert shapes["model.layers.3.mlp.down_proj.weight"] == (64, 64)
        assert shapes["model.embed_tokens.weight"] == (126, 64)
        assert result["read"]["model.layers.1.self_attn.q_proj.weight"] == (32, 64)
    assert results[1]["read"]["model.embed_tokens.weight"] == (125, 64)


def test_pipeline_parallel_2_matches_one_rank(tiny_model, tmp_path):
    """A tied head on a stage without the embedding; a file:// rendezvous."""
    path = tiny_model("llama_tied")
    results = run_parallel(path, 1, 2, (tmp_path / "rendezvous").as_uri(), tmp_path)
    torch.testing.assert_close(results[1]["logits"], one_rank_logits(path), atol=1e-4, rtol=0)
    first, last = results[0], results[1]
    assert first["logits"] is None
    layers = lambda names: {int(n.split(".")[2]) for n in names if n.startswith("model.layers.")}  # noqa: E731
    assert layers(first["shapes"]) == layers(first["read"]) == {0, 1}
    assert layers(last["shapes"]) == layers(last["read"]) == {2, 3}
    assert "model.embed_tokens.weight" in first["shapes"] and "lm_head.weight" not in first["shapes"]
    assert "model.norm.weight" not in first["read"]
    assert "model.embed_tokens.weight" not in last["shapes"] and last["shapes"]["lm_head.weight"] == (256, 64)
    assert last["read"]["model.embed_tokens.weight"] == (256, 64)  # read as the head's weight


def test_tensor_2_by_pipeline_2_matches_one_rank(tiny_model, tmp_path):
    """llama3 rope scaling and a row-parallel o_proj bias added once, over 4 ranks."""
    path = tiny_model("llama3")
    results = run_parallel(path, 2, 2, free_tcp_init(), tmp_path)
    torch.testing.assert_close(results[2]["logits"], one_rank_logits(path), atol=1e-4, rtol=0)
    assert [r["logits"] is None for r in results] == [True, True, False, True]
    for rank, result in enumerate(results):
        stage_layers = {0, 1} if rank < 2 else {2, 3}
        assert {int(n.split(".")[2]) for n in result["read"] if ".layers." in n} == stage_layers
        layer = min(stage_layers)
        assert result["shapes"][f"model.layers.{layer}.self_attn.o_proj.weight"] == (64, 32)
        assert result["shapes"][f"model.layers.{layer}.self_attn.o_proj.bias"] == (64,)
        assert ("lm_head.weight" in result["shapes"]) == (rank >= 2)


def test_a_rank_that_never_comes_is_an_error_not_a_hang(tmp_path):
    spawn_ranks("_join_init_alone", [(free_tcp_init(), str(tmp_path))], tmp_path)
    assert (tmp_path / "error").is_file()


def test_rank_outside_the_group_is_refused():
    with pytest.raises(ValueError, match="outside a group of 2 x 2"):
        ParallelGroups.init(2, 2, 4, "tcp://127.0.0.1:1")


def test_gloo_listens_on_the_interface_that_reaches_the_rendezvous():
    """Not where the host name resolves (loopback on many hosts, which other nodes cannot reach)."""
    interfaces = {"lo": ["127.0.0.1", "::1"], "eth0": ["10.0.0.2", "fe80::1%eth0"]}
    assert interface_of("10.0.0.2", interfaces) == "eth0" and interface_of("10.0.0.9", interfaces) is None
    assert gloo_interface("tcp://127.0.0.1:29500") == "lo"  # the kernel reaches loopback over lo
    assert gloo_interface("file:///tmp/dist") is None and gloo_interface("tcp://:29500") is None
