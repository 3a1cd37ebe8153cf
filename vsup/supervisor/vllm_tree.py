"""Supervising a stock vLLM: one `vllm serve` started, its whole tree watched.

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

With `--replicas N` there are N trees (vsup/supervisor/vllm_replica.py), each a
unit of its own: a death ends and restarts its tree only, while the front sends
that tree's requests on to the others. `vsup restart --rolling` drains and
restarts them one at a time.
"""

from __future__ import annotations

import contextlib
import ctypes
import itertools
import json
import os
import selectors
import signal
import threading
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path

from vsup import addresses, procfs, shm_sweep, unix_http
from vsup.supervisor import notify
from vsup.supervisor.child import Child, describe_exit
from vsup.supervisor.control import listen_unix
from vsup.supervisor.log_format import now_iso
from vsup.supervisor.manager import Options, Supervisor, Unit
from vsup.supervisor.states import DeploymentState, ProcessState, TreeState, UnitState
from vsup.supervisor.units import UnitId
from vsup.supervisor.vllm_replica import REAP_LOG, Observed, Tree
from vsup.topology import FRONT, Plan
from vsup.vllm import names
from vsup.vllm.plan import tree_roots
from vsup.vllm.progress import Progress, parse_metrics

PR_SET_CHILD_SUBREAPER = 36
ATTRIBUTION_DELAY_S = 0.3
FRONT_UNIT = UnitId.alone(FRONT)  # the front restarts alone
HOOK_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "vllm", "hook")


@dataclass
class VllmOptions:
    health_timeout: float = 30.0
    hang_timeout: float = 120.0


class VllmSupervisor(Supervisor):
    """Runs the stock vLLM trees of one deployment until it is stopped or every tree's start limit is spent."""

    def __init__(self, plan: Plan, run_dir, options: Options, router, vllm: VllmOptions):
        super().__init__(plan, run_dir, options, router)
        self.vllm = vllm
        self.front = Child(next(p for p in plan.processes if p.role == FRONT), FRONT_UNIT)
        roots = tree_roots(plan)
        self.trees: list[Tree] = []
        for spec in roots:
            root = Child(spec, UnitId.vllm_tree(spec.r))
            tree_dir = Path(addresses.replica_dir(str(run_dir.path), spec.r))
            tree_dir.mkdir(mode=0o700, exist_ok=True)
            self.trees.append(Tree(spec.r, root, Unit(root.unit, [root], options.restart_policy),
                                   addresses.vllm_socket(str(run_dir.path), spec.r), tree_dir, plan))
        self.children = [self.front, *(t.root for t in self.trees)]
        self.units = {FRONT_UNIT: Unit(FRONT_UNIT, [self.front], options.restart_policy),
                      **{t.unit.id: t.unit for t in self.trees}}
        self.gens = itertools.count(1)  # every tree started gets the next: the front resumes on another one
        self.front_w: int | None = None
        self.tree_of: dict[int, Tree] = {}  # pid -> its tree (written on the router's thread too)
        self.history: dict[str, dict] = {p.name: {"restarts": 0, "last_exit": None} for p in plan.processes}
        self.hellos: deque[dict] = deque()
        self.last_level: dict[tuple[int, str], str] = {}  # a traceback's or warning's next lines keep its level
        self.probes: deque[tuple[Tree, float, bool, tuple | None]] = deque()
        self.rolling: deque[Tree] = deque()  # `vsup restart --rolling`: the trees still to drain and restart
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

        return subprocess.Popen([sys.executable, "-m", "vsup.supervisor.janitor", str(self.run_dir.path),
                                 str(os.getpid())], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL, close_fds=True)

    # who is who

    def on_hello(self, hello: dict) -> None:
        """Called on the router's thread when a process of a tree connects (the hello names its replica)."""
        try:
            self.tree_of[int(hello["pid"])] = self.trees[int(hello.get("replica") or 0)]
        except (ValueError, TypeError, IndexError):
            return
        self.hellos.append(hello)
        os.write(self.wake_w, b"h")

    def _introduce(self, hello: dict) -> None:
        pid = int(hello["pid"])
        tree = self.tree_of[pid]
        if tree.owns(pid):
            return
        try:
            pidfd = os.pidfd_open(pid)
        except OSError:
            return  # already gone
        proc = tree.procs[pid] = Observed(pid, int(hello.get("ppid") or 0), pidfd)
        self.selector.register(pidfd, selectors.EVENT_READ, proc)
        tree.resolve(proc)
        self.save()

    def tag(self, line: str, stream: str, pid: int) -> dict:
        """The record of one line from the connection of process `pid` (on the router's thread)."""
        parsed = names.parse_line(line)
        tree = self.tree_of.get(pid, self.trees[0])
        writer = parsed.prefix_pid if tree.owns(parsed.prefix_pid) else pid
        who = tree.who(writer, parsed.prefix_name)
        if tree.r is None:
            del who["r"]
        level = parsed.level or (self.last_level.get((pid, stream)) if names.continues(line) else None) or \
            ("error" if stream == "stderr" else "info")
        self.last_level[(pid, stream)] = level
        record = {"ts": now_iso(), "level": level, **who, "stream": stream, "event": parsed.message}
        if parsed.prefix_name:
            record["vllm"] = parsed.prefix_name
        if parsed.source:
            record["source"] = parsed.source
        return record

    # the loop

    def run(self) -> int:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda signum, _: self.request_stop(f"{signal.Signals(signum).name} received"))
        signal.set_wakeup_fd(self.wake_w)
        # what an earlier run of this deployment left, if its janitor was killed with it (systemd ends a
        # unit's whole cgroup); no other run uses it, as this one holds the deployment's lock
        removed = shm_sweep.sweep_deployment(self.run_dir.path)
        if removed:
            self.log("removed what an earlier run left in /dev/shm", "warning", entries=removed)
        self.start_front()
        for tree in self.trees:
            self.start_tree(tree)
        while not self.stopping:
            self.tick(timeout=self.next_timer())
            now = time.monotonic()
            for tree in self.trees:
                if tree.unit.state != UnitState.RUNNING or tree.cause is not None or tree.first_death is not None:
                    continue
                if tree.state != TreeState.SERVING and now - tree.started_at > self.options.startup_timeout:
                    self.end_tree(tree, f"startup timeout: /health not 200 after {self.options.startup_timeout:g} s",
                                  tree.root)
                elif tree.draining_until is not None and now > tree.draining_until:
                    self.end_tree(tree, "rolling restart: still draining after --drain-timeout", tree.root)
        self.shutdown()
        return self.exit_code

    def next_timer(self) -> float:
        waits = [t.first_death[1] - time.monotonic() for t in self.trees if t.first_death]
        return max(0.0, min([super().next_timer(), *waits]))

    def tick(self, timeout: float | None) -> None:
        super().tick(timeout)
        for tree in self.trees:
            if tree.first_death is not None and time.monotonic() >= tree.first_death[1] and not self.stopping:
                self._attribute(tree)
        while self.hellos:
            self._introduce(self.hellos.popleft())
        while self.probes:
            self.on_probe(*self.probes.popleft())

    def start_tree(self, tree: Tree) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tree.socket)  # (its last tree's: vLLM binds the path anew)
        tmp = shm_sweep.make_tmp_dir(tree.dir)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tree.dir / REAP_LOG)  # its last tree's pids
        env = {**os.environ, **(self.options.env or {}), "VSUP_SUPERVISOR_PID": str(os.getpid()),
               "VSUP_HOOK_SOCKET": self.hook_path, "VSUP_HOOK_PARENT": str(os.getpid()),
               "VSUP_HOOK_REPLICA": str(tree.r or 0),
               "VSUP_HOOK_SHM_LOG": str(tree.dir / shm_sweep.LIST), "VSUP_HOOK_REAP_LOG": str(tree.dir / REAP_LOG),
               "TMPDIR": str(tmp),
               "PYTHONPATH": os.pathsep.join([HOOK_DIR, *filter(None, [os.environ.get("PYTHONPATH")])])}
        # the root's own fds 1 and 2 are replaced by the hook's connections; these pipes catch what comes before
        for pid in [pid for pid, owner in list(self.tree_of.items()) if owner is tree]:  # its last tree's
            self.tree_of.pop(pid, None)
        root = tree.root
        out, err = root.spawn(env)
        self.tree_of[root.pid] = tree
        tag = {"name": root.spec.name, "role": root.spec.role, **({"r": tree.r} if tree.r is not None else {}),
               "a": root.spec.a, "dp": None, "pp": None, "tp": None, "pid": root.pid}
        self.router.add(out, "stdout", tag)
        self.router.add(err, "stderr", tag)
        self.selector.register(root.pidfd, selectors.EVENT_READ, root)
        tree.started_at, tree.gen = time.monotonic(), next(self.gens)
        tree.progress, tree.cause, tree.procs, tree.draining_until = None, None, {}, None
        tree.state = TreeState.STARTING
        self.log("started", process=root.spec.name, pid=root.pid, argv=" ".join(root.spec.argv))
        self._overall()
        self.tell_front()
        self.save()

    def _overall(self) -> None:
        """The deployment's state from its trees': serving while any tree serves."""
        if self.stopping:
            return
        states = {t.state for t in self.trees}
        self.state = DeploymentState.SERVING if TreeState.SERVING in states else \
            DeploymentState.RESTARTING if TreeState.RESTARTING in states else DeploymentState.STARTING

    # the front

    def start_front(self) -> None:
        r, w = os.pipe()
        self.front.extra_argv, port = self.port_args()
        try:
            out, err = self.front.spawn({**os.environ, **(self.options.env or {}), "PYTHONUNBUFFERED": "1"}, stdin=r,
                                        pass_fds=port)
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
        """Say to the front what each tree is now: its gen, whether it takes requests, whether vsup is
        stopping; and the restarts so far, by role."""
        if self.front_w is None:
            return
        restarts: dict[str, int] = {}
        for tree in self.trees:
            for role, n in tree.by_role.items():
                restarts[role] = restarts.get(role, 0) + n
        lines = [json.dumps({"replica": tree.r or 0, "gen": tree.gen, "up": tree.up, "stopping": self.stopping,
                             "restarts": restarts}) + "\n" for tree in self.trees]
        try:
            os.write(self.front_w, "".join(lines).encode())
        except (BlockingIOError, BrokenPipeError):
            pass  # (a front that does not read is dead, and restarts)

    def _front_exited(self) -> None:
        self.front.reap()
        os.close(self.front_w)
        self.front_w = None
        if self.stopping:
            self.front.state = ProcessState.STOPPED
            return
        unit = self.units[FRONT_UNIT]
        self.log("process exited", "error", process=FRONT, pid=self.front.pid, exit=self.front.last_exit)
        delay = unit.restart.next_delay(time.monotonic(), unit.started_at) \
            if unit.restart.wants_restart(1, unit.requested) else None
        unit.requested = False
        if delay is None:
            self.fail(f"{FRONT} {self.front.last_exit}: nothing holds --port any more; "
                      f"{self._last_words(FRONT).removeprefix('; ') or 'no error lines'}")
            return
        self.front.state, unit.state = ProcessState.BACKOFF, UnitState.BACKOFF
        unit.restart_at = time.monotonic() + delay
        self.log("restarting", process=FRONT, delay_s=delay)
        self.save()

    # health and progress

    def _probe_loop(self) -> None:
        """Each tree's /health every second (every 0.2 s while one starts: the front waits on it); vLLM's
        /metrics, which costs its API server more to render, only as often as --hang-timeout needs."""
        scraped = {id(t): 0.0 for t in self.trees}
        while not self.probe_stop.wait(1.0 if all(t.state == TreeState.SERVING for t in self.trees) else 0.2):
            for tree in self.trees:
                asked = time.monotonic()
                healthy = self._get(tree, "/health") is not None
                scrape = healthy and tree.state == TreeState.SERVING and \
                    asked - scraped[id(tree)] >= min(5.0, self.vllm.hang_timeout / 8)
                text = self._get(tree, "/metrics") if scrape else None
                scraped[id(tree)] = asked if scrape else scraped[id(tree)]
                self.probes.append((tree, asked, healthy, parse_metrics(text) if text else None))
            try:
                os.write(self.wake_w, b"p")
            except OSError:
                return

    @staticmethod
    def _get(tree: Tree, route: str) -> str | None:
        try:
            status, body = unix_http.get(tree.socket, route, timeout=3.0)
        except OSError:
            return None
        return body if status == 200 else None

    def on_probe(self, tree: Tree, asked: float, healthy: bool, metrics) -> None:
        """One probe's answers (asked at `asked`); a probe asked before this tree started says nothing of it."""
        if tree.unit.state != UnitState.RUNNING or tree.cause is not None or tree.first_death is not None or \
                self.stopping or asked < tree.started_at:
            return
        for proc in tree.procs.values():
            tree.resolve(proc)
        if tree.state != TreeState.SERVING:
            if healthy:
                with contextlib.suppress(OSError):
                    os.chmod(tree.socket, 0o600)  # (vLLM binds it under the umask; the run dir is 0700 anyway)
                tree.state = TreeState.SERVING
                tree.progress = Progress(self.vllm.health_timeout, self.vllm.hang_timeout, asked)
                self.log("ready", process=tree.root.spec.name, pid=tree.root.pid,
                         seconds=round(time.monotonic() - tree.started_at, 1))
                if self.state != DeploymentState.SERVING:
                    self.log(f"serving {self.options.model} on {self.options.url}")
                    notify.sd_notify("READY=1")
                self._overall()
                self._remember_shm(tree)
                self.tell_front()
                self.save()
                if self.rolling and self.rolling[0] is tree:
                    self.rolling.popleft()
                    self._roll_next()
            return
        if tree.draining_until is not None:
            return  # (its requests finish; no new ones come)
        self._remember_shm(tree)
        self._reap_adopted()
        why = tree.progress.update(asked, healthy, metrics)
        if why:
            self.end_tree(tree, why, tree.root)

    def _remember_shm(self, tree: Tree) -> None:
        """Note the /dev/shm entries the tree has mapped now (each once), to remove them when it is gone."""
        pids = [tree.root.pid, *(p.pid for p in tree.procs.values() if p.alive)]
        new = set().union(*(procfs.mapped_shm(pid) for pid in pids if pid)) - tree.shm_noted
        shm_sweep.record(tree.dir, new)
        tree.shm_noted |= new

    # deaths and restarts

    def on_exit(self, proc) -> None:
        self.selector.unregister(proc.pidfd)
        if proc is self.front:
            self._front_exited()
            return
        tree = self.tree_of[proc.pid]
        if isinstance(proc, Child):
            proc.reap()
        else:
            os.close(proc.pidfd)
            proc.pidfd, proc.alive = None, False
            if proc.last_exit in (None, procfs.UNSEEN_EXIT):  # (we may have reaped it already, with its status)
                proc.last_exit = procfs.exit_status(proc.pid)
        self._reap_adopted()
        if self.stopping:
            self.save()
            return
        if isinstance(proc, Observed) and proc.role is None:  # a subprocess vLLM ran and waited for
            self.save()
            return
        if tree.cause is None and tree.first_death is None and tree.unit.state == UnitState.RUNNING:
            # the processes that follow it out (PR_SET_PDEATHSIG) die within milliseconds, but a killed
            # parent can still be tearing its threads down when its child's exit is seen: look a moment later
            tree.first_death = (proc, time.monotonic() + ATTRIBUTION_DELAY_S)
            self.tell_front()
            return
        self._sweep_if_gone(tree)

    def _attribute(self, tree: Tree) -> None:
        """The first death, a moment on: find the process whose end ended the tree, and end the rest."""
        proc, _ = tree.first_death
        tree.first_death = None
        tree.learn_reaped()
        cause = tree.first_to_die(proc)
        name = tree.name_of(cause)
        if isinstance(cause, Observed) and cause.role == names.HELPER:
            self.log("helper exited", "warning", process=name, pid=cause.pid, exit=cause.last_exit)
            self.tell_front()  # the tree is still up
            self.save()
            return
        for dead in {id(proc): proc, id(cause): cause}.values():
            if dead.last_exit is not None:
                self.history.setdefault(tree.name_of(dead), {"restarts": 0})["last_exit"] = dead.last_exit
        how = f"exited ({cause.last_exit})" if cause.last_exit else f"stopped {tree.name_of(proc)} " \
                                                                     f"({proc.last_exit})"
        self.end_tree(tree, f"{name} {how}", cause)
        self._sweep_if_gone(tree)

    def _reap_adopted(self) -> None:
        """Reap the trees' processes that were re-parented to us (a subreaper) and have exited."""
        import psutil

        ours = {self.front.pid, self.janitor.pid, *(t.root.pid for t in self.trees)}
        for child in psutil.Process().children():
            if child.pid not in ours:
                try:
                    if child.status() == psutil.STATUS_ZOMBIE:
                        _, status = os.waitpid(child.pid, os.WNOHANG)
                        tree = self.tree_of.get(child.pid)
                        proc = tree.procs.get(child.pid) if tree else None
                        if proc is not None and proc.last_exit in (None, procfs.UNSEEN_EXIT):
                            proc.last_exit = describe_exit(os.waitstatus_to_exitcode(status))
                except (psutil.Error, ChildProcessError):
                    pass

    def end_tree(self, tree: Tree, why: str, cause) -> None:
        """The first death (or a failed probe): end the rest of the tree, then restart it after backoff
        (at once, uncounted, after a rolling restart's drain)."""
        tree.cause = why
        name = tree.name_of(cause)
        unit = tree.unit
        drained = tree.draining_until is not None
        self.log("vllm tree drained" if drained else "vllm tree lost", "info" if drained else "error", why=why,
                 process=name, unit=str(unit.id))
        self._remember_shm(tree)
        self._kill_tree(tree)
        requested, unit.requested = unit.requested, False
        tree.state = TreeState.RESTARTING
        if drained:
            unit.state, unit.restart_at = UnitState.BACKOFF, time.monotonic()
            self._overall()
            self.tell_front()
            self.save()
            return
        role = cause.spec.role if isinstance(cause, Child) else cause.role
        if name in self.history:
            self.history[name]["restarts"] += 1
        tree.by_role[role or "unknown"] = tree.by_role.get(role or "unknown", 0) + 1
        # vLLM exits 0 after an engine death (its issue #48966): an exit vsup did not ask for is a failure
        if not unit.restart.wants_restart(1, requested):
            self._give_up(tree, f"vllm tree lost: {why}; --restart-policy {unit.restart.policy.policy}"
                                f"{self._last_words(name, tree)}")
            return
        delay = unit.restart.next_delay(time.monotonic(), unit.started_at)
        if delay is None:
            policy = unit.restart.policy
            self._give_up(tree, f"vllm tree lost: {why}; {policy.max_restarts} restarts within "
                                f"{policy.window_s:g} s, giving up{self._last_words(name, tree)}")
            return
        unit.state, unit.restart_at = UnitState.BACKOFF, time.monotonic() + delay
        self.log("restarting", process=str(unit.id), delay_s=delay)
        self._overall()
        self.tell_front()
        self.save()

    def _give_up(self, tree: Tree, message: str) -> None:
        """A tree that will not restart: the deployment fails with it unless another tree still can serve."""
        tree.unit.state, tree.state = UnitState.FAILED, TreeState.FAILED
        if all(t.unit.state == UnitState.FAILED for t in self.trees):
            self.fail(message)
            return
        self.log(f"{str(tree.unit.id)} failed; the other replicas go on", "error", why=message)
        self._overall()
        self.tell_front()
        self.save()

    def _last_words(self, name: str | None, tree: Tree) -> str:
        lines = [line for key in (name, tree.root.spec.name) if key
                 for line in list(self.router.last_stderr.get(key, []))[-8:]]
        return ("; last error lines:\n" + "\n".join(f"    {line}" for line in lines[-10:])) if lines else ""

    def _kill_tree(self, tree: Tree) -> None:
        if tree.root.alive:
            try:
                os.killpg(tree.root.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        for proc in tree.procs.values():
            if proc.alive and proc.pidfd is not None:  # by pidfd: never a stranger who got the number
                try:
                    signal.pidfd_send_signal(proc.pidfd, signal.SIGKILL)
                except ProcessLookupError:
                    pass

    def _sweep_if_gone(self, tree: Tree) -> None:
        if not tree.alive and tree.cause is not None:
            removed = shm_sweep.sweep(tree.dir)
            tree.shm_noted = set()
            if removed:
                self.log("removed what the tree left in /dev/shm", "warning", entries=removed)
        self.save()

    def restart(self, unit: Unit) -> None:
        if unit.id == FRONT_UNIT:
            unit.state, unit.started_at = UnitState.RUNNING, time.monotonic()
            self.front.restarts += 1
            self.start_front()
            return
        tree = next(t for t in self.trees if t.unit is unit)
        if tree.alive:
            unit.restart_at = time.monotonic() + 0.1  # the killed processes have not exited yet
            return
        unit.state, unit.started_at = UnitState.RUNNING, time.monotonic()
        tree.root.restarts += 1
        self.start_tree(tree)

    def request_restart(self, role: str | None, dp: int | None, replica: int | None = None,
                        rolling: bool = False, now: bool = False) -> list[str]:
        """`vsup restart --role R`: each tree (of --replica) that has an R, counted under R, the way a crash
        would (the front: itself alone, after it drained). `--rolling`: every tree in turn, each drained
        first and none before the last is serving again."""
        trees = [t for t in self.trees if replica is None or (t.r or 0) == replica]
        if rolling:
            if self.rolling or not trees or \
                    any(t.state != TreeState.SERVING or t.unit.state != UnitState.RUNNING for t in trees):
                return []
            self.rolling.extend(trees)
            self._roll_next()
            return [str(t.unit.id) for t in trees]
        if role == FRONT:
            if self.units[FRONT_UNIT].state != UnitState.RUNNING or not self.front.alive:
                return []
            self.units[FRONT_UNIT].requested = True
            self.front.signal(signal.SIGTERM)
            return [FRONT]
        restarted = []
        for tree in trees:
            victims = [p for p in self._current() if p["unit"] == str(tree.unit.id) and p["role"] == role and
                       (dp is None or p.get("dp") == dp) and p["pid"]]
            if not victims or tree.unit.state != UnitState.RUNNING or tree.cause is not None:
                continue
            tree.unit.requested = True
            victim = tree.root if victims[0]["pid"] == tree.root.pid else tree.procs[victims[0]["pid"]]
            self.end_tree(tree, f"vsup restart --role {role}", victim)
            restarted.append(str(tree.unit.id))
        return restarted

    def _roll_next(self) -> None:
        """Drain the next tree of a rolling restart: the front sends it nothing new, and vLLM finishes what
        it has (--shutdown-timeout) and exits; it restarts at once."""
        if not self.rolling:
            self.log("rolling restart done")
            return
        tree = self.rolling[0]
        if tree.state != TreeState.SERVING or tree.cause is not None:  # it died meanwhile: its own restart stands in
            return
        tree.unit.requested = True
        tree.draining_until = time.monotonic() + self.options.drain_timeout + self.options.stop_timeout
        self.log("rolling restart: draining", process=str(tree.unit.id))
        self.tell_front()
        tree.root.signal(signal.SIGTERM)
        self.save()

    # stopping

    def shutdown(self) -> None:
        """SIGTERM to the front (it stops taking requests and finishes those it has) and to each vllm serve
        (it drains through --shutdown-timeout), then SIGKILL what is left."""
        notify.sd_notify("STOPPING=1")
        self.release_port()
        self.tell_front()
        self.save()
        self.front.signal(signal.SIGTERM)
        for tree in self.trees:
            tree.root.signal(signal.SIGTERM)
        drain = self.options.drain_timeout + self.options.stop_timeout
        self._wait(lambda: any(t.root.alive for t in self.trees), drain)
        self._wait(lambda: any(t.alive for t in self.trees), self.options.stop_timeout)
        self._wait(lambda: self.front.alive, self.options.stop_timeout)
        left = [FRONT] if self.front.alive else []
        for tree in self.trees:
            left += [tree.root.spec.name] if tree.root.alive else []
            left += [p.name or f"pid {p.pid}" for p in tree.procs.values() if p.alive]
        if left:
            self.log("killed with SIGKILL after --stop-timeout", "warning", processes=left)
            if self.exit_code == 0 and self.state == DeploymentState.STOPPING:
                self.exit_code = 1
                self.message = f"stop needed SIGKILL for {', '.join(left)} (--stop-timeout " \
                               f"{self.options.stop_timeout:g} s)"
        for tree in self.trees:
            self._kill_tree(tree)
        self.front.signal(signal.SIGKILL)
        while any(t.alive for t in self.trees) or self.front.alive:
            self.tick(timeout=0.1)
        self.probe_stop.set()
        self.cleanup()
        if self.state == DeploymentState.STOPPING:
            self.state = DeploymentState.STOPPED
        self.save()

    def _wait(self, busy, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while busy() and time.monotonic() < deadline:
            self.tick(timeout=0.1)

    def cleanup(self) -> None:
        for tree in self.trees:
            removed = shm_sweep.sweep(tree.dir)
            if removed:
                self.log("removed what the tree left in /dev/shm", "warning", entries=removed)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tree.dir / REAP_LOG)
        self.hook_sock.close()
        super().cleanup()

    # state

    def _current(self) -> list[dict]:
        """The plan's processes, each with the live process now holding its name; then any vLLM started
        beyond the plan."""
        by_name: dict[str, tuple[Tree, object]] = {}
        extra = []
        for tree in self.trees:
            if tree.root.alive:
                by_name[tree.root.spec.name] = (tree, tree.root)
            for proc in tree.procs.values():
                if not proc.alive:
                    continue
                if proc.name and proc.name not in by_name:
                    by_name[proc.name] = (tree, proc)
                else:
                    extra.append((tree, proc))
        front = self.front.to_json()
        if self.front.alive:
            front["state"] = ProcessState.STOPPING if self.stopping else ProcessState.READY
        rows = [front]
        trees = {t.r: t for t in self.trees}
        for spec in self.plan.processes:
            if spec.role == FRONT:
                continue
            _, live = by_name.get(spec.name, (None, None))
            rows.append(self._row(trees[spec.r], spec.name, spec.role, spec.device, spec.title, live,
                                  {"a": spec.a, "dp": spec.dp, "pp": spec.pp, "tp": spec.tp}))
        for tree, proc in extra:
            rows.append(self._row(tree, proc.name or f"pid {proc.pid}", proc.role, None, proc.title, proc,
                                  proc.ranks))
        return rows

    def _row(self, tree: Tree, name, role, device, title, live, ranks) -> dict:
        history = self.history.get(name, {"restarts": 0, "last_exit": None})
        if live is None:
            state = {UnitState.BACKOFF: ProcessState.BACKOFF, UnitState.FAILED: ProcessState.FAILED}.get(
                tree.unit.state, ProcessState.STOPPED if self.stopping else ProcessState.STARTING)
        elif self.stopping or tree.draining_until is not None:
            state = ProcessState.STOPPING
        else:
            state = ProcessState.READY if tree.state == TreeState.SERVING else ProcessState.STARTING
        is_root = live is tree.root
        pid = live.pid if live is not None else None
        shown = (procfs.cmdline(pid) if is_root else live.title) if live is not None else None
        return {"name": name, "role": role, **({"r": tree.r} if tree.r is not None else {}), "a": ranks.get("a"),
                "dp": ranks.get("dp"), "pp": ranks.get("pp"), "tp": ranks.get("tp"), "node": 0, "device": device,
                "title": shown or title, "unit": str(tree.unit.id), "pid": pid, "state": state,
                "restarts": history["restarts"], "last_exit": history["last_exit"],
                "started_at": (live.started_at if live is not None else None)}

    def snapshot(self) -> dict:
        state = super().snapshot()
        state["supervisor"]["engine"] = "vllm"
        front = self.units[FRONT_UNIT]
        state["units"] = {**{str(t.unit.id): {"state": t.unit.state, "restarts": t.unit.restart.total,
                                              "by_role": dict(t.by_role)} for t in self.trees},
                          FRONT: {"state": front.state, "restarts": front.restart.total}}
        state["processes"] = self._current()
        state["remote"] = []
        return state
