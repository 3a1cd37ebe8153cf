"""What a lent GPU host has, what vsup needs beyond it, and the wheels that carry the difference.

A GPU host comes with Python 3.12, torch, triton, transformers and a few more (`HOST_PACKAGES`),
and cannot fetch anything. Everything else that vsup and engine import travels with the working
tree as wheels (64 MiB in all). The set is worked out here and nowhere else: pyproject.toml's
dependencies (plus `CHECK_EXTRAS`) and what they need, transitively, minus `HOST_PACKAGES` and what
they need. What a package needs is read from the metadata installed in this venv, and each wheel
is pinned to the version installed here: the one the tests pass with.

    python tools/gpu_host.py download DEST [--python-version 3.12]  # pip download; writes DEST/wheels.json
    python tools/gpu_host.py install WHEELS TARGET                   # offline, into a fresh TARGET
    python tools/gpu_host.py simulate DEST                           # DEST/bin/python: this venv's host part
    python tools/gpu_host.py describe [--require-cuda]               # this host: Python, packages, GPU
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tomllib
import zipfile
from collections.abc import Callable, Iterable
from pathlib import Path

from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name, parse_wheel_filename

REPO = Path(__file__).resolve().parent.parent
# what every lent GPU machine has installed (with what these need); torch and triton bring CUDA's libraries
HOST_PACKAGES = ("torch", "triton", "transformers", "safetensors", "tokenizers", "psutil", "typer",
                 "prometheus-client", "httpx", "pytest")
# not a dependency of vsup, but of the check: pyproject's pytest settings (timeout = 300) are pytest-timeout's
CHECK_EXTRAS = ("pytest-timeout",)
PLATFORM = "manylinux_2_28_x86_64"  # torch's CUDA builds need glibc 2.28: every GPU host has it
# pip matches --platform tags exactly: a manylinux_2_28 host runs every older manylinux wheel too
PLATFORMS = [f"manylinux_2_{minor}_x86_64" for minor in range(28, 4, -1)] + [
    "manylinux2014_x86_64", "manylinux2010_x86_64", "manylinux1_x86_64"]
MANIFEST = "wheels.json"


class CheckError(Exception):
    """What went wrong, said so that the reader knows the fix."""


# the set: pure, given how to read a package's requirements


def target_environment(python_version: str) -> dict[str, str]:
    """PEP 508 marker values of a CPython `python_version` (3.12) on this platform."""
    return {**default_environment(), "python_version": python_version, "python_full_version": f"{python_version}.0",
            "implementation_name": "cpython", "platform_python_implementation": "CPython"}


def wanted(requirement: str, environment: dict[str, str]) -> bool:
    """Whether `requirement` applies in `environment` (an extra's requirements never do)."""
    marker = Requirement(requirement).marker
    return marker is None or marker.evaluate({**environment, "extra": ""})


def closure(names: Iterable[str], requires: Callable[[str], list[str]]) -> set[str]:
    """`names` and everything they need, transitively, as canonical names."""
    seen: set[str] = set()
    todo = [canonicalize_name(n) for n in names]
    while todo:
        name = todo.pop()
        if name not in seen:
            seen.add(name)
            todo += [canonicalize_name(n) for n in requires(name)]
    return seen


def missing_packages(needed: Iterable[str], host: Iterable[str], requires: Callable[[str], list[str]]) -> set[str]:
    """What `needed` brings (transitively) that `host` and what it needs do not."""
    return closure(needed, requires) - closure(host, requires)


# reading this venv and pyproject.toml


def installed_requires(environment: dict[str, str]) -> Callable[[str], list[str]]:
    """requires(name): the names an installed package needs in `environment`; [] when not installed."""
    def requires(name: str) -> list[str]:
        try:
            listed = importlib.metadata.requires(name) or []
        except importlib.metadata.PackageNotFoundError:
            return []
        return [Requirement(r).name for r in listed if wanted(r, environment)]
    return requires


def needed_by_vsup(environment: dict[str, str]) -> list[str]:
    """pyproject.toml's dependencies that apply in `environment`, plus CHECK_EXTRAS, as names."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    return [Requirement(r).name for r in project["dependencies"] if wanted(r, environment)] + list(CHECK_EXTRAS)


def pinned_wheels(python_version: str) -> list[str]:
    """`name==version` of every package a GPU host lacks, at this venv's versions, sorted."""
    environment = target_environment(python_version)
    requires = installed_requires(environment)
    pins = []
    for name in sorted(missing_packages(needed_by_vsup(environment), HOST_PACKAGES, requires)):
        try:
            pins.append(f"{name}=={importlib.metadata.version(name)}")
        except importlib.metadata.PackageNotFoundError:
            raise CheckError(f"{name} is needed on the GPU host but not installed in this venv, so its version "
                             f"is unknown; run `make install` first") from None
    return pins


# download


def download(dest: Path, python_version: str) -> dict:
    """Make `dest` hold exactly the wheels a GPU host lacks, for CPython `python_version`; returns
    the manifest (also written to dest/wheels.json). Downloads only when they are not all there."""
    pins = pinned_wheels(python_version)
    dest.mkdir(parents=True, exist_ok=True)
    manifest = read_manifest(dest)
    if manifest and manifest["python"] == python_version and manifest["requirements"] == pins \
            and all((dest / w).is_file() for w in manifest["wheels"]):
        return manifest
    tag = f"cp{python_version.replace('.', '')}"
    command = [sys.executable, "-m", "pip", "download", "--quiet", "--disable-pip-version-check", "--no-deps",
               "--only-binary=:all:", "--python-version", python_version, "--implementation", "cp",
               "--abi", tag, "--abi", "abi3", "--abi", "none", *(f"--platform={p}" for p in PLATFORMS),
               "--dest", str(dest), *pins]
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        raise CheckError(f"pip download of the {tag} wheels failed:\n{result.stderr.strip()[-2000:]}")
    wheels = {}
    for path in sorted(dest.glob("*.whl")):
        name, version, _, _ = parse_wheel_filename(path.name)
        if f"{name}=={version}" in pins:
            wheels[f"{name}=={version}"] = path.name
        else:
            path.unlink()  # another version or package from an earlier download: the folder holds exactly the set
    absent = [p for p in pins if p not in wheels]
    if absent:
        raise CheckError(f"no {tag} {PLATFORM} wheel for {', '.join(absent)}")
    manifest = {"python": python_version, "platform": PLATFORM, "requirements": pins,
                "wheels": [wheels[p] for p in pins], "bytes": sum((dest / w).stat().st_size for w in wheels.values())}
    (dest / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest


def read_manifest(folder: Path) -> dict | None:
    try:
        return json.loads((folder / MANIFEST).read_text())
    except (OSError, ValueError):
        return None


# install


def install(wheels: Path, target: Path) -> list[str]:
    """Install every wheel of the manifest into `target` (must not exist yet), offline; returns them.

    With pip (`pip install --target`) where this Python has it, else by unpacking each wheel."""
    manifest = read_manifest(wheels)
    if manifest is None:
        raise CheckError(f"{wheels}/{MANIFEST} is missing: make the wheels first (`make gpu-wheels`)")
    running = f"{sys.version_info.major}.{sys.version_info.minor}"
    if manifest["python"] != running:
        raise CheckError(f"the wheels in {wheels} are for Python {manifest['python']}, this is Python {running}")
    absent = [r for r, w in zip(manifest["requirements"], manifest["wheels"]) if not (wheels / w).is_file()]
    if absent:
        raise CheckError(f"missing wheel{'s' if len(absent) > 1 else ''} in {wheels}: {', '.join(absent)} "
                         f"(`make gpu-wheels` downloads them)")
    if target.exists():
        raise CheckError(f"{target} exists: the wheels go into a fresh folder")
    files = [str(wheels / w) for w in manifest["wheels"]]
    if importlib.util.find_spec("pip") is not None:
        result = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
                                 "--no-index", "--no-deps", "--no-compile", "--target", str(target), *files],
                                capture_output=True, text=True)
        if result.returncode != 0:
            raise CheckError(f"pip install --target {target} failed:\n{result.stderr.strip()[-2000:]}")
    else:
        for path in files:
            unpack_wheel(Path(path), target)
    return manifest["requirements"]


def unpack_wheel(wheel: Path, target: Path) -> None:
    """What `pip install --target` does with a wheel, without pip: its files into `target`, and those
    of its .data/purelib and .data/platlib there too (scripts and headers are not needed)."""
    target.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(wheel) as archive:
        for member in archive.infolist():
            parts = Path(member.filename).parts
            if parts[0].endswith(".data"):
                if len(parts) < 3 or parts[1] not in ("purelib", "platlib"):
                    continue
                parts = parts[2:]
            if member.is_dir() or ".." in parts:
                continue
            out = target.joinpath(*parts)
            out.parent.mkdir(parents=True, exist_ok=True)
            with archive.open(member) as src, open(out, "wb") as dst:
                shutil.copyfileobj(src, dst)
            if member.external_attr >> 16 & 0o111:
                out.chmod(0o755)


# simulate


def simulate(dest: Path) -> Path:
    """A Python that has only the GPU host's packages of this venv (torch, transformers, ...): a
    venv at `dest` without pip, its site-packages linking to theirs. Returns its interpreter."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(dest)], check=True)
    site = next(dest.glob("lib/python*/site-packages"))
    linked = set()
    host = closure(HOST_PACKAGES, installed_requires(target_environment(
        f"{sys.version_info.major}.{sys.version_info.minor}")))
    for dist in importlib.metadata.distributions():
        if canonicalize_name(dist.metadata["Name"]) not in host:
            continue
        for file in dist.files or []:
            top = file.parts[0]
            if top in linked or top == ".." or top == "__pycache__" or top.endswith(".pth"):
                continue
            source = Path(dist.locate_file(top))
            if source.exists():
                (site / top).symlink_to(source)
                linked.add(top)
    return dest / "bin" / "python"


# describe


def describe(require_cuda: bool) -> dict:
    """This host as the check sees it: Python, platform, the host packages' versions, torch's view of
    CUDA and nvidia-smi's; CheckError when CUDA is required and torch cannot use it."""
    import platform

    found = {"python": platform.python_version(), "platform": platform.platform(), "glibc": platform.libc_ver()[1],
             "cpus": os.cpu_count(), "packages": {}}
    for name in HOST_PACKAGES:
        try:
            found["packages"][name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            found["packages"][name] = None
    import torch

    devices = range(torch.cuda.device_count()) if torch.cuda.is_available() else []
    found["cuda"] = {"available": torch.cuda.is_available(), "torch_built_for": torch.version.cuda,
                     "devices": [{"name": torch.cuda.get_device_name(i),
                                  "capability": torch.cuda.get_device_capability(i),
                                  "memory_bytes": torch.cuda.get_device_properties(i).total_memory} for i in devices]}
    if shutil.which("nvidia-smi"):
        found["nvidia_smi"] = subprocess.run(["nvidia-smi"], capture_output=True, text=True, timeout=30).stdout
    if require_cuda and not found["cuda"]["available"]:
        raise CheckError(f"torch {torch.__version__} (built for CUDA {torch.version.cuda}) sees no usable GPU: "
                         f"torch.cuda.is_available() is False{'' if shutil.which('nvidia-smi') else '; no nvidia-smi'}")
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    p = commands.add_parser("download", help="the wheels a GPU host lacks, into DEST")
    p.add_argument("dest", type=Path)
    p.add_argument("--python-version", default=f"{sys.version_info.major}.{sys.version_info.minor}")
    p = commands.add_parser("install", help="the wheels of WHEELS into a fresh TARGET, offline")
    p.add_argument("wheels", type=Path)
    p.add_argument("target", type=Path)
    p = commands.add_parser("simulate", help="a Python at DEST with only the GPU host's packages of this venv")
    p.add_argument("dest", type=Path)
    p = commands.add_parser("describe", help="this host: Python, packages, GPU (as JSON)")
    p.add_argument("--require-cuda", action="store_true", help="fail unless torch can use a GPU")
    args = parser.parse_args(argv)
    try:
        if args.command == "download":
            m = download(args.dest, args.python_version)
            print(f"{len(m['wheels'])} wheels, {m['bytes'] / 2**20:.1f} MiB, for cp{m['python'].replace('.', '')} "
                  f"{m['platform']} in {args.dest}: {' '.join(m['requirements'])}")
        elif args.command == "install":
            installed = install(args.wheels, args.target)
            print(f"installed {len(installed)} wheels into {args.target}: {' '.join(installed)}")
        elif args.command == "simulate":
            print(simulate(args.dest))
        else:
            found = describe(args.require_cuda)
            print(found.pop("nvidia_smi", ""))
            print(json.dumps(found, indent=1))
    except CheckError as error:
        print(f"gpu_host.py {args.command}: error: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
