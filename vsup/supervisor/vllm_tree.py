"""Supervising a stock vLLM (DESIGN.md section 8): one `vllm serve` started, its whole tree watched.

vLLM starts the rest of its tree itself. The start-up hook (vsup/vllm/hook)
introduces every process of it on the hook socket, so the supervisor holds a
pidfd of each and tags its lines by the connection they came on. vLLM cannot
lose one part and go on, so the restart unit is the whole tree: the first death
(or /health failing, or requests waiting with no token coming out) ends what is
left, sweeps what it left in /dev/shm, and starts the tree again with vsup's
backoff and start limit. The supervisor is a child subreaper, so a process of
the tree whose parent died is re-parented to it, never to init.

Before the tree, vsup's front (vsup/front) holds the public port; the
supervisor tells it on its stdin when a tree goes down and when the next is
up, so that it can hold and resume the requests of the dead one. The front
is a unit of its own: it restarts alone.
"""

from __future__ import annotations

import ctypes
import json
import os
import selectors
import signal
import threading
import time
import urllib.request
from collections import deque
from dataclasses import dataclass, field

from vsup import procfs, shm_sweep
from vsup.supervisor import notify
from vsup.supervisor.child import Child, describe_exit
from vsup.supervisor.control import listen_unix
from vsup.supervisor.log_format import now_iso
from vsup.supervisor.manager import Options, Supervisor, Unit
from vsup.topology import ENGINE_CORE, FRONT, WORKER, Plan, process_name
from vsup.vllm import names
from vsup.vllm.plan import RESOURCE_TRACKER, tree_root
from vsup.vllm.progress import Progress, parse_metrics

PR_SET_CHILD_SUBREAPER = 36
UNIT = "vllm"
ATTRIBUTION_DELAY_S = 0.3
HOOK_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "vllm", "hook")


@dataclass
class VllmOptions:
    probe_url: str  # where the supervisor itself asks /health and /metrics
    health_timeout: float = 30.0
    hang_timeout: float = 120.0


@dataclass
class Observed:
    """A process of the tree that vLLM started and the hook introduced."""

    pid: int
    ppid: int
    pidfd: int | None
    started_at: float = field(default_factory=time.time)
    name: str | None = None
    role: str | None = None
    ranks: dict = field(default_factory=dict)
    title: str | None = None
    alive: bool = True
    last_exit: str | None = None


class VllmSupervisor(Supervisor):
    """Runs one stock vLLM tree until it is stopped or its start limit is spent."""

    def __init__(self, plan: Plan, run_dir, options: Options, router, vllm: VllmOptions):
        super().__init__(plan, run_dir, options, router)
        self.vllm = vllm
        self.root = Child(tree_root(plan), UNIT)
        self.front = Child(next(p for p in plan.processes if p.role == FRONT), FRONT)
        self.children = [self.front, self.root]
        self.units = {UNIT: Unit(UNIT, [self.root], options.restart_policy),
                      FRONT: Unit(FRONT, [self.front], options.restart_policy)}
        self.tree_gen = 0  # one more for every tree started: the front resumes on a newer one
        self.front_w: int | None = None
        self.tree: dict[int, Observed] = {}
        self.history: dict[str, dict] = {p.name: {"restarts": 0, "last_exit": None} for p in plan.processes}
        self.by_role: dict[str, int] = {}
        self.hellos: deque[dict] = deque()
        self.last_level: dict[tuple[int, str], str] = {}  # a traceback's or warning's next lines keep its level
        self.probes: deque[tuple[float, bool, tuple | None]] = deque()
        self.progress: Progress | None = None
        self.started_tree_at = time.monotonic()
        self.cause: str | None = None  # why the current tree is being ended
        self.first_death: tuple | None = None  # (process, when to look): a death not yet attributed
        self.shm_noted: set[str] = set()
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
        self.hook_path = str(run_dir.path / "hook.sock")
        self.hook_sock = listen_unix(self.hook_path, backlog=64)
        router.listen(self.hook_sock, self.on_hello, self.tag)
        self.janitor = self._start_janitor()
        self.probe_stop = threading.Event()
        threading.Thread(target=self._probe_loop, name="vllm-probe", daemon=True).start()

    def _start_janitor(self):
        import subprocess
        import sys

        r, w = os.pipe()
        proc = subprocess.Popen([sys.executable, "-m", "vsup.supervisor.janitor", str(self.run_dir.path)], stdin=r,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, close_fds=True)
        os.close(r)
        self.janitor_pipe = w  # never written: it closes when this process exits, however it exits
        return proc

    # who is who

    def on_hello(self, hello: dict) -> None:
        """Called on the router's thread when a process of the tree connects."""
        self.hellos.append(hello)
        os.write(self.wake_w, b"h")

    def _introduce(self, hello: dict) -> None:
        pid = int(hello["pid"])
        if pid == self.root.pid or pid in self.tree:
            return
        try:
            pidfd = os.pidfd_open(pid)
        except OSError:
            return  # already gone
        proc = self.tree[pid] = Observed(pid, int(hello.get("ppid") or 0), pidfd)
        self.selector.register(pidfd, selectors.EVENT_READ, proc)
        self._resolve(proc)
        self.save()

    def _resolve(self, proc: Observed) -> None:
        """Its vsup name and title, from its command line: re-read until vLLM has titled it for good (a
        spawned process starts as `python -c ...`, a worker is titled twice)."""
        if proc.name and proc.title and (proc.title.startswith(names.TITLE_PREFIX) or proc.role == names.HELPER):
            return
        title = procfs.cmdline(proc.pid)
        if title is None:
            return
        proc.title = title
        role = names.role_of_title(title.split(" "))
        if role is not None and (role.settled or proc.name is None):
            self._name(proc, role)
        elif proc.name is None and names.started_by_multiprocessing(title) and \
                (guess := self._by_parent(proc)) is not None:
            self._name(proc, guess)

    def _by_parent(self, proc: Observed) -> names.Role | None:
        """Before vLLM titles a spawned process, its parent may already say what it is: a child of an
        engine core is one of its workers; the one child of `vllm serve` that is not a helper is the
        engine core when the plan has no other. (A process that vLLM runs otherwise, such as its
        model-registry probe on a first start, is never guessed.)"""
        parent = self.tree.get(proc.ppid)
        if parent is not None and parent.role == ENGINE_CORE:
            return names.Role(WORKER, settled=False)
        if proc.ppid == self.root.pid and [p.role for p in self.plan.processes if p.role not in (
                FRONT, WORKER, names.HELPER) and p.name != self.root.spec.name] == [ENGINE_CORE]:
            return names.Role(ENGINE_CORE, dp=0)
        return None

    def _name(self, proc: Observed, role: names.Role) -> None:
        if role.role == names.HELPER:
            proc.role, proc.name = names.HELPER, f"{names.HELPER} {RESOURCE_TRACKER}"
            return
        if not role.settled:
            workers = [p for p in self.plan.processes if p.role == WORKER]
            if len(workers) != 1:
                proc.role = WORKER
                return
            role = names.Role(WORKER, dp=workers[0].dp, pp=workers[0].pp, tp=workers[0].tp)
        proc.role = role.role
        proc.ranks = {k: getattr(role, k) for k in ("a", "dp", "pp", "tp") if getattr(role, k) is not None}
        proc.name = process_name(role.role, **proc.ranks)

    def tag(self, line: str, stream: str, pid: int) -> dict:
        """The record of one line from the connection of process `pid` (on the router's thread)."""
        parsed = names.parse_line(line)
        writer = parsed.prefix_pid if parsed.prefix_pid in self.tree or parsed.prefix_pid == self.root.pid else pid
        who = self._who(writer, parsed.prefix_name)
        level = parsed.level or (self.last_level.get((pid, stream)) if names.continues(line) else None) or \
            ("error" if stream == "stderr" else "info")
        self.last_level[(pid, stream)] = level
        record = {"ts": now_iso(), "level": level, **who, "stream": stream, "event": parsed.message}
        if parsed.prefix_name:
            record["vllm"] = parsed.prefix_name
        if parsed.source:
            record["source"] = parsed.source
        return record

    def _who(self, pid: int, prefix_name: str | None) -> dict:
        root = self.root.spec
        if pid == self.root.pid:
            name, role, ranks = root.name, root.role, {"a": root.a}
        else:
            proc = self.tree.get(pid)
            if proc is not None and proc.name is None:
                self._resolve(proc)
                if proc.name is None and prefix_name:
                    role = names.role_of_name(prefix_name)
                    if role is not None:
                        self._name(proc, role)
            if proc is None or proc.name is None:
                role = proc.role if proc else None
                return {"name": role or f"pid {pid}", "role": role, "a": None, "dp": None, "pp": None, "tp": None,
                        "pid": pid}
            name, role, ranks = proc.name, proc.role, proc.ranks
        return {"name": name, "role": role, "a": ranks.get("a"), "dp": ranks.get("dp"), "pp": ranks.get("pp"),
                "tp": ranks.get("tp"), "pid": pid}

    # the loop

    def run(self) -> int:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda signum, _: self.request_stop(f"{signal.Signals(signum).name} received"))
        signal.set_wakeup_fd(self.wake_w)
        self.start_front()
        self.start([self.root])
        while not self.stopping:
            self.tick(timeout=self.next_timer())
            if self.units[UNIT].state == "running" and self.state != "serving" and self.cause is None and \
                    self.first_death is None and \
                    time.monotonic() - self.started_tree_at > self.options.startup_timeout:
                self.end_tree(f"startup timeout: /health not 200 after {self.options.startup_timeout:g} s",
                              self.root)
        self.shutdown()
        return self.exit_code

    def next_timer(self) -> float:
        wait = super().next_timer()
        return min(wait, max(0.0, self.first_death[1] - time.monotonic())) if self.first_death else wait

    def tick(self, timeout: float | None) -> None:
        super().tick(timeout)
        if self.first_death is not None and time.monotonic() >= self.first_death[1] and not self.stopping:
            self._attribute()
        while self.hellos:
            self._introduce(self.hellos.popleft())
        while self.probes:
            self.on_probe(*self.probes.popleft())

    def start(self, children: list[Child]) -> None:
        run_dir = self.run_dir.path
        tmp = shm_sweep.make_tmp_dir(run_dir)
        env = {**os.environ, **(self.options.env or {}), "VSUP_SUPERVISOR_PID": str(os.getpid()),
               "VSUP_HOOK_SOCKET": self.hook_path, "VSUP_HOOK_PARENT": str(os.getpid()),
               "VSUP_HOOK_SHM_LOG": str(run_dir / shm_sweep.LIST), "TMPDIR": str(tmp),
               "PYTHONPATH": os.pathsep.join([HOOK_DIR, *filter(None, [os.environ.get("PYTHONPATH")])])}
        # the root's own fds 1 and 2 are replaced by the hook's connections; these pipes catch what comes before
        out, err = self.root.spawn(env)
        tag = {"name": self.root.spec.name, "role": self.root.spec.role, "a": self.root.spec.a, "dp": None,
               "pp": None, "tp": None, "pid": self.root.pid}
        self.router.add(out, "stdout", tag)
        self.router.add(err, "stderr", tag)
        self.selector.register(self.root.pidfd, selectors.EVENT_READ, self.root)
        self.started_tree_at = time.monotonic()
        self.progress, self.cause, self.tree, self.state = None, None, {}, "starting"
        self.tree_gen += 1
        self.log("started", process=self.root.spec.name, pid=self.root.pid, argv=" ".join(self.root.spec.argv))
        self.tell_front()
        self.save()

    # the front

    def start_front(self) -> None:
        r, w = os.pipe()
        try:
            out, err = self.front.spawn({**os.environ, **(self.options.env or {}), "PYTHONUNBUFFERED": "1"}, stdin=r)
        finally:
            os.close(r)
        os.set_blocking(w, False)
        self.front_w = w
        tag = {"name": FRONT, "role": FRONT, "a": None, "dp": None, "pp": None, "tp": None, "pid": self.front.pid}
        self.router.add(out, "stdout", tag)
        self.router.add(err, "stderr", tag)
        self.selector.register(self.front.pidfd, selectors.EVENT_READ, self.front)
        self.log("started", process=FRONT, pid=self.front.pid)
        self.tell_front()

    def tell_front(self) -> None:
        """Say to the front what the tree is now: its gen, whether it serves, whether vsup is stopping."""
        if self.front_w is None:
            return
        up = self.state == "serving" and self.cause is None and self.first_death is None
        line = json.dumps({"gen": self.tree_gen, "up": up, "stopping": self.stopping, "restarts": self.by_role})
        try:
            os.write(self.front_w, line.encode() + b"\n")
        except (BlockingIOError, BrokenPipeError):
            pass  # (a front that does not read is dead, and restarts)

    def _front_exited(self) -> None:
        self.front.reap()
        os.close(self.front_w)
        self.front_w = None
        if self.stopping:
            self.front.state = "stopped"
            return
        unit = self.units[FRONT]
        self.log("process exited", "error", process=FRONT, pid=self.front.pid, exit=self.front.last_exit)
        delay = unit.restart.next_delay(time.monotonic(), unit.started_at) \
            if unit.restart.wants_restart(1, unit.requested) else None
        unit.requested = False
        if delay is None:
            self.fail(f"{FRONT} {self.front.last_exit}: nothing holds --port any more; "
                      f"{self._last_words(FRONT).removeprefix('; ') or 'no error lines'}")
            return
        self.front.state, unit.state, unit.restart_at = "backoff", "backoff", time.monotonic() + delay
        self.log("restarting", process=FRONT, delay_s=delay)
        self.save()

    # health and progress

    def _probe_loop(self) -> None:
        """/health every second (every 0.2 s while a tree starts: the front waits on it); vLLM's /metrics,
        which costs its API server more to render, only as often as --hang-timeout needs."""
        scraped = 0.0
        while not self.probe_stop.wait(1.0 if self.state == "serving" else 0.2):
            asked = time.monotonic()
            healthy = self._get("/health") is not None
            scrape = healthy and self.state == "serving" and asked - scraped >= min(5.0, self.vllm.hang_timeout / 8)
            text = self._get("/metrics") if scrape else None
            scraped = asked if scrape else scraped
            self.probes.append((asked, healthy, parse_metrics(text) if text else None))
            try:
                os.write(self.wake_w, b"p")
            except OSError:
                return

    def _get(self, path: str) -> str | None:
        try:
            with urllib.request.urlopen(self.vllm.probe_url + path, timeout=3.0) as response:
                return response.read().decode(errors="replace") if response.status == 200 else None
        except (OSError, ValueError):
            return None

    def on_probe(self, asked: float, healthy: bool, metrics) -> None:
        """One probe's answers (asked at `asked`); a probe asked before this tree started says nothing of it."""
        if self.units[UNIT].state != "running" or self.cause is not None or self.first_death is not None or \
                self.stopping or asked < self.started_tree_at:
            return
        now = asked
        for proc in self.tree.values():
            self._resolve(proc)
        if self.state != "serving":
            if healthy:
                self.state = "serving"
                self.progress = Progress(self.vllm.health_timeout, self.vllm.hang_timeout, now)
                self.log("ready", process=self.root.spec.name, pid=self.root.pid,
                         seconds=round(time.monotonic() - self.started_tree_at, 1))
                self.log(f"serving {self.options.model} on {self.options.url}")
                notify.sd_notify("READY=1")
                self._remember_shm()
                self.tell_front()
                self.save()
            return
        self._remember_shm()
        self._reap_adopted()
        why = self.progress.update(now, healthy, metrics)
        if why:
            self.end_tree(why, self.root)

    def _remember_shm(self) -> None:
        """Note the /dev/shm entries the tree has mapped now (each once), to remove them when it is gone."""
        pids = [self.root.pid, *(p.pid for p in self.tree.values() if p.alive)]
        new = set().union(*(procfs.mapped_shm(pid) for pid in pids if pid)) - self.shm_noted
        shm_sweep.record(self.run_dir.path, new)
        self.shm_noted |= new

    # deaths and restarts

    def on_exit(self, proc) -> None:
        self.selector.unregister(proc.pidfd)
        if proc is self.front:
            self._front_exited()
            return
        if isinstance(proc, Child):
            proc.reap()
        else:
            os.close(proc.pidfd)
            proc.pidfd, proc.alive = None, False
            proc.last_exit = procfs.exit_status(proc.pid)
        self._reap_adopted()
        if self.stopping:
            self.save()
            return
        if isinstance(proc, Observed) and proc.role is None:  # a subprocess vLLM ran and waited for
            self.save()
            return
        if self.cause is None and self.first_death is None and self.units[UNIT].state == "running":
            # the processes that follow it out (PR_SET_PDEATHSIG) die within milliseconds, but a killed
            # parent can still be tearing its threads down when its child's exit is seen: look a moment later
            self.first_death = (proc, time.monotonic() + ATTRIBUTION_DELAY_S)
            self.tell_front()
            return
        self._sweep_if_gone()

    def _attribute(self) -> None:
        """The first death, a moment on: find the process whose end ended the tree, and end the rest."""
        proc, _ = self.first_death
        self.first_death = None
        cause = self._first_to_die(proc)
        name = self._name_of(cause)
        if isinstance(cause, Observed) and cause.role == names.HELPER:
            self.log("helper exited", "warning", process=name, pid=cause.pid, exit=cause.last_exit)
            self.tell_front()  # the tree is still up
            self.save()
            return
        for dead in {id(proc): proc, id(cause): cause}.values():
            if dead.last_exit is not None:
                self.history.setdefault(self._name_of(dead), {"restarts": 0})["last_exit"] = dead.last_exit
        how = f"exited ({cause.last_exit})" if cause.last_exit else f"stopped {self._name_of(proc)} " \
                                                                     f"({proc.last_exit})"
        self.end_tree(f"{name} {how}", cause)
        self._sweep_if_gone()

    def _name_of(self, proc) -> str:
        return proc.spec.name if isinstance(proc, Child) else (proc.name or f"pid {proc.pid}")

    def _first_to_die(self, proc):
        """The process whose end ended the tree. One whose parent is dead too followed it out
        (PR_SET_PDEATHSIG), and one that exited 0 was told to by its parent (vLLM's processes never
        end cleanly on their own, and an engine core stops its workers before it exits): the parent is."""
        seen = set()
        while isinstance(proc, Observed) and proc.ppid not in seen:
            seen.add(proc.ppid)
            parent = self.root if proc.ppid == self.root.pid else self.tree.get(proc.ppid)
            if parent is None or parent is self.root and proc.last_exit == "exit 0":
                break
            if proc.last_exit != "exit 0" and (parent.popen.poll() is None if parent is self.root
                                               else procfs.running(parent.pid)):
                break
            if parent is not self.root and parent.last_exit is None:
                parent.last_exit = procfs.exit_status(parent.pid)
            proc = parent
        return proc

    def _reap_adopted(self) -> None:
        """Reap the tree's processes that were re-parented to us (a subreaper) and have exited."""
        import psutil

        for child in psutil.Process().children():
            if child.pid not in (self.root.pid, self.front.pid, self.janitor.pid):
                try:
                    if child.status() == psutil.STATUS_ZOMBIE:
                        _, status = os.waitpid(child.pid, os.WNOHANG)
                        proc = self.tree.get(child.pid)
                        if proc is not None and proc.last_exit in (None, "exited"):
                            proc.last_exit = describe_exit(os.waitstatus_to_exitcode(status))
                except (psutil.Error, ChildProcessError):
                    pass

    def end_tree(self, why: str, cause) -> None:
        """The first death (or a failed probe): end the rest of the tree, then restart it after backoff."""
        self.cause = why
        role = cause.spec.role if isinstance(cause, Child) else cause.role
        name = self._name_of(cause)
        self.log("vllm tree lost", "error", why=why, process=name)
        self._remember_shm()
        self._kill_tree()
        unit = self.units[UNIT]
        if name in self.history:
            self.history[name]["restarts"] += 1
        self.by_role[role or "unknown"] = self.by_role.get(role or "unknown", 0) + 1
        requested, unit.requested = unit.requested, False
        # vLLM exits 0 after an engine death (its issue #48966): an exit vsup did not ask for is a failure
        if not unit.restart.wants_restart(1, requested):
            self.fail(f"vllm tree lost: {why}; --restart-policy {unit.restart.policy.policy}{self._last_words(name)}")
            return
        delay = unit.restart.next_delay(time.monotonic(), unit.started_at)
        if delay is None:
            policy = unit.restart.policy
            self.fail(f"vllm tree lost: {why}; {policy.max_restarts} restarts within {policy.window_s:g} s, "
                      f"giving up{self._last_words(name)}")
            return
        unit.state, unit.restart_at = "backoff", time.monotonic() + delay
        self.state = "restarting"
        self.log("restarting", process=UNIT, delay_s=delay)
        self.tell_front()
        self.save()

    def _last_words(self, name: str | None) -> str:
        lines = [line for key in (name, self.root.spec.name) if key
                 for line in list(self.router.last_stderr.get(key, []))[-8:]]
        return ("; last error lines:\n" + "\n".join(f"    {line}" for line in lines[-10:])) if lines else ""

    def _kill_tree(self) -> None:
        if self.root.alive:
            try:
                os.killpg(self.root.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        for proc in self.tree.values():
            if proc.alive and proc.pidfd is not None:  # by pidfd: never a stranger who got the number
                try:
                    signal.pidfd_send_signal(proc.pidfd, signal.SIGKILL)
                except ProcessLookupError:
                    pass

    def _tree_alive(self) -> bool:
        return self.root.alive or any(p.alive for p in self.tree.values())

    def _sweep_if_gone(self) -> None:
        if not self._tree_alive() and self.cause is not None:
            removed = shm_sweep.sweep(self.run_dir.path)
            self.shm_noted = set()
            if removed:
                self.log("removed what the tree left in /dev/shm", "warning", entries=removed)
        self.save()

    def restart(self, unit: Unit) -> None:
        if unit.name == FRONT:
            unit.state, unit.started_at = "running", time.monotonic()
            self.front.restarts += 1
            self.start_front()
            return
        if self._tree_alive():
            unit.restart_at = time.monotonic() + 0.1  # the killed processes have not exited yet
            return
        unit.state, unit.started_at = "running", time.monotonic()
        self.root.restarts += 1
        self.start([self.root])

    def request_restart(self, role: str, dp: int | None) -> list[str]:
        """`vsup restart --role R`: the whole tree, counted under R, the way a crash would (the front:
        itself alone, after it drained)."""
        if role == FRONT:
            if self.units[FRONT].state != "running" or not self.front.alive:
                return []
            self.units[FRONT].requested = True
            self.front.signal(signal.SIGTERM)
            return [FRONT]
        unit = self.units[UNIT]
        victims = [p for p in self._current() if p["role"] == role and (dp is None or p.get("dp") == dp) and p["pid"]]
        if not victims or unit.state != "running" or self.cause is not None:
            return []
        unit.requested = True
        victim = next(p for p in self.tree.values() if p.pid == victims[0]["pid"]) \
            if victims[0]["pid"] != self.root.pid else self.root
        self.end_tree(f"vsup restart --role {role}", victim)
        return [UNIT]

    # stopping

    def shutdown(self) -> None:
        """SIGTERM to the front (it stops taking requests and finishes those it has) and to vllm serve (it
        drains through --shutdown-timeout), then SIGKILL what is left."""
        notify.sd_notify("STOPPING=1")
        self.tell_front()
        self.save()
        self.front.signal(signal.SIGTERM)
        self.root.signal(signal.SIGTERM)
        self._wait_tree(self.options.drain_timeout + self.options.stop_timeout, root_only=True)
        self._wait_tree(self.options.stop_timeout)
        deadline = time.monotonic() + self.options.stop_timeout
        while self.front.alive and time.monotonic() < deadline:
            self.tick(timeout=0.1)
        left = [name for name, child in ((FRONT, self.front), (self.root.spec.name, self.root)) if child.alive]
        left += [p.name or f"pid {p.pid}" for p in self.tree.values() if p.alive]
        if left:
            self.log("killed with SIGKILL after --stop-timeout", "warning", processes=left)
            if self.exit_code == 0 and self.state == "stopping":
                self.exit_code = 1
                self.message = f"stop needed SIGKILL for {', '.join(left)}"
        self._kill_tree()
        self.front.signal(signal.SIGKILL)
        while self._tree_alive() or self.front.alive:
            self.tick(timeout=0.1)
        self.probe_stop.set()
        self.cleanup()
        if self.state == "stopping":
            self.state = "stopped"
        self.save()

    def _wait_tree(self, seconds: float, root_only: bool = False) -> None:
        deadline = time.monotonic() + seconds
        while (self.root.alive if root_only else self._tree_alive()) and time.monotonic() < deadline:
            self.tick(timeout=0.1)

    def cleanup(self) -> None:
        removed = shm_sweep.sweep(self.run_dir.path)
        if removed:
            self.log("removed what the tree left in /dev/shm", "warning", entries=removed)
        self.hook_sock.close()
        super().cleanup()

    # state

    def _current(self) -> list[dict]:
        """The plan's processes, each with the live process now holding its name; then any vLLM started
        beyond the plan."""
        by_name: dict[str, object] = {self.root.spec.name: self.root} if self.root.alive else {}
        extra = []
        for proc in self.tree.values():
            if not proc.alive:
                continue
            if proc.name and proc.name not in by_name:
                by_name[proc.name] = proc
            else:
                extra.append(proc)
        front = self.front.to_json()
        if self.front.alive:
            front["state"] = "stopping" if self.stopping else "ready"
        rows = [front]
        for spec in self.plan.processes:
            if spec.role == FRONT:
                continue
            live = by_name.get(spec.name)
            rows.append(self._row(spec.name, spec.role, spec.device, spec.title, live,
                                  {"a": spec.a, "dp": spec.dp, "pp": spec.pp, "tp": spec.tp}))
        for proc in extra:
            rows.append(self._row(proc.name or f"pid {proc.pid}", proc.role, None, proc.title, proc, proc.ranks))
        return rows

    def _row(self, name, role, device, title, live, ranks) -> dict:
        history = self.history.get(name, {"restarts": 0, "last_exit": None})
        if live is None:
            state = {"backoff": "backoff", "failed": "failed"}.get(self.units[UNIT].state,
                                                                   "stopped" if self.stopping else "starting")
        else:
            state = "stopping" if self.stopping else ("ready" if self.state == "serving" else "starting")
        is_root = live is self.root
        pid = live.pid if live is not None else None
        shown = (procfs.cmdline(pid) if is_root else live.title) if live is not None else None
        return {"name": name, "role": role, "a": ranks.get("a"), "dp": ranks.get("dp"), "pp": ranks.get("pp"),
                "tp": ranks.get("tp"), "node": 0, "device": device, "title": shown or title, "unit": UNIT,
                "pid": pid, "state": state, "restarts": history["restarts"], "last_exit": history["last_exit"],
                "started_at": (live.started_at if live is not None else None)}

    def snapshot(self) -> dict:
        state = super().snapshot()
        state["supervisor"]["engine"] = "vllm"
        state["units"] = {UNIT: {"state": self.units[UNIT].state, "restarts": self.units[UNIT].restart.total,
                                 "by_role": dict(self.by_role)},
                          FRONT: {"state": self.units[FRONT].state, "restarts": self.units[FRONT].restart.total}}
        state["processes"] = self._current()
        state["remote"] = []
        return state
