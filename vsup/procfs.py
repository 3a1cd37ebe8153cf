"""What /proc says of a process: alive or a zombie, how it exited, its command line, its /dev/shm maps."""

from __future__ import annotations

import os

from vsup.exits import describe_exit


def _stat_fields(pid: int) -> list[str]:
    """The fields of /proc/PID/stat after the command name (field 3, the state, first)."""
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()


def running(pid: int) -> bool:
    """Alive and not a zombie."""
    try:
        return _stat_fields(pid)[0] != "Z"
    except (OSError, IndexError):
        return False


PF_EXITING = 0x4  # a flag of field 9: the process has begun to exit


def ending(pid: int) -> bool:
    """Gone, a zombie, or on its way out: a killed process's main thread has begun to exit (or is a
    zombie already) while its other threads still end, which may take a while for a big one."""
    try:
        fields = _stat_fields(pid)
        return fields[0] == "Z" or bool(int(fields[6]) & PF_EXITING)
    except (OSError, IndexError, ValueError):
        return True


UNSEEN_EXIT = "exited"  # what exit_status says of a process already reaped: only that it exited


def exit_status(pid: int) -> str:
    """How a process that just exited ended, read from its zombie (field 52 of /proc/PID/stat) while
    its parent has not reaped it yet; else only that it exited (UNSEEN_EXIT)."""
    try:
        status = int(_stat_fields(pid)[49])
    except (OSError, IndexError, ValueError):
        return UNSEEN_EXIT
    return describe_exit(os.waitstatus_to_exitcode(status))


def cmdline(pid: int) -> str | None:
    """Its command line, or the title it set, as one string."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return " ".join(a.decode(errors="replace") for a in f.read().split(b"\0") if a)
    except OSError:
        return None


def mapped_shm(pid: int) -> set[str]:
    """The /dev/shm entries that process `pid` has mapped now."""
    try:
        with open(f"/proc/{pid}/maps") as f:
            return {line.split("/dev/shm/", 1)[1].rstrip("\n").removesuffix(" (deleted)")
                    for line in f if "/dev/shm/" in line}
    except OSError:
        return set()


def shm_in_use() -> set[str]:
    """The /dev/shm entries that a process this user can read has mapped or open now (a writer
    holds the fd of a segment it is creating before it maps it)."""
    names = set()
    for pid in (int(d) for d in os.listdir("/proc") if d.isdigit()):
        names |= mapped_shm(pid)
        try:
            for fd in os.scandir(f"/proc/{pid}/fd"):
                target = os.readlink(fd.path)
                if target.startswith("/dev/shm/"):
                    names.add(target.removeprefix("/dev/shm/").removesuffix(" (deleted)"))
        except OSError:
            continue
    return names


# memory evidence (vsup/supervisor/incidents.py)

def memory_cgroup(pid: int) -> str | None:
    """The directory of the memory cgroup that `pid` is in: cgroup v1's memory controller, else v2's unified
    hierarchy; None when it is gone or neither is mounted."""
    try:
        lines = open(f"/proc/{pid}/cgroup").read().splitlines()
    except OSError:
        return None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):
            return f"/sys/fs/cgroup/memory{path}".rstrip("/")
    unified = next((line.split(":", 2)[2] for line in lines if line.startswith("0::")), None)
    if unified is not None and os.path.exists("/sys/fs/cgroup/cgroup.controllers"):
        return f"/sys/fs/cgroup{unified}".rstrip("/")
    return None


def cgroup_oom_kills(directory: str) -> int | None:
    """The processes the OOM killer killed in that cgroup: `oom_kill` of memory.oom_control (v1) or
    memory.events (v2)."""
    for name in ("memory.oom_control", "memory.events"):
        value = _keyed(os.path.join(directory, name), "oom_kill")
        if value is not None:
            return value
    return None


def machine_oom_kills() -> int | None:
    return _keyed("/proc/vmstat", "oom_kill")


def peak_rss(pid: int) -> int | None:
    """VmHWM: the most resident memory the process has had, in bytes."""
    value = _keyed(f"/proc/{pid}/status", "VmHWM:")
    return None if value is None else value * 1024


def memory_pressure() -> float | None:
    """PSI's `some avg10` of memory: the share of the last 10 s in which some task waited for memory."""
    try:
        first = open("/proc/pressure/memory").readline().split()
        return float(dict(item.split("=") for item in first[1:])["avg10"])
    except (OSError, ValueError, KeyError, IndexError):
        return None


def set_oom_score_adj(pid: int, value: int) -> bool:
    """Whether the process's oom_score_adj is `value` now (lowering it needs CAP_SYS_RESOURCE)."""
    path = f"/proc/{pid}/oom_score_adj"
    try:
        with open(path, "w") as f:
            f.write(str(value))
        with open(path) as f:
            return int(f.read()) == value
    except (OSError, ValueError):
        return False


def _keyed(path: str, key: str) -> int | None:
    try:
        with open(path) as f:
            for line in f:
                parts = line.split()
                if len(parts) >= 2 and parts[0] == key:
                    return int(parts[1])
    except (OSError, ValueError):
        return None
    return None
