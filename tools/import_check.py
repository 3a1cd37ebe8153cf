"""Import every module the GPU check runs, and every module the wheels brought, from a fresh target.

    python tools/import_check.py TARGET

Run with TARGET and the repository first on PYTHONPATH, under the Python that will run the check:
the GPU host's own, or (the dry run) one that has only the host's packages (`gpu_host.py
simulate`). A module that cannot be imported, or a wheel's module that came from elsewhere than
TARGET, fails the check; each failure is named. Nothing in CUDA is touched: importing torch does
not initialize it.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import sys
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PACKAGES = ("vsup", "engine")
# vLLM's start-up hook runs inside vLLM's interpreter, never vsup's (and uses the standard library only)
NOT_IMPORTED = {"vsup.vllm.hook.sitecustomize"}
# what the check runs besides the packages: its tests (as pytest imports them) and the serving bench
SCRIPTS = {"tests": ["conftest", "local_deployment", "gpu/conftest", "gpu/model", "gpu/test_cuda_kernel",
                     "gpu/test_cuda_serve"],
           "bench": ["common", "api_server"]}


def repo_modules() -> list[str]:
    """Every module of vsup and engine but their `__main__`s (importing one runs it)."""
    names = []
    for package in PACKAGES:
        for path in sorted((REPO / package).rglob("*.py")):
            parts = path.relative_to(REPO).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            name = ".".join(parts)
            if parts[-1] != "__main__" and name not in NOT_IMPORTED:
                names.append(name)
    return names


def script_modules() -> list[str]:
    """The tests' and the bench's modules, as their runners import them (tests.gpu.model; api_server)."""
    names = [f"tests.{m.replace('/', '.')}" for m in SCRIPTS["tests"]]
    sys.path.insert(1, str(REPO / "bench"))  # a bench imports its siblings by their plain names
    return names + SCRIPTS["bench"]


def wheel_modules(target: Path) -> dict[str, str]:
    """{top-level module: its distribution} of everything installed in `target`: each package directory
    and module file (x.py, x.cpython-312-x86_64-linux-gnu.so) that an installed file lies in or is."""
    found = {}
    for dist in importlib.metadata.distributions(path=[str(target)]):
        for file in dist.files or []:
            top = file.parts[0]
            if len(file.parts) == 1:
                top = top.split(".")[0] if top.endswith((".py", ".so")) else ""
            if top.isidentifier() and top != "__pycache__":  # not pyzmq.libs/, x.dist-info/, ../bin
                found[top] = dist.metadata["Name"]
    return found


def import_all(names: list[str]) -> dict[str, str]:
    """{module: why it failed} of those that did not import."""
    failed = {}
    for name in names:
        try:
            importlib.import_module(name)
        except BaseException as error:  # SystemExit and the like too: a module must import, not act
            line = traceback.format_exception_only(type(error), error)[-1].strip()
            failed[name] = line
    return failed


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    target = Path(argv[0]).resolve()
    wheels = wheel_modules(target)
    if not wheels:
        print(f"import_check.py: error: nothing is installed in {target}", file=sys.stderr)
        return 1
    ours = repo_modules() + script_modules()
    failed = import_all(ours)
    failed_wheels = import_all(sorted(wheels))
    for top, dist in sorted(wheels.items()):
        module = sys.modules.get(top)
        where = getattr(module, "__file__", None) or next(iter(getattr(module, "__path__", [])), None)
        if module is not None and where:
            print(f"{top:24} {dist:20} {where}")
            if not Path(where).resolve().is_relative_to(target):
                failed_wheels[top] = f"from {where}, not from {target}"
    for name, why in {**failed, **failed_wheels}.items():
        print(f"FAILED {name}: {why}")
    print(f"{len(ours) - len(failed)} of {len(ours)} modules of vsup, engine, the tests and the bench imported; "
          f"{len(wheels) - len(failed_wheels)} of {len(wheels)} modules of the wheels imported from {target}")
    failed.update(failed_wheels)
    if failed:
        print(f"import_check.py: {len(failed)} failed: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
