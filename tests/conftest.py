"""What every test shares: nothing a test starts may outlive it, and tiny random-weight models.

Pytest is a child subreaper, so a process re-parented when its supervisor died is still its
descendant; every test and every module checks that it left no process and no /dev/shm entry.
An entry counts as left behind only while no live process holds it: one that a process holds is
that process's, and a process of this session is checked itself, while another session's (a second
pytest) is none of this one's business and must not be removed.

The tiny Llama-family checkpoints are written by transformers with weights
re-drawn large enough (std 0.1, norms around 1, non-zero biases) that logits
are O(1), so a 1e-4 tolerance catches a wrongly mapped tensor. Each variant
is built once per session, on first use.
"""

import ctypes
import os
import time
from pathlib import Path

# Two xdist workers, and the processes their tests start, share the cores. An OpenMP thread that spins
# while it waits (libgomp's default) takes a core from another process at work; a passive one sleeps. It
# is read when libgomp loads, so it is set before torch is imported here, and every child inherits it.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import psutil  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

PR_SET_CHILD_SUBREAPER = 36
SHM = Path("/dev/shm")


def pytest_configure(config):
    """Make pytest a child subreaper: a process whose parent died (a supervisor killed with -9, say)
    is re-parented to pytest instead of init, so the orphan check below still sees it."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_CHILD_SUBREAPER) failed")
    if os.environ.get("PYTEST_XDIST_WORKER"):  # two workers share the cores: one torch thread each
        torch.set_num_threads(1)


class Snapshot:
    """The processes under pytest and the /dev/shm entries at one moment, to compare with later."""

    def __init__(self):
        self.pids = {p.pid for p in psutil.Process().children(recursive=True)}
        self.shm = set(os.listdir(SHM))

    def leftovers(self, timeout: float = 5.0) -> tuple[list[psutil.Process], list[str]]:
        """Processes and /dev/shm entries made since, still there after `timeout` seconds of grace.

        A process is this scope's only if no process of the snapshot that is still alive is its
        ancestor: a restarted worker of a module-scoped deployment belongs to that deployment."""
        deadline = time.monotonic() + timeout
        while True:
            everyone = [p for p in psutil.Process().children(recursive=True) if _alive(p)]
            older = [p for p in everyone if p.pid in self.pids or self._under_older(p)]
            left = [p for p in everyone if p not in older]
            shm = set(os.listdir(SHM)) - self.shm
            if older:  # an older scope's deployment still runs (and may restart): its module checks /dev/shm
                shm = set()
            if shm:  # one that a live process holds is its, and that process is checked: maybe another session's
                shm -= held_shm()
            if (not left and not shm) or time.monotonic() > deadline:
                return left, sorted(shm)
            time.sleep(0.05)

    def _under_older(self, p: psutil.Process) -> bool:
        me = os.getpid()
        try:
            for parent in p.parents():
                if parent.pid == me:
                    return False
                if parent.pid in self.pids and _alive(parent):
                    return True
        except psutil.Error:
            pass
        return False


def check_clean(before: Snapshot, scope: str) -> None:
    """Fail when `scope` left a process or a /dev/shm entry, naming each; end and remove them first,
    so that the next test starts clean."""
    left, shm = before.leftovers()
    described = [(p.pid, _cmdline(p)) for p in left]
    for p in left:
        try:
            p.kill()
        except psutil.Error:
            pass
    for name in shm:
        try:
            (SHM / name).unlink()
        except OSError:
            pass
    assert not left, f"{scope} left processes behind: {described}"
    assert not shm, f"{scope} left /dev/shm entries behind: {shm}"


# `make test` runs two xdist workers. Each module runs whole on one of them (its module-scoped deployment
# starts once), the longest first: a stock vLLM's (most of their time is vLLM starting, on one core), the
# multi-node ones, the benches, the other end-to-end modules, then the rest in collection order.
LONGEST_FIRST = ("tests/e2e/test_vllm", "tests/e2e/test_multinode", "tests/bench/", "tests/e2e/")


def module_of(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


def pytest_collection_modifyitems(items):
    def rank(item) -> int:
        module = module_of(item.nodeid)
        return next((i for i, prefix in enumerate(LONGEST_FIRST) if module.startswith(prefix)), len(LONGEST_FIRST))
    items.sort(key=rank)  # stable: every module keeps its own order


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """xdist's scheduler with a module as the unit of work, handed out in the order above."""
    from xdist.scheduler import LoadScopeScheduling

    class ByModule(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return module_of(nodeid)

        def _reschedule(self, node) -> None:
            """The next module only once this node runs its last test (xdist's own sends it two tests
            before: a long module then waits behind a long test while the other node has nothing)."""
            if not node.shutting_down and self.workqueue and self._pending_of(self.assigned_work[node]) > 1:
                return
            super()._reschedule(node)

    config.option.loadscopereorder = False
    return ByModule(config, log)


@pytest.fixture(autouse=True)
def no_orphans():
    """Fail a test that leaves processes (re-parented ones included) or /dev/shm entries behind."""
    before = Snapshot()
    yield
    check_clean(before, "this test")


@pytest.fixture(autouse=True, scope="module")
def no_orphans_module(request):
    """The same for what a module's fixtures (a module-scoped deployment) leave when the module ends."""
    before = Snapshot()
    yield
    check_clean(before, f"module {request.module.__name__}")


def held_shm() -> set[str]:
    """The /dev/shm entries that any live process on this machine has mapped or open now. By inode: a
    semaphore is mapped under the temporary name glibc made it with, then linked to its own."""
    inodes = set()
    for pid in (d for d in os.listdir("/proc") if d.isdigit()):
        try:
            with open(f"/proc/{pid}/maps") as f:
                inodes |= {int(line.split()[4]) for line in f if "/dev/shm/" in line}
            for fd in os.scandir(f"/proc/{pid}/fd"):
                if os.readlink(fd.path).startswith("/dev/shm/"):
                    inodes.add(os.stat(fd.path).st_ino)
        except (OSError, ValueError, IndexError):
            pass
    held = set()
    for entry in os.scandir(SHM):
        try:
            if entry.inode() in inodes:
                held.add(entry.name)
        except OSError:
            pass
    return held


def _alive(p: psutil.Process) -> bool:
    try:
        return p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _cmdline(p: psutil.Process) -> str:
    try:
        return " ".join(p.cmdline()).rstrip()[:200]  # (a process title is padded with spaces)
    except psutil.Error:
        return "?"


BASE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=256, max_position_embeddings=512, rms_norm_eps=1e-6)

VARIANTS = {
    "llama": ("llama", dict(tie_word_embeddings=False)),
    "llama_tied": ("llama", dict(tie_word_embeddings=True)),
    # llama3 rope scaling, and attention_bias, which Llama also puts on o_proj
    "llama3": ("llama", dict(tie_word_embeddings=False, attention_bias=True, rope_theta=500000.0,
                             rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                                               high_freq_factor=4.0, original_max_position_embeddings=64))),
    # q/k/v bias, tied head, and a vocabulary that TP=2 must pad
    "qwen2": ("qwen2", dict(tie_word_embeddings=True, vocab_size=251)),
    # several files plus model.safetensors.index.json, stored as bfloat16
    "sharded_bf16": ("llama", dict(tie_word_embeddings=False, save_dtype=torch.bfloat16, max_shard_size="40KB")),
}


def build_checkpoint(path: Path, family: str, seed: int = 0, **overrides) -> Path:
    """Write a tiny random model of `family` (llama, qwen2) to `path` with transformers."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    save_dtype = overrides.pop("save_dtype", torch.float32)
    max_shard_size = overrides.pop("max_shard_size", "50GB")
    config_cls, model_cls = {"llama": (LlamaConfig, LlamaForCausalLM),
                             "qwen2": (Qwen2Config, Qwen2ForCausalLM)}[family]
    torch.manual_seed(seed)
    model = model_cls(config_cls(**{**BASE, **overrides}))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.copy_(1 + 0.1 * torch.randn_like(param))
            else:
                param.copy_(0.1 * torch.randn_like(param))
    model.to(save_dtype).save_pretrained(path, safe_serialization=True, max_shard_size=max_shard_size)
    return path


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """tiny_model(variant) -> the directory of that checkpoint (see VARIANTS)."""
    built: dict[str, Path] = {}

    def get(variant: str) -> Path:
        if variant not in built:
            family, overrides = VARIANTS[variant]
            built[variant] = build_checkpoint(tmp_path_factory.mktemp(variant), family, **overrides)
        return built[variant]

    return get


@pytest.fixture(scope="session")
def hf_logits():
    """hf_logits(model_dir, token_ids) -> transformers' float32 logits [len, vocab]: the reference."""
    from transformers import AutoModelForCausalLM

    models = {}

    def run(model_dir: Path, token_ids: list[int]) -> torch.Tensor:
        if model_dir not in models:
            models[model_dir] = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        with torch.no_grad():
            return models[model_dir](torch.tensor([token_ids])).logits[0]

    return run


@pytest.fixture(scope="session")
def hf_greedy():
    """hf_greedy(model_dir, prompts: dict[id, (token_ids, n)]) -> {id: the n argmax tokens transformers picks}.

    Plain argmax of transformers' logits, token by token with its KV cache: unlike `generate` with
    min_new_tokens, it does not hold back EOS, as ignore_eos does not.
    """
    import inspect

    from transformers import AutoModelForCausalLM

    def run(model_dir: Path, prompts: dict) -> dict:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        # the cache's argument and field: `past_key_values` until transformers 5 renamed it `cache`
        cache = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
        out = {}
        with torch.no_grad():
            for key, (prompt, n) in prompts.items():
                ids, step, past = list(prompt), list(prompt), None
                for _ in range(n):
                    result = model(torch.tensor([step]), use_cache=True, **{cache: past})
                    past = getattr(result, cache)
                    ids.append(int(result.logits[0, -1].argmax()))
                    step = ids[-1:]
                out[key] = ids[len(prompt):]
        return out

    return run
