"""The Kubernetes manifests of a planned deployment (`vsup plan --k8s`). Pure: a Pod spec's every figure
comes in through `Target`, which vsup/cli/k8s.py makes from the plan and the flags; nothing here reads
the machine it runs on.

One node per group: a Deployment and a Service. More: a LeaderWorkerSet (leaderworkerset.x-k8s.io/v1) of
that many pods per group, and a Service of the leaders. Every container runs `vsup serve` with the plan's
flags (the workers add `--headless`; vsup reads its rank and the leader's address from LWS's variables),
JSON log lines on stdout, the kubelet's probes on `--probe-port`, secrets from a Secret through the
environment. restartPolicy RecreateGroupOnPodRestart: vsup heals what dies inside a pod and exits only when
it gives up, and then the group must be rebuilt.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

PROBE_PORT = 8081
MOUNT = "/models"  # where a --model-pvc or --model-host-path is mounted
LWS_NAME_LABEL = "leaderworkerset.sigs.k8s.io/name"


@dataclass(frozen=True)
class Target:
    """Where and how the planned deployment runs on the cluster: everything a manifest says."""

    name: str                      # the objects' name, a DNS-1035 label
    namespace: str
    image: str
    groups: int                    # Deployment replicas, or LeaderWorkerSet replicas (groups)
    nodes: int                     # pods per group (1: a Deployment)
    serve: tuple[str, ...]         # the leader's `vsup serve ...` argv; the workers add --headless
    port: int                      # the API's (--port)
    probe_port: int = PROBE_PORT
    gpus: int = 0                  # nvidia.com/gpu per pod
    cpus: str = "2"                # CPU per pod (request = limit: a pinned worker wants whole cores)
    memory: str = "4Gi"            # memory per pod
    shm: str = "1Gi"               # /dev/shm, a memory emptyDir
    grace_s: int = 75              # terminationGracePeriodSeconds: the drain and every stop step
    startup_s: int = 600           # the startup probe's budget: --startup-timeout
    secrets: tuple[tuple[str, str], ...] = ()  # (variable, key of the Secret `<name>-secrets`)
    model_pvc: str | None = None
    model_host_path: str | None = None
    ports: tuple[tuple[str, int], ...] = ()    # the leader's ports for the other pods (name, port)
    dashboards: dict = field(default_factory=dict)  # file name -> Grafana dashboard JSON text


def manifests(t: Target) -> list[dict]:
    docs = [service(t), workload(t)]
    if t.dashboards:
        docs.append({"apiVersion": "v1", "kind": "ConfigMap",
                     "metadata": _meta(t, f"{t.name}-dashboards", {"grafana_dashboard": "1"}),
                     "data": dict(sorted(t.dashboards.items()))})
    return docs


def _labels(t: Target) -> dict:
    return {"app.kubernetes.io/name": "vsup", "app.kubernetes.io/instance": t.name}


def _meta(t: Target, name: str, extra: dict | None = None) -> dict:
    return {"name": name, "namespace": t.namespace, "labels": {**_labels(t), **(extra or {})}}


def service(t: Target) -> dict:
    selector = dict(_labels(t))
    if t.nodes > 1:
        selector |= {LWS_NAME_LABEL: t.name, "role": "leader"}
    return {"apiVersion": "v1", "kind": "Service", "metadata": _meta(t, t.name),
            "spec": {"selector": selector,
                     "ports": [{"name": "http", "port": t.port, "targetPort": "http", "protocol": "TCP"}]}}


def workload(t: Target) -> dict:
    if t.nodes == 1:
        return {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": _meta(t, t.name),
                "spec": {"replicas": t.groups, "selector": {"matchLabels": _labels(t)},
                         "template": {"metadata": {"labels": _labels(t), "annotations": _scrape(t)},
                                      "spec": pod(t, leader=True)}}}
    return {"apiVersion": "leaderworkerset.x-k8s.io/v1", "kind": "LeaderWorkerSet", "metadata": _meta(t, t.name),
            "spec": {"replicas": t.groups, "startupPolicy": "LeaderCreated",
                     "leaderWorkerTemplate": {
                         "size": t.nodes, "restartPolicy": "RecreateGroupOnPodRestart",
                         "leaderTemplate": {"metadata": {"labels": {**_labels(t), "role": "leader"},
                                                         "annotations": _scrape(t)},
                                            "spec": pod(t, leader=True)},
                         "workerTemplate": {"metadata": {"labels": {**_labels(t), "role": "worker"}},
                                            "spec": pod(t, leader=False)}}}}


def _scrape(t: Target) -> dict:
    return {"prometheus.io/scrape": "true", "prometheus.io/port": str(t.port), "prometheus.io/path": "/metrics"}


def pod(t: Target, leader: bool) -> dict:
    command = list(t.serve) + ([] if leader else ["--headless"])
    resources = {"cpu": t.cpus, "memory": t.memory, **({"nvidia.com/gpu": t.gpus} if t.gpus else {})}
    ports = [{"name": "probes", "containerPort": t.probe_port, "protocol": "TCP"}]
    if leader:
        ports = [{"name": "http", "containerPort": t.port, "protocol": "TCP"}, *ports,
                 *({"name": name, "containerPort": port, "protocol": "TCP"} for name, port in t.ports)]
    mounts = [{"name": "dshm", "mountPath": "/dev/shm"}]
    volumes = [{"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": t.shm}}]
    if t.model_pvc or t.model_host_path:
        mounts.append({"name": "model", "mountPath": MOUNT, "readOnly": True})
        volumes.append({"name": "model", **({"persistentVolumeClaim": {"claimName": t.model_pvc, "readOnly": True}}
                                            if t.model_pvc else
                                            {"hostPath": {"path": t.model_host_path, "type": "Directory"}})})
    container = {
        "name": "vsup", "image": t.image, "command": command,
        **({"env": [{"name": var, "valueFrom": {"secretKeyRef": {"name": f"{t.name}-secrets", "key": key}}}
                    for var, key in t.secrets]} if t.secrets else {}),
        "ports": ports,
        "resources": {"requests": resources, "limits": resources},
        "startupProbe": _probe("/readyz", period=10, failures=t.startup_s // 10 + 1),
        "readinessProbe": _probe("/readyz", period=5, failures=2),
        "livenessProbe": _probe("/livez", period=10, failures=3),
        "volumeMounts": mounts,
        "securityContext": {"capabilities": {"add": ["SYS_PTRACE"]}},  # py-spy's stacks of a hung process
    }
    return {"enableServiceLinks": False,  # a Service named `vllm` would inject VLLM_PORT, which vLLM takes
            "terminationGracePeriodSeconds": t.grace_s,
            "containers": [container], "volumes": volumes}


def _probe(path: str, period: int, failures: int) -> dict:
    return {"httpGet": {"path": path, "port": "probes"}, "periodSeconds": period, "timeoutSeconds": 2,
            "failureThreshold": failures}


def to_yaml(docs: list[dict]) -> str:
    import yaml

    class Dumper(yaml.SafeDumper):  # long strings (a dashboard) as blocks, keys in the order written
        def ignore_aliases(self, data):  # no &id001: each value written where it stands
            return True

    def text(dumper, value):
        style = "|" if "\n" in value else None
        return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)
    Dumper.add_representer(str, text)
    return yaml.dump_all(docs, Dumper=Dumper, sort_keys=False, width=120)


def dashboard_text(raw: str) -> str:
    """A dashboard's JSON as the ConfigMap holds it: compact lines, one panel per line is not needed."""
    return json.dumps(json.loads(raw), indent=1) + "\n"
