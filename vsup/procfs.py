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
