"""The engine's layers, written down once and checked over every module: no import runs back up.

A module may import what its own layer entry holds and what the layers below hold, never a layer above
it nor a sibling entry of its own layer (siblings are parts that only talk through sockets). vsup and
engine are two products with a contract (tests/test_contracts.py): neither imports the other, but for
the one reader of config.json (engine/model/config.py), which vsup plan uses too.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import build_checkpoint

REPO = Path(__file__).resolve().parents[1]

LAYERS = [  # bottom first; a module belongs to the entry that is the longest prefix of its name
    ["engine.wire"],                                            # every message that crosses a process boundary
    # what each process does
    ["engine.log", "engine.process", "engine.args", "engine.progress", "engine.cluster", "engine.load"],
    ["engine.model.config"],                                    # the model as config.json says, without torch
    ["engine.model.default_model"],                             # the default model, converted once
    ["engine.ring", "engine.distributed", "engine.ops"],        # steps, tensors and kernels between processes
    ["engine.model", "engine.sampling", "engine.structured"],
    ["engine.worker"],
    ["engine.executor"],
    ["engine.core", "engine.coordinator", "engine.api_server"],  # the three roles above the workers
]

# vsup's floors, bottom first, the same way: a leaf never reaches up into the supervisor or the CLI
VSUP_LAYERS = [
    # names, spellings and parsers that everything uses
    ["vsup.errors", "vsup.roles", "vsup.exits", "vsup.sizes", "vsup.cpulist", "vsup.addresses", "vsup.unix_http",
     "vsup.serve_flags", "vsup.shm_sweep", "vsup.messages"],
    ["vsup.procfs", "vsup.rundir", "vsup.model_shape", "vsup.log_query"],  # what a process, a run dir, a model is
    ["vsup.topology", "vsup.memory", "vsup.model_dir"],                   # the plan, pure
    ["vsup.placement"],
    ["vsup.devices"],
    ["vsup.diagnosis", "vsup.printer"],
    ["vsup.vllm"],                                                         # a stock vLLM's flags, names and hook
    ["vsup.k8s"],                                                          # Kubernetes: a pod's group, manifests
    ["vsup.supervisor", "vsup.front"],                                     # the two long-running parts
    ["vsup.cli"],
    ["vsup.__main__"],
]

# in-process mode (--no-multiprocessing) runs the engine core inside the API server: its one reach into
# the core, made inside a function, so that an API server of its own process never loads it
EXCEPTIONS = {("engine.api_server.inproc_client", "engine.core.setup")}


def entry_of(module: str, layers: list = LAYERS) -> tuple[int, str]:
    """(layer, entry) of a module of the engine (or of vsup, with VSUP_LAYERS)."""
    found = [(len(e), i, e) for i, layer in enumerate(layers) for e in layer
             if module == e or module.startswith(e + ".")]
    assert found, f"{module} is in no layer of tests/test_layers.py: add it there"
    _, i, e = max(found)
    return i, e


def modules(package: str):
    for path in sorted((REPO / package).rglob("*.py")):
        name = ".".join(path.relative_to(REPO).with_suffix("").parts).removesuffix(".__init__")
        yield name, path


def imports(path: Path, name: str):
    """(imported module, line, at module level) of every import in `path`, relative ones resolved."""
    tree = ast.parse(path.read_text())
    top = {id(n) for n in tree.body} | {id(c) for n in tree.body if isinstance(n, ast.If) for c in n.body}
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, node.lineno, id(node) in top
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[:len(package.split(".")) - node.level + 1] + ([base] if base else []))
            yield base, node.lineno, id(node) in top
            for alias in node.names:  # `from engine.wire import protocol` imports engine.wire.protocol
                yield f"{base}.{alias.name}", node.lineno, id(node) in top


def resolved(target: str, package: str = "engine") -> str | None:
    """The module of `package` that `target` names (the longest existing prefix), or None outside it."""
    if target != package and not target.startswith(package + "."):
        return None
    parts = target.split(".")
    while parts:
        candidate = ".".join(parts)
        base = REPO.joinpath(*parts)
        if base.with_suffix(".py").exists() or (base / "__init__.py").exists():
            return candidate
        parts.pop()
    return None


@pytest.mark.parametrize("package,layers", [("engine", LAYERS), ("vsup", VSUP_LAYERS)])
def test_no_import_runs_up_a_layer_or_across_to_a_sibling(package, layers):
    wrong = set()
    for name, path in modules(package):
        if name == package:
            continue
        layer, entry = entry_of(name, layers)
        for target, line, top_level in imports(path, name):
            module = resolved(target, package)
            if module is None or module == package:
                continue
            their_layer, their_entry = entry_of(module, layers)
            if (name, module) in EXCEPTIONS and not top_level:
                continue
            if their_layer > layer or (their_layer == layer and their_entry != entry):
                wrong.add(f"{path.relative_to(REPO)}:{line}: {name} ({entry}, layer {layer}) imports {module} "
                          f"({their_entry}, layer {their_layer})")
    assert not wrong, "imports against the layers:\n" + "\n".join(sorted(wrong))


def test_the_layer_check_sees_an_import_that_runs_up(tmp_path):
    """The check itself can fail: a scheduler that imported the API server would be named."""
    path = tmp_path / "scheduler.py"
    path.write_text("from engine.api_server import serving\n\ndef f():\n    import engine.worker.worker\n")
    found = [(resolved(t), top) for t, _, top in imports(path, "engine.core.scheduler") if resolved(t)]
    assert ("engine.api_server.serving", True) in found and ("engine.worker.worker", False) in found
    assert entry_of("engine.api_server.serving")[0] == entry_of("engine.core.scheduler")[0]
    assert entry_of("engine.api_server.serving")[1] != entry_of("engine.core.scheduler")[1]


def test_vsup_and_engine_never_import_each_other_but_the_model_config():
    """vsup reads config.json through the engine's one reader of it, a leaf without torch; nothing else."""
    crossing = [f"{path.relative_to(REPO)}:{line}: {target}"
                for package, other in (("vsup", "engine"), ("engine", "vsup"))
                for name, path in modules(package)
                for target, line, _ in imports(path, name) if target == other or target.startswith(other + ".")
                if not target.startswith("engine.model.config")]
    assert not crossing, crossing
    config = REPO / "engine" / "model" / "config.py"
    assert not [t for t, _, _ in imports(config, "engine.model.config") if resolved(t)], "config.py must stay a leaf"


def test_an_api_server_of_its_own_process_loads_no_engine_core_worker_or_torch(tmp_path):
    """The app as `python -m engine.api_server` builds it (multiprocess mode: the engine cores are other
    processes) holds nothing of the scheduler, the executor, the workers, the ring, nor torch."""
    from tests.local_deployment import with_test_tokenizer

    model = with_test_tokenizer(build_checkpoint(tmp_path / "raw", "llama"), tmp_path / "model")
    code = ("import sys\n"
            "from engine.api_server.server import build, parse_args\n"
            f"build(parse_args(['--model', {str(model)!r}, '--engine-address', 'ipc://{tmp_path}/e.sock']))\n"
            "print(' '.join(sorted(m for m in sys.modules if m == 'torch' or m.split('.')[:2] in (\n"
            "    ['engine', 'core'], ['engine', 'executor'], ['engine', 'worker'], ['engine', 'ring'],\n"
            "    ['engine', 'sampling'], ['engine', 'ops']))))\n"
            "print('engine.api_server.app' in sys.modules)\n")
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    loaded, built = result.stdout.splitlines()[-2:]
    assert built == "True" and loaded == "", f"the API server loaded: {loaded}"


@pytest.mark.parametrize("marker,layers", [("layers", LAYERS), ("vsup layers", VSUP_LAYERS)])
def test_the_architecture_doc_shows_these_layers(marker, layers):
    doc = (REPO / "docs" / "ARCHITECTURE.md").read_text()
    block = doc.split(f"<!-- {marker}: generated from tests/test_layers.py -->\n```\n")[1].split("```")[0]
    assert block.splitlines() == [" | ".join(layer) for layer in reversed(layers)], \
        "docs/ARCHITECTURE.md's layers differ from tests/test_layers.py: write them there as they are here"
