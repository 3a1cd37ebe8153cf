"""A deployment's run dir: `$VSUP_HOME/<name>` (else `$XDG_STATE_HOME/vsup/<name>`, else
`~/.local/state/vsup/<name>`), mode 0700, holding state.json, logs/, control.sock and the IPC sockets."""

from __future__ import annotations

import fcntl
import json
import os
import re
import stat
from pathlib import Path

from vsup import addresses
from vsup.errors import Failure, UsageError

NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")


class NoDeployment(Failure):
    """`ps`, `logs`, `stop` for a name that was never served here; the CLI exits 1."""


def home() -> Path:
    if os.environ.get("VSUP_HOME"):
        return Path(os.environ["VSUP_HOME"])
    state = os.environ.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local", "state")
    return Path(state) / "vsup"


def home_source() -> str:
    """The variable that chose home(), for messages: how to point the run dirs elsewhere."""
    for variable in ("VSUP_HOME", "XDG_STATE_HOME"):
        if os.environ.get(variable):
            return f"{variable}={os.environ[variable]}"
    return "the default ~/.local/state/vsup"


class RunDir:
    """Paths and files of one named deployment."""

    def __init__(self, name: str):
        if not NAME.fullmatch(name):
            raise UsageError(f"--name {name!r} must be 1-64 letters, digits, '.', '_' or '-'")
        self.name = name
        self.path = home() / name
        self._lock_fd: int | None = None

    @property
    def state_file(self) -> Path:
        return Path(addresses.state_file(str(self.path)))

    @property
    def log_dir(self) -> Path:
        return self.path / "logs"

    @property
    def log_file(self) -> Path:
        return self.log_dir / "vsup.jsonl"

    @property
    def control_socket(self) -> Path:
        return Path(addresses.control_socket(str(self.path)))

    @property
    def metrics_dir(self) -> Path:
        return Path(addresses.metrics_dir(str(self.path)))

    def exists(self) -> bool:
        try:
            return self.state_file.exists() or self.log_file.exists()
        except OSError as e:  # (a missing one is False; this is a run dir we may not look into)
            raise UsageError(f"the run dir {self.path} cannot be read ({e.strerror}); it comes from "
                             f"{home_source()}: set VSUP_HOME to a directory of yours") from None

    def check(self) -> None:
        """Refuse, before anything starts, a run dir that cannot be made or written, or that another user
        owns or may enter: its control.sock and IPC sockets would be theirs to reach."""
        origin = f"it comes from {home_source()}"
        elsewhere = "choose another --name or set VSUP_HOME to a directory of yours"
        for path in (self.path, self.log_dir):
            try:
                info = os.stat(path)
            except FileNotFoundError:
                continue
            except OSError as e:
                raise UsageError(f"the run dir {path} cannot be used ({e.strerror}); {origin}: set VSUP_HOME to "
                                 f"a directory you can write") from None
            if not stat.S_ISDIR(info.st_mode):
                raise UsageError(f"the run dir {path} is not a directory; {origin}: {elsewhere}")
            if info.st_uid != os.geteuid():
                raise UsageError(f"the run dir {path} belongs to uid {info.st_uid}, not to you (uid {os.geteuid()}), "
                                 f"and its control.sock would be theirs; {origin}: {elsewhere}")
            if info.st_mode & 0o077:
                raise UsageError(f"the run dir {path} is open to others (mode {stat.S_IMODE(info.st_mode):04o}), "
                                 f"so its control.sock would be too: chmod 700 {path}, or {elsewhere}")
        for path in (self.path, self.log_dir) if self.log_dir.is_dir() else (self.path,):
            _probe_writable(path, f"{origin}: set VSUP_HOME to a directory you can write")

    def require(self) -> RunDir:
        """For commands that read a deployment: fail with exit 1 when there is none."""
        if not self.exists():
            raise NoDeployment(f"no deployment named {self.name!r} (looked in {self.path}); "
                               f"start one with 'vsup serve --name {self.name}'")
        return self

    def create(self) -> None:
        """Make the run dir and logs/ with mode 0700, whatever the umask."""
        for path in (self.path, self.log_dir):
            path.mkdir(parents=True, exist_ok=True)
            os.chmod(path, 0o700)

    def lock(self) -> None:
        """Hold the deployment: a second supervisor with the same name is refused, naming our pid."""
        fd = os.open(self.path / "supervisor.pid", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            pid = os.read(fd, 32).decode().strip() or "?"
            os.close(fd)
            raise UsageError(f"deployment {self.name!r} is already served by pid {pid}; "
                             f"stop it with 'vsup stop --name {self.name}' or choose another --name") from None
        os.ftruncate(fd, 0)
        os.write(fd, str(os.getpid()).encode())
        self._lock_fd = fd  # held until this process exits

    def empty_metrics(self) -> None:
        """A new deployment's API servers count from 0: the files of the last one under this name go."""
        import shutil

        shutil.rmtree(self.metrics_dir, ignore_errors=True)
        self.metrics_dir.mkdir(mode=0o700)
        os.chmod(self.metrics_dir, 0o700)

    def remove_sockets(self) -> None:
        """At the stop: the sockets and rendezvous files that the tree left here."""
        for entry in os.scandir(self.path):
            if entry.name.endswith(".sock") or "-dist-" in entry.name:
                os.unlink(entry.path)

    def write_state(self, state: dict) -> None:
        """Atomically replace state.json (0600): a reader sees the old or the new, never half."""
        tmp = self.state_file.with_suffix(".json.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump(state, f)
        os.replace(tmp, self.state_file)

    def read_state(self) -> dict:
        return json.loads(self.state_file.read_text())


def _probe_writable(path: Path, fix: str) -> None:
    """Make and remove a directory where `path` is, or would be made: the one test of "can be created or
    written" that holds for root too, on read-only mounts and in /proc alike."""
    existing = path
    while not os.path.lexists(existing) and existing != existing.parent:
        existing = existing.parent
    what = "written" if existing == path else "created"
    try:
        import tempfile

        os.rmdir(tempfile.mkdtemp(prefix=".vsup-probe-", dir=existing))
    except OSError as e:
        where = "" if existing == path else f" (in {existing})"
        raise UsageError(f"the run dir {path} cannot be {what}{where}: {e.strerror}; {fix}") from None
