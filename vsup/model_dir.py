"""Whether a model directory holds what serving it takes, from its files alone, before anything starts.

For our engine: the tokenizer the API server loads (tokenizer.json), and safetensors weights whose
headers hold every tensor config.json describes, in its shape. For a stock vLLM, which runs more
architectures and formats: weights of some kind, intact where they are safetensors. No tensor is read
and neither torch nor safetensors is imported (`vsup plan` stays fast): a safetensors file starts with
8 bytes of header length and that much JSON, which is all this reads.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

from vsup.errors import UsageError
from vsup.model_shape import ModelShape

INDEX_FILE = "model.safetensors.index.json"  # the shards of a sharded checkpoint (engine/model/loader.py)
TOKENIZER_FILE = "tokenizer.json"  # what engine/api_server/tokenizer.py loads; tokenizer_config.json is optional
OTHER_WEIGHTS = ("*.bin", "*.pt", "*.pth")  # PyTorch pickles: a stock vLLM loads them, our engine does not
MAX_HEADER_BYTES = 100 << 20  # safetensors' own limit
DTYPE_BYTES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
               "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8}
CONVERT_HINT = "convert it with save_pretrained(..., safe_serialization=True)"


def check_model_dir(path: str | Path, shape: ModelShape, engine: str = "vsup", vllm_args: tuple[str, ...] = ()) -> None:
    """Refuse, as a UsageError naming the file and the fix, a directory that `engine` could not serve.
    `shape`: what read_model_shape made of its config.json; `vllm_args`: what follows `--` for a stock
    vLLM (with --load-format it may need no weights here)."""
    path = Path(path)
    if engine == "vllm":
        if not _safetensors_files(path) and not _has_other_weights(path) and \
                not any(a.split("=")[0] == "--load-format" for a in vllm_args):
            raise UsageError(f"MODEL {str(path)!r} has no weights (*.safetensors, *.bin); give the directory "
                             f"the model's files were downloaded to")
        read_checkpoint(path)  # intact, where it is safetensors
        return
    check_tokenizer(path)
    tensors = read_checkpoint(path)
    if not tensors:
        found = "only PyTorch weights (*.bin, *.pt), which our engine does not load: " + CONVERT_HINT \
            if _has_other_weights(path) else "no weights (*.safetensors)"
        raise UsageError(f"MODEL {str(path)!r} has {found}")
    check_shapes(path, shape, tensors)


def check_tokenizer(path: Path) -> None:
    """The files the API server reads at start: tokenizer.json, and tokenizer_config.json when there is one."""
    if not (path / TOKENIZER_FILE).is_file():
        raise UsageError(f"MODEL {str(path)!r} has no {TOKENIZER_FILE}, which the API server needs (the model's "
                         f"fast tokenizer); copy it from the model's repository beside config.json")
    config = path / "tokenizer_config.json"
    if config.is_file():
        try:
            parsed = json.loads(config.read_text())
        except (OSError, UnicodeDecodeError, ValueError) as e:
            raise UsageError(f"MODEL {str(path)!r}: tokenizer_config.json cannot be read ({e})") from None
        if not isinstance(parsed, dict):
            raise UsageError(f"MODEL {str(path)!r}: tokenizer_config.json is not a JSON object")


def check_shapes(path: Path, shape: ModelShape, tensors: dict[str, tuple[str, tuple[int, ...]]]) -> None:
    """Every tensor config.json describes is in the weights, in its shape (a tied head may be there or not)."""
    expected = shape.checkpoint_shapes()
    if "lm_head.weight" in tensors and "lm_head.weight" not in expected:
        expected["lm_head.weight"] = expected["model.embed_tokens.weight"]
    missing = [name for name in expected if name not in tensors]
    if missing:
        raise UsageError(f"MODEL {str(path)!r}: the weights lack {len(missing)} of the {len(expected)} tensors "
                         f"config.json describes (first: {missing[0]}); do config.json and the weights belong to "
                         f"the same model?")
    for name, want in expected.items():
        file, got = tensors[name]
        if got != want:
            raise UsageError(f"MODEL {str(path)!r}: {name} is {list(got)} in {file} but config.json makes it "
                             f"{list(want)}; do config.json and the weights belong to the same model?")


def read_checkpoint(path: Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Tensor name -> (its file's name, its shape), through model.safetensors.index.json when there is one, as
    the engine's loader reads it; {} when there are no safetensors."""
    index = path / INDEX_FILE
    if not index.is_file():
        return {name: (file.name, shape) for file in _safetensors_files(path)
                for name, shape in read_header(path, file).items()}
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
        if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
            raise TypeError("weight_map is not a mapping of names to files")
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError) as e:
        raise UsageError(f"MODEL {str(path)!r}: {INDEX_FILE} cannot be read ({type(e).__name__}: {e}); "
                         f"download it again") from None
    headers = {}
    for file in sorted(set(weight_map.values())):
        shard = path / file
        if not shard.is_file():
            raise UsageError(f"MODEL {str(path)!r}: {INDEX_FILE} lists {file}, which is not there; download it")
        headers[file] = read_header(path, shard)
    tensors = {}
    for name, file in weight_map.items():
        if name not in headers[file]:
            raise UsageError(f"MODEL {str(path)!r}: {INDEX_FILE} puts {name} in {file}, which lacks it; "
                             f"download the checkpoint again")
        tensors[name] = (file, headers[file][name])
    return tensors


def read_header(model: Path, file: Path) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape, from the header of one safetensors file; a UsageError when the file is no
    safetensors file or shorter than its header says (an interrupted download)."""
    def broken(why: str) -> UsageError:
        return UsageError(f"MODEL {str(model)!r}: {file.name} {why}; download it again or {CONVERT_HINT}")

    try:
        with open(file, "rb") as f:
            length = int.from_bytes(f.read(8), "little")
            if not 2 <= length <= MAX_HEADER_BYTES:
                raise broken("does not start with a safetensors header")
            raw = f.read(length)
            size = os.fstat(f.fileno()).st_size
    except OSError as e:
        raise UsageError(f"MODEL {str(model)!r}: {file.name} cannot be read ({e.strerror or e})") from None
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, ValueError):
        raise broken("has a safetensors header that is not JSON") from None
    if not isinstance(header, dict):
        raise broken("has a safetensors header that is not a JSON object")
    shapes, end = {}, 0
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (begin, stop) = entry["dtype"], entry["shape"], entry["data_offsets"]
            if not all(type(n) is int and n >= 0 for n in (*shape, begin, stop)) or stop < begin:
                raise ValueError
        except (KeyError, TypeError, ValueError):
            raise broken(f"has a malformed header entry for {name}") from None
        if dtype in DTYPE_BYTES and stop - begin != math.prod(shape) * DTYPE_BYTES[dtype]:
            raise broken(f"holds {stop - begin} bytes for {name}, whose {dtype} shape {shape} takes "
                         f"{math.prod(shape) * DTYPE_BYTES[dtype]}")
        shapes[name] = tuple(shape)
        end = max(end, stop)
    if size < 8 + length + end:
        raise broken(f"is cut short: {size} bytes where its header needs {8 + length + end}")
    return shapes


def _safetensors_files(path: Path) -> list[Path]:
    return sorted(p for p in path.glob("*.safetensors") if p.is_file())


def _has_other_weights(path: Path) -> bool:
    return any(p.is_file() for pattern in OTHER_WEIGHTS for p in path.glob(pattern))
