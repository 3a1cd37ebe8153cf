"""Which flags the installed vLLM takes: `vllm serve --help=all`, asked once per install and cached.

Importing vLLM takes about 15 s on two cores, so vsup asks only when the vllm
executable changed (its real path, size and mtime are the cache key).
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
from pathlib import Path

from vsup.errors import UsageError

PROJECT_VENV_BIN = Path(__file__).resolve().parents[2] / ".vllm-venv" / "bin" / "vllm"
_OPTION_LINE = re.compile(r"^\s{2,}-")
_FLAG = re.compile(r"(?:^|[\s,{])(--?[A-Za-z][\w-]*)")


def find_vllm(vllm_bin: str | None) -> str:
    """--vllm-bin, else `vllm` on PATH, else the project's own venv (`make vllm`); exit 2 when none runs."""
    if vllm_bin:
        path = shutil.which(vllm_bin) or (vllm_bin if os.access(vllm_bin, os.X_OK) else None)
        if path is None:
            raise UsageError(f"--vllm-bin {vllm_bin}: no such executable; give the path of a `vllm` executable, "
                             f"or run `make vllm` to install vLLM's CPU build into .vllm-venv")
        return os.path.abspath(path)
    found = shutil.which("vllm") or (str(PROJECT_VENV_BIN) if os.access(PROJECT_VENV_BIN, os.X_OK) else None)
    if found is None:
        raise UsageError("--engine vllm: no vllm executable on PATH or in .vllm-venv; run `make vllm` "
                         "(vLLM's CPU build in a venv of its own) or give --vllm-bin PATH")
    return os.path.abspath(found)


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "vsup" / "vllm"


def serve_flags(vllm_bin: str, env: dict[str, str]) -> set[str]:
    """Every flag `vllm serve` takes, from its --help=all (cached per install)."""
    real = os.path.realpath(vllm_bin)
    st = os.stat(real)
    key = hashlib.sha256(f"{real}\0{st.st_size}\0{st.st_mtime_ns}".encode()).hexdigest()[:16]
    cached = cache_dir() / f"serve-help-{key}.txt"
    if cached.exists():
        text = cached.read_text()
    else:
        try:
            result = subprocess.run([vllm_bin, "serve", "--help=all"], capture_output=True, text=True, timeout=300,
                                    env={**os.environ, **env}, stdin=subprocess.DEVNULL)
        except (OSError, subprocess.SubprocessError) as e:
            raise UsageError(f"--vllm-bin {vllm_bin} does not run ({e}); run `make vllm` or give another --vllm-bin")
        if result.returncode != 0 or "--tensor-parallel-size" not in result.stdout:
            last = (result.stderr.strip().splitlines() or ["(no output)"])[-1]
            raise UsageError(f"`{vllm_bin} serve --help=all` failed ({last}); run `make vllm` or give another "
                             f"--vllm-bin")
        text = result.stdout
        cached.parent.mkdir(parents=True, exist_ok=True)
        tmp = cached.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(text)
        os.replace(tmp, cached)
    return parse_flags(text)


def parse_flags(help_text: str) -> set[str]:
    """The option names of argparse help: `  --api-server-count N, -asc N` gives both spellings."""
    flags = set()
    for line in help_text.splitlines():
        if _OPTION_LINE.match(line):
            head = re.split(r"\s{2,}", line.strip(), maxsplit=1)[0]  # the option column, not its description
            flags.update(_FLAG.findall(" " + head))
    return flags
