"""One process of the tree as the supervisor holds it: spawned flat, in its own process group,
its pipes handed to the log router and its exit seen through a pidfd."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from dataclasses import dataclass, field

from vsup.exits import describe_exit
from vsup.supervisor.units import UnitId
from vsup.topology import ProcessSpec


@dataclass
class Child:
    spec: ProcessSpec
    unit: UnitId
    popen: subprocess.Popen | None = None
    pidfd: int | None = None
    started_at: float | None = None  # wall clock, for uptime
    ready: bool = False  # it said so since it last started
    restarts: int = 0
    last_exit: str | None = None
    extra_argv: list[str] = field(default_factory=list)
    sent: str | None = None  # the signal vsup sent it last since it started (an incident's evidence)
    peak_rss: int | None = None  # its peak RSS, from wait4 when reaped (an incident's evidence)

    @property
    def pid(self) -> int | None:
        return self.popen.pid if self.popen else None

    @property
    def alive(self) -> bool:
        return self.popen is not None and self.popen.returncode is None

    def spawn(self, env: dict[str, str], stdin: int = subprocess.DEVNULL, pass_fds: tuple[int, ...] = ()
              ) -> tuple[int, int]:
        """Start the process (`stdin`: a pipe's read end, or none; `pass_fds`: what else it inherits); returns
        the read ends of its stdout and stderr pipes."""
        if self.popen is not None:
            self.restarts += 1
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        try:
            self.sent = None
            self.popen = subprocess.Popen(
                [*self.spec.argv, *self.extra_argv], stdin=stdin, stdout=out_w, stderr=err_w,
                env={**env, **self.spec.env}, process_group=0, close_fds=True, pass_fds=pass_fds)
        finally:
            os.close(out_w)
            os.close(err_w)
        self.pidfd = os.pidfd_open(self.popen.pid)
        self.started_at, self.ready = time.time(), False
        return out_r, err_r

    def ended(self) -> bool:
        """Whether it has exited, without reaping it (reap takes its status and its peak RSS)."""
        if self.popen is None or self.popen.returncode is not None:
            return self.popen is not None
        try:
            return os.waitid(os.P_PID, self.popen.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
        except ChildProcessError:
            return self.popen.poll() is not None

    def reap(self) -> int:
        """Collect the exit status once the pidfd said it exited, and its peak RSS."""
        try:
            _, status, usage = os.wait4(self.popen.pid, 0)
            self.popen.returncode, self.peak_rss = os.waitstatus_to_exitcode(status), usage.ru_maxrss * 1024
        except ChildProcessError:  # (waited for already)
            pass
        code = self.popen.wait()
        if self.pidfd is not None:
            os.close(self.pidfd)
            self.pidfd = None
        self.last_exit = describe_exit(code)
        return code

    def signal(self, sig: int) -> bool:
        """Whether it was alive to be sent `sig`."""
        if self.alive:
            try:
                os.kill(self.popen.pid, sig)
                self.sent = signal.Signals(sig).name
                return True
            except ProcessLookupError:
                pass
        return False

    def to_json(self, state: str) -> dict:
        s = self.spec
        return {"name": s.name, "role": s.role, "a": s.a, "dp": s.dp, "pp": s.pp, "tp": s.tp, "node": s.node,
                "device": s.device, "title": s.title, "unit": str(self.unit), "pid": self.pid if self.alive else None,
                "state": state, "restarts": self.restarts, "last_exit": self.last_exit,
                "started_at": self.started_at}
