"""`vsup plan --k8s`, proven offline (no cluster runs here): every object validated strictly (built-in kinds
with kubernetes-validate, unknown fields as errors; the LeaderWorkerSet against lws v0.10.0's CRD with
unknown fields made errors too, and its pod templates as core PodTemplates), and each shape's whole output
compared with its golden file (VSUP_UPDATE_GOLDEN=1 rewrites them; read the diff)."""

from __future__ import annotations

import copy
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml

GOLDEN = Path(__file__).parent / "golden" / "k8s"
CRD = Path(__file__).parent / "lws" / "leaderworkerset-crd.yaml"  # lws v0.10.0's (lws/README.md)
K8S_VERSION = "1.33.0"
SHAPES = {  # name -> plan flags: our engine on one CPU node, DP across 2 pods, TP across 2 GPU pods, vLLM
    "cpu": ["--device", "cpu"],
    "dp2-cpu": ["--device", "cpu", "-dp", "2", "--dp-size-local", "1", "--api-key", "from-the-secret"],
    "tp4-2nodes-cuda": ["--device", "cuda", "-tp", "4", "--nnodes", "2", "--image", "registry.example/vsup:cuda",
                        "--model-pvc", "models", "/models/llama-3-8b", "--pod-memory", "64Gi"],
    "vllm-tp2-cuda": ["--engine", "vllm", "--device", "cuda", "-tp", "2", "--namespace", "llm", "--groups", "2",
                      "--model-host-path", "/srv/models", "/models/qwen", "--", "--enable-prefix-caching"],
    "vllm-tp4-2nodes-cuda": ["--engine", "vllm", "--device", "cuda", "-tp", "4", "--nnodes", "2",
                             "--model-pvc", "models", "/models/llama-3-8b"],
}


def plan_k8s(*flags: str, env: dict | None = None) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("VSUP_", "LWS_", "CUDA_"))}
    return subprocess.run([sys.executable, "-m", "vsup", "plan", "--k8s", *flags], capture_output=True, text=True,
                          timeout=60, env={**clean, **(env or {})})


def strict(schema):
    """The CRD's schema with unknown fields refused, as the API server's strict field validation would:
    every object that lists its properties allows no other."""
    if isinstance(schema, dict):
        schema = {k: strict(v) for k, v in schema.items()}
        if schema.get("type") == "object" and "properties" in schema and "additionalProperties" not in schema \
                and not schema.get("x-kubernetes-preserve-unknown-fields"):
            schema["additionalProperties"] = False
        return schema
    if isinstance(schema, list):
        return [strict(v) for v in schema]
    return schema


@pytest.fixture(scope="module")
def lws_validator():
    crd = yaml.safe_load(CRD.read_text())
    schema = strict(crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"])
    return jsonschema.Draft7Validator(schema)


def validate(doc: dict, lws_validator) -> None:
    if doc["kind"] != "LeaderWorkerSet":
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
        return
    errors = sorted(lws_validator.iter_errors(doc), key=str)
    assert not errors, "\n".join(f"{list(e.absolute_path)}: {e.message}" for e in errors[:10])
    # what only LWS's webhook checks: a DNS-1035 name, size >= 1
    assert re.fullmatch(r"[a-z]([-a-z0-9]*[a-z0-9])?", doc["metadata"]["name"])
    assert doc["spec"]["leaderWorkerTemplate"]["size"] >= 1
    for which in ("leaderTemplate", "workerTemplate"):  # each pod template, strictly, as a core PodTemplate
        template = doc["spec"]["leaderWorkerTemplate"][which]
        kubernetes_validate.validate({"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "t"},
                                      "template": template}, K8S_VERSION, strict=True)


@pytest.mark.parametrize("shape", SHAPES)
def test_each_shape_validates_strictly_and_is_its_golden_file(shape, lws_validator):
    result = plan_k8s(*SHAPES[shape])
    assert result.returncode == 0 and result.stderr == "", result.stderr
    docs = list(yaml.safe_load_all(result.stdout))
    for doc in docs:
        validate(doc, lws_validator)
    golden = GOLDEN / f"{shape}.yaml"
    if os.environ.get("VSUP_UPDATE_GOLDEN"):
        golden.parent.mkdir(parents=True, exist_ok=True)
        golden.write_text(result.stdout)
    assert result.stdout == golden.read_text()


def test_the_validation_refuses_an_unknown_field_and_a_wrong_type(lws_validator):
    """The check itself can fail: a field the API server would reject, in each kind of object."""
    docs = list(yaml.safe_load_all(plan_k8s(*SHAPES["dp2-cpu"]).stdout))
    lws = next(d for d in docs if d["kind"] == "LeaderWorkerSet")
    for path, value in ((("spec", "leaderWorkerTemplate", "sise"), 2), (("spec", "leaderWorkerTemplate", "size"), "2"),
                        (("spec", "leaderWorkerTemplate", "restartPolicy"), "Always")):
        broken = copy.deepcopy(lws)
        *parents, last = path
        node = broken
        for key in parents:
            node = node[key]
        node[last] = value
        with pytest.raises(AssertionError):
            validate(broken, lws_validator)
    broken = copy.deepcopy(lws)
    broken["spec"]["leaderWorkerTemplate"]["workerTemplate"]["spec"]["containers"][0]["livenessProbe"]["httpGet"][
        "paht"] = "/livez"
    with pytest.raises(AssertionError, match="'paht' was unexpected"):  # the CRD's pod schema, made strict
        validate(broken, lws_validator)
    del broken["metadata"]["name"]
    template = {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "t"},
                "template": broken["spec"]["leaderWorkerTemplate"]["workerTemplate"]}
    with pytest.raises(kubernetes_validate.ValidationError):  # and the core one
        kubernetes_validate.validate(template, K8S_VERSION, strict=True)
    service = next(d for d in docs if d["kind"] == "Service")
    service["spec"]["port"] = 8000
    with pytest.raises(kubernetes_validate.ValidationError):
        validate(service, lws_validator)


def pod_of(docs: list[dict], leader: bool = True) -> dict:
    work = next(d for d in docs if d["kind"] in ("Deployment", "LeaderWorkerSet"))
    if work["kind"] == "Deployment":
        return work["spec"]["template"]["spec"]
    return work["spec"]["leaderWorkerTemplate"]["leaderTemplate" if leader else "workerTemplate"]["spec"]


def test_the_containers_run_serve_with_the_plans_flags_and_no_secret_in_argv():
    docs = list(yaml.safe_load_all(plan_k8s(*SHAPES["dp2-cpu"], "--cluster-secret", "s3cret").stdout))
    leader, worker = pod_of(docs)["containers"][0], pod_of(docs, leader=False)["containers"][0]
    assert leader["command"][:2] == ["vsup", "serve"] and worker["command"] == [*leader["command"], "--headless"]
    text = yaml.safe_dump_all(docs)
    assert "from-the-secret" not in text and "s3cret" not in text  # referenced, never written
    assert {e["name"]: e["valueFrom"]["secretKeyRef"] for e in leader["env"]} == {
        "VSUP_API_KEY": {"name": "vsup-default-secrets", "key": "api-key"},
        "VSUP_CLUSTER_SECRET": {"name": "vsup-default-secrets", "key": "cluster-secret"}}
    assert [p["httpGet"]["path"] for p in (leader["startupProbe"], leader["readinessProbe"], leader["livenessProbe"])] \
        == ["/readyz", "/readyz", "/livez"] == \
        [p["httpGet"]["path"] for p in (worker["startupProbe"], worker["readinessProbe"], worker["livenessProbe"])]
    lws = next(d for d in docs if d["kind"] == "LeaderWorkerSet")
    assert lws["spec"]["leaderWorkerTemplate"]["restartPolicy"] == "RecreateGroupOnPodRestart"
    assert all(pod_of(docs, leader)["enableServiceLinks"] is False for leader in (True, False))


def test_a_pod_asks_for_the_gpus_of_every_tree_it_runs():
    """vLLM's --replicas are trees inside one pod, each with its own GPUs: the pod asks for all of them."""
    for replicas, gpus in (("1", 2), ("2", 4)):
        docs = list(yaml.safe_load_all(plan_k8s("--engine", "vllm", "--device", "cuda", "-tp", "2", "--replicas",
                                                replicas).stdout))
        assert pod_of(docs)["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == gpus


def test_a_config_files_values_are_written_out_not_its_path(tmp_path):
    """The pod has no file of this machine: --config's values go into the command one by one, and so do
    VSUP_* variables'."""
    config = tmp_path / "vsup.toml"
    config.write_text("max-model-len = 512\nport = 9000\n")
    result = plan_k8s("--device", "cpu", "--config", str(config), env={"VSUP_MAX_NUM_SEQS": "64"})
    command = pod_of(list(yaml.safe_load_all(result.stdout)))["containers"][0]["command"]
    assert "--config" not in command and str(config) not in result.stdout
    assert command[command.index("--max-model-len") + 1] == "512" and command[command.index("--port") + 1] == "9000"
    assert command[command.index("--max-num-seqs") + 1] == "64"


def test_the_container_command_is_what_serve_takes_in_the_pod(tmp_path):
    """The leader's command, run as `vsup plan` in a pod of that group (LWS's variables set), plans what the
    manifest's group runs: the flags are serve's own, the group's share read from the variables."""
    docs = list(yaml.safe_load_all(plan_k8s(*SHAPES["dp2-cpu"]).stdout))
    command = pod_of(docs, leader=False)["containers"][0]["command"]
    flags = [f for f in command[2:] if f not in ("--probe-port", "8081")]  # (serve's own: plan keeps it too)
    pod = {"LWS_WORKER_INDEX": "1", "LWS_GROUP_SIZE": "2", "LWS_LEADER_ADDRESS": "vsup-default-0.vsup-default"}
    result = subprocess.run([sys.executable, "-m", "vsup", "plan", *flags, "--json"], capture_output=True,
                            text=True, timeout=60, env={**os.environ, **pod})
    assert result.returncode == 0, result.stderr
    names = [p["name"] for p in json.loads(result.stdout)["processes"]]
    assert names == ["engine-core dp1", "worker dp1 pp0 tp0"]  # pod 1: DP rank 1, headless


@pytest.mark.parametrize("flags,says", [
    (["--model-pvc", "m", "/data/llama"], "give MODEL as /models/<its directory>"),
    (["--model-pvc", "m", "--model-host-path", "/srv", "/models/x"], "give one"),
    (["--groups", "0"], "--groups must be at least 1"),
    (["-tp", "2", "--device", "auto"], "give --device cuda or --device cpu"),
    (["--name", "Big_Name"], "not a DNS-1035 label"),
    (["--engine", "vllm", "-dp", "2", "--dp-size-local", "1"], "not supported with --engine vllm"),
])
def test_a_manifest_that_cannot_work_is_refused_naming_the_flag(flags, says):
    result = plan_k8s("--device", "cpu", *flags) if "--device" not in flags else plan_k8s(*flags)
    assert result.returncode == 2 and says in result.stderr and result.stderr.count("\n") == 1, result.stderr
