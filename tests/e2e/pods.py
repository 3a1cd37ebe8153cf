"""A LeaderWorkerSet group simulated without a cluster: each pod of `vsup plan --k8s`'s YAML is a network
namespace of its own on one bridge (tests/e2e/netns.py), running its container's exact command with the
variables LWS's webhook would inject and the Secret's keys in its environment, and a kubelet that polls each
pod's probes as the manifest says (only the polling: it restarts nothing, the test plays LWS).

What is simulated and what is not: the pods' network, their commands, env and probes are the manifest's;
the image is this checkout's venv (`vsup` on PATH), the leader's DNS name is its address, and each pod's
file system is a VSUP_HOME of its own (/dev/shm is shared, as on one node).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import yaml

from tests.e2e.netns import Lan

BIN = str(Path(sys.executable).parent)


@dataclass
class Pod:
    index: int
    container: dict
    home: str
    proc: subprocess.Popen | None = None
    seen: list = field(default_factory=list)  # (time, live status, ready status, ready body) as the kubelet saw


class Group:
    """The pods of one LeaderWorkerSet group (or the one pod of a Deployment) of `docs`, on `lan`."""

    def __init__(self, docs: list[dict], lan: Lan, homes: Path, secret: dict[str, str]):
        work = next(d for d in docs if d["kind"] in ("Deployment", "LeaderWorkerSet"))
        if work["kind"] == "Deployment":
            templates, self.size = [work["spec"]["template"]], 1
        else:
            lwt = work["spec"]["leaderWorkerTemplate"]
            self.size = lwt["size"]
            templates = [lwt["leaderTemplate"]] + [lwt["workerTemplate"]] * (self.size - 1)
        self.lan, self.secret, self.name = lan, secret, work["metadata"]["name"]
        self.pods = [Pod(i, t["spec"]["containers"][0], str(homes / f"pod{i}")) for i, t in enumerate(templates)]
        self.grace_s = templates[0]["spec"]["terminationGracePeriodSeconds"]
        self.stopping = threading.Event()
        self.kubelet = threading.Thread(target=self._poll, daemon=True)

    def env(self, pod: Pod) -> dict:
        """What the container's process gets: its env (the Secret's keys resolved) and LWS's variables."""
        env = {k: v for k, v in os.environ.items() if not k.startswith(("VSUP_", "LWS_"))}
        env |= {"PATH": f"{BIN}:{env['PATH']}", "VSUP_HOME": pod.home}
        for var in pod.container.get("env", []):
            env[var["name"]] = self.secret[var["valueFrom"]["secretKeyRef"]["key"]]
        if self.size > 1:
            env |= {"LWS_WORKER_INDEX": str(pod.index), "LWS_GROUP_SIZE": str(self.size),
                    "LWS_LEADER_ADDRESS": self.lan.address(0)}
        return env

    def start(self) -> Group:
        for pod in self.pods:
            os.makedirs(pod.home, exist_ok=True)
            pod.proc = subprocess.Popen([*self.lan.exec(pod.index), *pod.container["command"]], env=self.env(pod),
                                        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        if not self.kubelet.is_alive():
            self.kubelet.start()
        return self

    def url(self, pod: int, port: str) -> str:
        number = next(p["containerPort"] for p in self.pods[pod].container["ports"] if p["name"] == port)
        return f"http://{self.lan.address(pod)}:{number}"

    def probe(self, pod: Pod, kind: str) -> tuple[int | None, str]:
        probe = pod.container[kind]["httpGet"]
        try:
            reply = httpx.get(self.url(pod.index, probe["port"]) + probe["path"],
                              timeout=pod.container[kind]["timeoutSeconds"])
            return reply.status_code, reply.text.strip()
        except httpx.HTTPError:
            return None, "no answer"

    def _poll(self) -> None:
        """Every second, each pod's liveness and readiness, as the kubelet would (the manifest's paths)."""
        while not self.stopping.wait(1.0):
            for pod in self.pods:
                if pod.proc is not None and pod.proc.poll() is None:
                    live, _ = self.probe(pod, "livenessProbe")
                    ready, why = self.probe(pod, "readinessProbe")
                    pod.seen.append((time.monotonic(), live, ready, why))

    def ready(self, pod: int) -> bool:
        seen = self.pods[pod].seen
        return bool(seen) and seen[-1][2] == 200

    def vsup(self, pod: int, *args: str) -> subprocess.CompletedProcess:
        """A `vsup` command inside the pod (kubectl exec): its VSUP_HOME, its deployment's name."""
        name = self.pods[pod].container["command"]
        name = name[name.index("--name") + 1] if "--name" in name else "default"
        return subprocess.run([f"{BIN}/vsup", *args, "--name", name], capture_output=True, text=True, timeout=60,
                              env=self.env(self.pods[pod]))

    def terminate(self, pods: list[int] | None = None) -> list[tuple[int, float]]:
        """What the kubelet does to a deleted pod: SIGTERM, SIGKILL after the grace period; (exit, seconds)."""
        chosen = [self.pods[i] for i in (pods if pods is not None else range(len(self.pods)))]
        started = time.monotonic()
        for pod in chosen:
            if pod.proc.poll() is None:
                pod.proc.send_signal(signal.SIGTERM)
        out = []
        for pod in chosen:
            try:
                pod.proc.wait(timeout=max(0.0, self.grace_s - (time.monotonic() - started)))
            except subprocess.TimeoutExpired:
                pod.proc.kill()
                pod.proc.wait()
            out.append((pod.proc.returncode, time.monotonic() - started))
        return out

    def close(self) -> None:
        self.stopping.set()
        for pod in self.pods:
            if pod.proc is not None and pod.proc.poll() is None:
                pod.proc.kill()
                pod.proc.wait()


def manifests(*flags: str) -> list[dict]:
    result = subprocess.run([sys.executable, "-m", "vsup", "plan", "--k8s", *flags], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, result.stderr
    return list(yaml.safe_load_all(result.stdout))
