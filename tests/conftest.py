"""Guards every test shares: nothing a test starts may outlive it."""

import time

import psutil
import pytest


@pytest.fixture(autouse=True)
def no_orphans():
    """Fail a test that leaves child processes behind (and end them, so the next test starts clean)."""
    me = psutil.Process()
    before = {p.pid for p in me.children(recursive=True)}
    yield
    deadline = time.monotonic() + 5
    while True:
        left = [p for p in me.children(recursive=True) if p.pid not in before and _alive(p)]
        if not left or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    for p in left:
        p.kill()
    assert not left, f"processes left behind: {[(p.pid, _cmdline(p)) for p in left]}"


def _alive(p: psutil.Process) -> bool:
    try:
        return p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _cmdline(p: psutil.Process) -> str:
    try:
        return " ".join(p.cmdline())[:200]
    except psutil.Error:
        return "?"
