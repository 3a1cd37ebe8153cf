"""A stock vLLM behind the supervisor: one `vllm serve` started per replica, its whole tree watched, and
vsup's front before them.

vLLM starts the rest of its tree itself. The start-up hook (vsup/vllm/hook)
introduces every process of it on the hook socket, so the supervisor holds a
pidfd of each and tags its lines by the connection they came on. vLLM cannot
lose one part and go on, so the restart unit is the whole tree: the first death
(or /health failing, or requests waiting with no token coming out) ends what is
left, sweeps what it left in /dev/shm, and starts the tree again with vsup's
backoff and start limit. The supervisor is a child subreaper, so a process of
the tree whose parent died is re-parented to it, never to init. vLLM exits 0
after an engine death (its issue #48966): any exit that vsup did not ask for
is a failure.

Before the trees, vsup's front (vsup/front) holds the public port; the
supervisor tells it on its stdin when a tree goes down and when the next is
up, so that it can hold and resume the requests of the dead one. The front
is a unit of its own: it restarts alone.

With `--replicas N` there are N trees (vllm_replica.py), each a unit of its own:
a death ends and restarts its tree only, while the front sends that tree's
requests on to the others. `vsup restart --rolling` drains and restarts them one
at a time.

Across nodes (`--nnodes`) each node's vsup runs its part of the one tree: the head
its `vllm serve` with the front, every other node its `vllm serve --headless`, with
no front and nothing to ask /health of. The parts follow each other through the
head's --probe-port (group.py): a headless part is ready once the head serves with
it, and restarts when the head's tree went; the head restarts its tree when a
node's part went.
"""

from __future__ import annotations

import contextlib
import ctypes
import itertools
import os
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path

from vsup import addresses, procfs, shm_sweep, unix_http
from vsup.exits import describe_exit
from vsup.messages import Hello, TreeNews, encode_line
from vsup.supervisor import flight_recorder
from vsup.supervisor import lifecycle as lc
from vsup.supervisor.child import Child
from vsup.supervisor.control import listen_unix
from vsup.supervisor.group import FOLLOWS, Head, Members, Part, Report, read_report
from vsup.supervisor.lifecycle import How, Limits, Note, Phase
from vsup.supervisor.log_format import now_iso
from vsup.supervisor.states import ProcessState
from vsup.supervisor.units import UnitId
from vsup.supervisor.vllm_replica import REAP_LOG, Observed, Tree
from vsup.topology import FRONT, Plan
from vsup.vllm import names
from vsup.vllm.plan import tree_roots
from vsup.vllm.progress import Progress, parse_metrics

PR_SET_CHILD_SUBREAPER = 36
FRONT_FATES = {"resuming a request on a new tree": "resumed by the front on the next tree",  # its lines, its fates
               "gave up on a request that the engine died under every time": "failed: the engine died under it "
                                                                              "every time (--max-resumes)"}
ATTRIBUTION_DELAY_S = 0.3
HOOK_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "vllm", "hook")


@dataclass
class VllmOptions:
    health_timeout: float = 30.0
    hang_timeout: float = 120.0


class VllmUnits:
    """The adapter of a stock vLLM (supervisor.py says what an adapter does)."""

    engine = "vllm"

    def __init__(self, sup, plan: Plan, vllm: VllmOptions):
        self.sup, self.plan, self.vllm = sup, plan, vllm
        self.node, self.headless = plan.config.node_rank, plan.config.headless
        self.front_id = UnitId.front()
        self.front = None if self.headless else Child(next(p for p in plan.processes if p.role == FRONT),
                                                      self.front_id)
        self.trees: list[Tree] = []
        for spec in tree_roots(plan):
            root = Child(spec, UnitId.vllm_tree(spec.r))
            tree_dir = Path(addresses.replica_dir(str(sup.run_dir.path), spec.r))
            tree_dir.mkdir(mode=0o700, exist_ok=True)
            self.trees.append(Tree(spec.r, root, root.unit, addresses.vllm_socket(str(sup.run_dir.path), spec.r),
                                   tree_dir, plan, self.node))
        # across nodes (group.py): the head's view of the other nodes' parts, and what it answers them (read
        # by the probes' thread); a headless node's view of its head
        self.members, self.head_answer, self.reports = Members(), Head(0, False), {}
        self.part, self.last_head, self.refused = Part(), None, False
        self.by_id = {t.id: t for t in self.trees}
        self.gens = itertools.count(1)  # every tree started gets the next: the front resumes on another one
        self.front_w: int | None = None
        self.tree_of: dict[int, Tree] = {}  # pid -> its tree
        self.history: dict[str, dict] = {p.name: {"restarts": 0, "last_exit": None} for p in plan.processes}
        # a traceback's or warning's next lines keep its level: the log router's own (tag() runs on its thread)
        self.last_level: dict[tuple[int, str], str] = {}
        self.rolling: deque[Tree] = deque()  # `vsup restart --rolling`: the trees still to drain and restart
        self.loads: dict[str, dict] = {}
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
        self.hook_path = str(sup.run_dir.path / "hook.sock")
        self.hook_sock = listen_unix(self.hook_path, backlog=64)
        sup.router.listen(self.hook_sock, self.on_hello, self.tag)
        self.janitor = subprocess.Popen(
            [sys.executable, "-m", "vsup.supervisor.janitor", str(sup.run_dir.path), str(os.getpid())],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, close_fds=True)
        self.probe_stop = threading.Event()
        self.front_said: deque[tuple[float, dict]] = deque(maxlen=4096)  # what the front did with requests, when
        sup.router.sinks.append(self._front_requests)

    def units(self) -> dict[UnitId, Limits]:
        o = self.sup.options
        front = {} if self.front is None else {self.front_id: Limits(o.restart_policy, o.drain_timeout,
                                                                     o.stop_timeout)}
        return {**front, **{t.id: Limits(o.restart_policy, o.drain_timeout, o.stop_timeout,
                                         startup_s=o.startup_timeout) for t in self.trees}}

    def formula(self) -> str:
        return self.plan.formula

    def remote(self) -> list[dict]:
        """The other nodes' processes, each `remote: up` or `down` as its node last reported its part."""
        def state(node: int) -> str | None:
            report = self.reports.get(node)
            return None if report is None else f"remote: {'up' if report.up else 'down'}"
        return [{**p.to_json(), "state": state(p.node)} for p in self.plan.processes if p.node != self.node]

    def unit_extra(self, unit: UnitId) -> dict:
        return {"by_role": dict(self.by_id[unit].by_role)} if unit in self.by_id else {}

    def phase(self, tree: Tree) -> Phase:
        return self.sup.lives[tree.id].phase

    def up(self, tree: Tree) -> bool:
        """Whether the front may send it requests."""
        return self.phase(tree) == Phase.READY and tree.first_death is None

    # who is who (on the router's thread)

    def on_hello(self, hello: Hello) -> None:
        """A process of a tree connected (the hello names its replica): the loop introduces it."""
        self.sup.loop.post(("hello", hello))

    def tag(self, line: str, stream: str, hello: Hello) -> dict:
        """The record of one line from the connection that `hello` opened. It reads the trees and stores
        nothing but the level that a traceback's next lines keep (the router's own); a process named here
        by vLLM's log prefix before the loop knows its name is told to the loop."""
        parsed = names.parse_line(line)
        tree = self.trees[hello.replica] if 0 <= hello.replica < len(self.trees) else self.trees[0]
        writer = parsed.prefix_pid if tree.owns(parsed.prefix_pid) else hello.pid
        who = tree.who(writer, parsed.prefix_name)
        proc = tree.procs.get(writer)
        if proc is not None and proc.name is None and parsed.prefix_name:
            self.sup.loop.post(("prefix", tree, writer, parsed.prefix_name))
        if tree.r is None:
            del who["r"]
        key = (hello.pid, stream)
        level = parsed.level or (self.last_level.get(key) if names.continues(line) else None) or \
            ("error" if stream == "stderr" else "info")
        self.last_level[key] = level
        record = {"ts": now_iso(), "level": level, **who, "stream": stream, "event": parsed.message}
        if parsed.prefix_name:
            record["vllm"] = parsed.prefix_name
        if parsed.source:
            record["source"] = parsed.source
        return record

    # on the loop's thread

    def on_item(self, item) -> None:
        if item[0] == "hello":
            self.introduce(item[1])
        elif item[0] == "group":
            self.heard_from_node(item[1])
        elif item[0] == "front-request":
            self.front_said.append((time.monotonic(), item[1]))
        elif item[0] == "probe":
            self.on_probe(*item[1:])
        elif item[0] == "prefix":  # (a line's vLLM prefix named a process before its title did)
            _, tree, pid, prefix_name = item
            proc = tree.procs.get(pid)
            if proc is not None and proc.name is None and (role := names.role_of_name(prefix_name)) is not None:
                tree.name(proc, role)

    def introduce(self, hello: Hello) -> None:
        pid = hello.pid
        if not 0 <= hello.replica < len(self.trees):
            return
        tree = self.tree_of[pid] = self.trees[hello.replica]
        if tree.owns(pid):
            return
        try:
            pidfd = os.pidfd_open(pid)
        except OSError:
            return  # already gone
        proc = tree.procs[pid] = Observed(pid, hello.ppid, pidfd)
        self.sup.loop.watch(pidfd, lambda: self.exited(tree, proc))
        tree.resolve(proc)
        self.sup.post(tree.id, lc.Started(pid))

    # starting

    def before_start(self) -> None:
        if not self.headless:  # (a headless part serves nothing to ask: it hears of its head instead)
            threading.Thread(target=self._probe_loop, name="vllm-probe", daemon=True).start()
        # what an earlier run of this deployment left, if its janitor was killed with it (systemd ends a
        # unit's whole cgroup); no other run uses it, as this one holds the deployment's lock
        removed = shm_sweep.sweep_deployment(self.sup.run_dir.path)
        if removed:
            self.sup.log("removed what an earlier run left in /dev/shm", "warning", entries=removed)

    def startup_timeout(self) -> None:
        return None  # each tree has its own

    def late(self, running_only: bool = False) -> list[str]:
        return []

    def spawn(self, unit: UnitId) -> None:
        if unit == self.front_id:
            self.start_front()
            self.sup.post(unit, lc.Started(self.front.pid))
            self.sup.post(unit, lc.Ready())  # it serves the held port from its start
        else:
            tree = self.by_id[unit]
            self.sweep(tree)  # what its last tree left
            self.start_tree(tree)
            self.sup.post(unit, lc.Started(tree.root.pid))

    def start_tree(self, tree: Tree) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tree.socket)  # (its last tree's: vLLM binds the path anew)
        tmp = shm_sweep.make_tmp_dir(tree.dir)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tree.dir / REAP_LOG)  # its last tree's pids
        env = {**os.environ, **(self.sup.options.env or {}), "VSUP_SUPERVISOR_PID": str(os.getpid()),
               "VSUP_HOOK_SOCKET": self.hook_path, "VSUP_HOOK_PARENT": str(os.getpid()),
               "VSUP_HOOK_REPLICA": str(tree.r or 0),
               "VSUP_HOOK_SHM_LOG": str(tree.dir / shm_sweep.LIST), "VSUP_HOOK_REAP_LOG": str(tree.dir / REAP_LOG),
               "TMPDIR": str(tmp), "PYTHONFAULTHANDLER": "1",
               "PYTHONPATH": os.pathsep.join([HOOK_DIR, *filter(None, [os.environ.get("PYTHONPATH")])])}
        env.update(flight_recorder.env(self.sup.run_dir.path, self.plan.config.device, env))
        # the root's own fds 1 and 2 are replaced by the hook's connections; these pipes catch what comes before
        for pid in [pid for pid, owner in list(self.tree_of.items()) if owner is tree]:  # its last tree's
            self.tree_of.pop(pid, None)
        root = tree.root
        out, err = root.spawn(env)
        self.tree_of[root.pid] = tree
        tag = {"name": root.spec.name, "role": root.spec.role, **({"r": tree.r} if tree.r is not None else {}),
               "a": root.spec.a, "dp": None, "pp": None, "tp": None, "pid": root.pid}
        self.sup.router.add(out, "stdout", tag)
        self.sup.router.add(err, "stderr", tag)
        self.sup.loop.watch(root.pidfd, lambda: self.exited(tree, root))
        tree.started_at, tree.gen = time.monotonic(), next(self.gens)
        tree.progress, tree.procs, tree.first_death, tree.deferred, tree.blame = None, {}, None, [], None
        tree.cause, tree.died_at = None, None
        self.sup.log("started", process=root.spec.name, pid=root.pid, argv=" ".join(root.spec.argv))
        if self.headless:
            self.part = Part.starting(self.last_head)
        self.tell_front()

    def start_front(self) -> None:
        r, w = os.pipe()
        sock = self.sup.options.port_socket
        port = () if sock is None or sock.fileno() < 0 else (sock.fileno(),)
        self.front.extra_argv = ["--listen-fd", str(port[0])] if port else []
        try:
            out, err = self.front.spawn({**os.environ, **(self.sup.options.env or {}), "PYTHONUNBUFFERED": "1"},
                                        stdin=r, pass_fds=port)
        finally:
            os.close(r)
        os.set_blocking(w, False)
        self.front_w = w
        tag = {"name": FRONT, "role": FRONT, "a": None, "dp": None, "pp": None, "tp": None, "pid": self.front.pid}
        self.sup.router.add(out, "stdout", tag)
        self.sup.router.add(err, "stderr", tag)
        self.sup.loop.watch(self.front.pidfd, lambda: self.front_exited())
        self.sup.log("started", process=FRONT, pid=self.front.pid)
        self.tell_front()

    def tell_front(self) -> None:
        """Say to the front what each tree is now: its gen, whether it takes requests, whether vsup is
        stopping; and the restarts so far, by role. Across nodes, what the head answers the other nodes,
        or what this node reports to its head."""
        self.tell_group()
        if self.front_w is None:
            return
        restarts: dict[str, int] = {}
        for tree in self.trees:
            for role, n in tree.by_role.items():
                restarts[role] = restarts.get(role, 0) + n
        news = [encode_line(TreeNews(tree.r or 0, tree.gen, self.up(tree), self.sup.stopping, restarts,
                                     dict(self.sup.incidents.counts)))
                for tree in self.trees]
        try:
            os.write(self.front_w, b"".join(news))
        except (BlockingIOError, BrokenPipeError):
            pass  # (a front that does not read is dead, and restarts)

    # across nodes (group.py)

    def tell_group(self) -> None:
        tree = self.trees[0]
        if self.headless and self.sup.head_watch is not None:
            live = self.phase(tree) in (Phase.STARTING, Phase.READY) and tree.first_death is None
            report = Report(self.node, tree.gen, live and not self.sup.stopping)
            if report != self.sup.head_watch.report:
                self.sup.head_watch.report = report
                if not report.up:
                    self.sup.head_watch.poke()  # the head hears of it at once
        elif self.plan.config.nnodes > 1:
            self.head_answer = Head(tree.gen, self.up(tree))

    def evidence(self, unit: UnitId) -> dict:
        """For an incident: the role whose process took the unit down, that process (name, pid, exit, the
        signal vsup sent it) when one ended, and the unit's processes."""
        if unit == self.front_id:
            f = self.front
            return {"role": FRONT, "death": (FRONT, f.pid, f.last_exit, f.sent, f.peak_rss),
                    "members": [{"process": FRONT, "pid": f.pid, "alive": f.alive}]}
        tree = self.by_id[unit]
        cause = tree.cause if self.sup.lives[unit].culprit is not None else None
        death = None if cause is None else (tree.name_of(cause), cause.pid, cause.last_exit,
                                            getattr(cause, "sent", None), getattr(cause, "peak_rss", None))
        procs = [tree.root, *tree.procs.values()]
        return {"role": (tree.blame or (None, tree.root.spec.role))[1], "death": death,
                "members": [{"process": tree.name_of(p), "pid": p.pid, "alive": p.alive} for p in procs],
                "since": tree.root.started_at or 0.0, "died_at": tree.died_at}

    def _front_requests(self, records: list[dict]) -> None:
        """On the router's thread: the front's lines on what it did with a request a tree died under."""
        for record in records:
            if record.get("name") == FRONT and record.get("event") in FRONT_FATES:
                self.sup.loop.post(("front-request", record))

    def requests_after(self, unit: UnitId, since: float, until: float) -> list[dict]:
        """The requests the front resumed on the next tree, or gave up on, between `since` and `until`: id,
        tokens already streamed, what became of it."""
        if unit == self.front_id:
            return []
        return [{"id": r.get("request"), "tokens": r.get("tokens", 0), "fate": FRONT_FATES[r["event"]]}
                for t, r in self.front_said if since <= t < until]

    def live(self) -> dict[str, int]:
        """Every running process of this node, by name."""
        found = {FRONT: self.front.pid} if self.front is not None and self.front.alive else {}
        for tree in self.trees:
            found.update({tree.name_of(p): p.pid for p in (tree.root, *tree.procs.values()) if p.alive})
        return found

    def group_desk(self):
        """What answers the other nodes' reports on the head's --probe-port (on the probes' thread)."""
        if self.headless or self.plan.config.nnodes == 1 or not self.sup.options.group_secret:
            return None

        def answer(query: dict[str, str]) -> tuple[int, str]:
            import json

            report = read_report(query, self.sup.options.group_secret, time.time())
            if report is None:
                return 403, "not a report signed with this group's --cluster-secret in the last minute\n"
            self.sup.loop.post(("group", report))
            head = self.head_answer
            return 200, json.dumps({"gen": head.gen, "up": head.up}) + "\n"
        return answer

    def heard_from_node(self, report: Report) -> None:
        """The head: a node's report of its part; the head's tree restarts when the group is broken."""
        tree = self.trees[0]
        self.reports[report.node] = report
        why = self.members.heard(Head(tree.gen, self.up(tree)), report)
        if why and not self.sup.stopping:
            tree.blame = None  # (the death was on that node: counted there)
            self.sup.post(tree.id, lc.HealthFailed(why))

    def on_head(self, reply: dict) -> None:
        """A headless node: the head's answer to this node's report; the part is ready once it is in the
        head's serving tree, and restarts when that tree went."""
        if "refused" in reply:
            if not self.refused:
                self.sup.log("the head refuses this node's reports: is --cluster-secret the same on every node?",
                             "error", status=reply["refused"])
            self.refused = True
            return
        try:
            head = self.last_head = Head(int(reply["gen"]), bool(reply["up"]))
        except (KeyError, TypeError, ValueError):
            return
        self.refused = False
        tree = self.trees[0]
        if self.phase(tree) not in (Phase.STARTING, Phase.READY) or tree.first_death is not None:
            return
        why = self.part.heard(head)
        if why == "joined":
            self.sup.post(tree.id, lc.HealthOk())
        elif why:
            tree.blame = None  # (the death was on the head: counted there)
            self.sup.post(tree.id, lc.HealthFailed(why))

    # health and progress

    def _probe_loop(self) -> None:
        """On a thread of its own: each tree's /health every second (every 0.2 s while one starts: the front
        waits on it); vLLM's /metrics, which costs its API server more to render, only as often as
        --hang-timeout needs. It posts what it found, and reads nothing of the supervisor's but whether
        each tree serves."""
        scraped = {id(t): 0.0 for t in self.trees}
        while not self.probe_stop.wait(1.0 if all(self.up(t) for t in self.trees) else 0.2):
            for tree in self.trees:
                asked = time.monotonic()
                healthy = self._get(tree, "/health") is not None
                scrape = healthy and self.up(tree) and asked - scraped[id(tree)] >= min(5.0, self.vllm.hang_timeout / 8)
                text = self._get(tree, "/metrics") if scrape else None
                scraped[id(tree)] = asked if scrape else scraped[id(tree)]
                self.sup.loop.post(("probe", tree, asked, healthy, parse_metrics(text) if text else None))

    @staticmethod
    def _get(tree: Tree, route: str) -> str | None:
        try:
            status, body = unix_http.get(tree.socket, route, timeout=3.0)
        except OSError:
            return None
        return body if status == 200 else None

    def on_probe(self, tree: Tree, asked: float, healthy: bool, metrics) -> None:
        """One probe's answers (asked at `asked`); a probe asked before this tree started says nothing of it."""
        phase = self.phase(tree)
        if phase not in lc.LIVE or tree.first_death is not None or self.sup.stopping or asked < tree.started_at:
            return
        for proc in tree.procs.values():
            tree.resolve(proc)
        if phase == Phase.STARTING:
            if healthy:
                tree.progress = Progress(self.vllm.health_timeout, self.vllm.hang_timeout, asked)
                self.sup.post(tree.id, lc.HealthOk())
            return
        self.remember_shm(tree)
        self.reap_adopted()
        why = tree.progress.update(asked, healthy, metrics)
        if why:
            tree.blame = (tree.root.spec.name, tree.root.spec.role)
            self.sup.post(tree.id, lc.Stalled(why) if why.startswith("hung") else lc.HealthFailed(why))

    def remember_shm(self, tree: Tree) -> None:
        """Note the /dev/shm entries the tree has mapped now (each once), to remove them when it is gone."""
        pids = [tree.root.pid, *(p.pid for p in tree.procs.values() if p.alive)]
        new = set().union(*(procfs.mapped_shm(pid) for pid in pids if pid)) - tree.shm_noted
        shm_sweep.record(tree.dir, new)
        tree.shm_noted |= new

    # deaths

    def front_exited(self) -> None:
        if self.front.pidfd is None or not self.front.ended():
            return
        self.sup.loop.forget(self.front.pidfd)
        self.front.reap()
        os.close(self.front_w)
        self.front_w = None
        pid, exit = self.front.pid, self.front.last_exit
        if self.sup.stopping or self.sup.lives[self.front_id].phase not in lc.LIVE:
            self.sup.post(self.front_id, lc.Reaped(pid))
            return
        self.sup.log("process exited", "error", process=FRONT, pid=pid, exit=exit)
        self.sup.post(self.front_id, lc.Exited(pid, FRONT, exit))  # (it never ends by itself: a failure)

    def exited(self, tree: Tree, proc) -> None:
        if isinstance(proc, Child):
            if proc.pidfd is None or not proc.ended():
                return
            self.sup.loop.forget(proc.pidfd)
            proc.reap()
        else:
            if proc.pidfd is None:
                return
            self.sup.loop.forget(proc.pidfd)
            os.close(proc.pidfd)
            proc.pidfd, proc.alive = None, False
            if proc.last_exit in (None, procfs.UNSEEN_EXIT):  # (we may have reaped it already, with its status)
                proc.last_exit = procfs.exit_status(proc.pid)
        self.reap_adopted()
        if proc is tree.root and self.phase(tree) == Phase.ENDING and not self.sup.stopping:
            self.sup.log("vllm tree drained", why=f"{proc.spec.name} {proc.last_exit}", process=proc.spec.name,
                         unit=str(tree.id))
        live = self.phase(tree) in lc.LIVE and not self.sup.stopping
        if not live or isinstance(proc, Observed) and proc.role is None:  # (a subprocess vLLM ran and waited for)
            self.sup.post(tree.id, lc.Reaped(proc.pid))
            return
        tree.deferred.append(proc.pid)
        if tree.first_death is None:
            # the processes that follow it out (PR_SET_PDEATHSIG) die within milliseconds, but a killed
            # parent can still be tearing its threads down when its child's exit is seen: look a moment later
            tree.first_death, tree.died_at = proc, time.monotonic()
            self.tell_front()
            self.sup.loop.at(time.monotonic() + ATTRIBUTION_DELAY_S, lambda: self.attribute(tree))

    def attribute(self, tree: Tree) -> None:
        """The first death, a moment on: find the process whose end ended the tree; its lifecycle ends the
        rest."""
        proc, tree.first_death = tree.first_death, None
        deferred, tree.deferred = tree.deferred, []
        if proc is None or self.phase(tree) not in lc.LIVE or self.sup.stopping:
            for pid in deferred:
                self.sup.post(tree.id, lc.Reaped(pid))
            return
        tree.learn_reaped()
        cause = tree.first_to_die(proc)
        name = tree.name_of(cause)
        if isinstance(cause, Observed) and cause.role == names.HELPER:
            self.sup.log("helper exited", "warning", process=name, pid=cause.pid, exit=cause.last_exit)
            for pid in deferred:
                self.sup.post(tree.id, lc.Reaped(pid))
            self.tell_front()  # the tree is still up
            return
        for dead in {id(proc): proc, id(cause): cause}.values():
            if dead.last_exit is not None:
                self.history.setdefault(tree.name_of(dead), {"restarts": 0})["last_exit"] = dead.last_exit
        exit = cause.last_exit or f"stopped {tree.name_of(proc)} ({proc.last_exit})"  # (it told it to: it is the cause)
        tree.blame = (name, cause.spec.role if isinstance(cause, Child) else cause.role)
        tree.cause = cause
        # (a cause still running, which stopped the first to die, ends later; one not running any more whose
        # end was not seen yet is reaped later: either way the first death's pid stands for it)
        pid = cause.pid if cause.pid in self.sup.lives[tree.id].running else proc.pid
        self.sup.post(tree.id, lc.Exited(pid, name, exit))
        for pid in deferred:
            self.sup.post(tree.id, lc.Reaped(pid))

    def reap_adopted(self) -> None:
        """Reap the trees' processes that were re-parented to us (a subreaper) and have exited."""
        import psutil

        ours = {self.front.pid if self.front else None, self.janitor.pid, *(t.root.pid for t in self.trees)}
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

    # actions

    def signal(self, unit: UnitId) -> None:
        """SIGTERM: the front finishes what it holds; `vllm serve` drains through its --shutdown-timeout and
        stops the rest of its tree."""
        (self.front if unit == self.front_id else self.by_id[unit].root).signal(signal.SIGTERM)

    def kill(self, unit: UnitId) -> list[str]:
        if unit == self.front_id:
            return [FRONT] if self.front.signal(signal.SIGKILL) else []
        tree = self.by_id[unit]
        killed = []
        if tree.root.alive:
            killed.append(tree.root.spec.name)
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(tree.root.pid, signal.SIGKILL)
        for proc in tree.procs.values():
            if proc.alive and proc.pidfd is not None:  # by pidfd: never a stranger who got the number
                with contextlib.suppress(ProcessLookupError):
                    signal.pidfd_send_signal(proc.pidfd, signal.SIGKILL)
                    proc.sent = "SIGKILL"
                    killed.append(proc.name or f"pid {proc.pid}")
        return killed

    def notify(self, unit: UnitId, note: Note) -> None:
        if unit == self.front_id:
            return
        tree = self.by_id[unit]
        life = self.sup.lives[unit]
        if note == Note.UP:
            with contextlib.suppress(OSError):
                os.chmod(tree.socket, 0o600)  # (vLLM binds it under the umask; the run dir is 0700 anyway)
            self.sup.log("ready", process=tree.root.spec.name, pid=tree.root.pid,
                         seconds=round(time.monotonic() - tree.started_at, 1))
            self.remember_shm(tree)
            if self.rolling and self.rolling[0] is tree:
                self.rolling.popleft()
                self.roll_next()
        elif note == Note.LOST:
            self.lost(tree, life)
        self.tell_front()

    def lost(self, tree: Tree, life: lc.Life) -> None:
        """The tree goes down: say why, count it by the role whose process took it down (unless it was
        asked for), and note what it holds in /dev/shm before it is gone."""
        if life.phase == Phase.ENDING:
            self.sup.log("rolling restart: draining", process=str(tree.id))
        else:
            name, role = tree.blame or (tree.root.spec.name, tree.root.spec.role)
            asked = life.why == "vsup restart"
            follows = (life.why or "").startswith(FOLLOWS)  # another node's death: counted there
            self.sup.log("vllm tree lost", "warning" if asked or follows else "error", why=life.why,
                         process=name, unit=str(tree.id))
            if not asked and not follows:
                if name in self.history:
                    self.history[name]["restarts"] += 1
                tree.by_role[role or "unknown"] = tree.by_role.get(role or "unknown", 0) + 1
        self.remember_shm(tree)

    def last_words(self, unit: UnitId) -> list[str]:
        if unit == self.front_id:
            return self.sup.router.last_lines(FRONT)
        tree = self.by_id[unit]
        culprit = self.sup.lives[unit].culprit
        return [line for key in dict.fromkeys(filter(None, (culprit, tree.root.spec.name)))
                for line in self.sup.router.last_lines(key)[-8:]]

    # the deployment

    def serving(self, lives: dict, first: bool) -> bool:
        """Serving while any tree serves."""
        return any(lives[t.id].phase == Phase.READY for t in self.trees)

    def restart(self, role: str | None, dp: int | None, replica: int | None, rolling: bool, now: bool) -> list[str]:
        """`vsup restart --role R`: each tree (of --replica) that has an R, counted under R, the way a crash
        would (the front: itself alone, after it drained). `--rolling`: every tree in turn, each drained
        first and none before the last is serving again."""
        trees = [t for t in self.trees if replica is None or (t.r or 0) == replica]
        if rolling:
            if self.rolling or not trees or any(self.phase(t) != Phase.READY for t in trees):
                return []
            self.rolling.extend(trees)
            self.roll_next()
            return [str(t.id) for t in trees]
        if role == FRONT:
            if self.front is None or self.sup.lives[self.front_id].phase not in lc.LIVE:
                return []
            self.sup.post(self.front_id, lc.RestartAsked(How.TERM))
            return [FRONT]
        restarted = []
        for tree in trees:
            victims = [p for p in self.current() if p["unit"] == str(tree.id) and p["role"] == role and
                       (dp is None or p.get("dp") == dp) and p["pid"]]
            if not victims or self.phase(tree) not in lc.LIVE or tree.first_death is not None:
                continue
            if victims[0]["name"] in self.history:
                self.history[victims[0]["name"]]["restarts"] += 1
            tree.by_role[role] = tree.by_role.get(role, 0) + 1
            self.sup.post(tree.id, lc.RestartAsked(How.NOW))
            restarted.append(str(tree.id))
        return restarted

    def roll_next(self) -> None:
        """Drain the next tree of a rolling restart: the front sends it nothing new, and vLLM finishes what
        it has (--shutdown-timeout) and exits; it restarts at once."""
        if not self.rolling:
            self.sup.log("rolling restart done")
            return
        tree = self.rolling[0]
        if self.phase(tree) != Phase.READY:  # it died meanwhile: its own restart stands in
            return
        self.sup.post(tree.id, lc.RestartAsked(How.TERM))

    def stop_order(self) -> list[tuple[list[UnitId], float]]:
        """The front and every `vllm serve` together: each finishes what it holds (--drain-timeout), then
        gets --stop-timeout to exit."""
        o = self.sup.options
        front = [self.front_id] if self.front is not None else []
        return [([*front, *(t.id for t in self.trees)], o.drain_timeout + o.stop_timeout)]

    def before_stop(self) -> None:
        self.tell_front()

    def sweep(self, tree: Tree) -> None:
        removed = shm_sweep.sweep(tree.dir)
        tree.shm_noted = set()
        if removed:
            self.sup.log("removed what the tree left in /dev/shm", "warning", entries=removed)

    def cleanup(self) -> None:
        self.probe_stop.set()
        for tree in self.trees:
            self.sweep(tree)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tree.dir / REAP_LOG)
        self.hook_sock.close()
        self.sup.run_dir.remove_sockets()

    # state

    def rows(self) -> list[dict]:
        return self.current()

    def current(self) -> list[dict]:
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
        rows = [] if self.front is None else [self.front_row()]
        trees = {t.r: t for t in self.trees}
        for spec in self.plan.processes:
            if spec.role == FRONT or spec.node != self.node:
                continue
            _, live = by_name.get(spec.name, (None, None))
            rows.append(self.row(trees[spec.r], spec.name, spec.role, spec.device, spec.title, live,
                                 {"a": spec.a, "dp": spec.dp, "pp": spec.pp, "tp": spec.tp}))
        for tree, proc in extra:
            rows.append(self.row(tree, proc.name or f"pid {proc.pid}", proc.role, None, proc.title, proc, proc.ranks))
        return rows

    def front_row(self) -> dict:
        phase = self.sup.lives[self.front_id].phase
        return self.front.to_json(ProcessState.STOPPING if self.front.alive and self.sup.stopping else
                                  ProcessState.READY if self.front.alive else
                                  ProcessState.FAILED if phase == Phase.FAILED else
                                  ProcessState.BACKOFF if phase == Phase.BACKOFF else ProcessState.STOPPED)

    def row(self, tree: Tree, name, role, device, title, live, ranks) -> dict:
        history = self.history.get(name, {"restarts": 0, "last_exit": None})
        phase = self.phase(tree)
        if live is None:
            state = {Phase.BACKOFF: ProcessState.BACKOFF, Phase.FAILED: ProcessState.FAILED}.get(
                phase, ProcessState.STOPPED if self.sup.stopping else ProcessState.STARTING)
        elif self.sup.stopping or phase == Phase.ENDING:
            state = ProcessState.STOPPING
        else:
            state = ProcessState.READY if phase == Phase.READY else ProcessState.STARTING
        is_root = live is tree.root
        pid = live.pid if live is not None else None
        shown = (procfs.cmdline(pid) if is_root else live.title) if live is not None else None
        return {"name": name, "role": role, **({"r": tree.r} if tree.r is not None else {}), "a": ranks.get("a"),
                "dp": ranks.get("dp"), "pp": ranks.get("pp"), "tp": ranks.get("tp"), "node": self.node,
                "device": device,
                "title": shown or title, "unit": str(tree.id), "pid": pid, "state": state,
                "restarts": history["restarts"], "last_exit": history["last_exit"],
                "started_at": (live.started_at if live is not None else None)}
