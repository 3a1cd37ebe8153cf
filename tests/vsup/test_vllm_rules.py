"""The pure rules of `--engine vllm`: vLLM's tree for the flags, its names, its lines, its flags, its hangs."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest

from tests.polling import wait_for
from vsup import procfs
from vsup.errors import UsageError
from vsup.topology import ParallelConfig
from vsup.front.metrics import merge_replicas
from vsup.serve_flags import ServeFlags
from vsup.vllm.args import (GIB, added, check_nodes, check_replicas, check_supported, cpu_kv_cache_gib,
                            cpu_placement, serve_argv, serve_env, unknown_flags)
from vsup.vllm.help import parse_flags
from vsup.vllm.names import Role, parse_line, role_of_name, role_of_title
from vsup.vllm.plan import tree_roots, vllm_plan
from vsup.vllm.progress import Progress, parse_metrics


def names(**kw):
    return [(p.name, p.title) for p in vllm_plan(ParallelConfig(**kw)).processes]


def test_the_tree_follows_vllms_rules():
    assert names() == [("front", "vsup::front"), ("api-server a0", "vllm serve"), ("engine-core dp0", "VLLM::EngineCore"),
                       ("worker dp0 pp0 tp0", "VLLM::Worker"),
                       ("helper resource-tracker", "multiprocessing.resource_tracker")]
    # on CUDA at TP x PP = 1 the uni executor runs the model inside the engine core
    cuda = vllm_plan(ParallelConfig(device="cuda"))
    assert [p.name for p in cuda.processes] == ["front", "api-server a0", "engine-core dp0",
                                                "helper resource-tracker"]
    assert cuda.processes[2].device == "cuda:0"
    dp = names(data_parallel_size=2, tensor_parallel_size=2)
    assert dp[:4] == [("front", "vsup::front"), ("helper vllm-serve", "vllm serve"), ("api-server a0", "VLLM::APIServer_0"),
                      ("api-server a1", "VLLM::APIServer_1")]
    assert ("engine-core dp1", "VLLM::EngineCore_DP1") in dp
    assert ("worker dp1 pp0 tp1", "VLLM::Worker_DP1_TP1") in dp
    assert ("coordinator", "VLLM::DPCoordinator") in dp
    plan = vllm_plan(ParallelConfig(data_parallel_size=2, tensor_parallel_size=2))
    assert plan.formula == ("1 front + 2 api-servers + 2 engine-cores + 4 workers + 1 coordinator = 10 processes, "
                            "plus 2 helpers: 12 in all")
    assert names(api_server_count=1, data_parallel_size=2)[1] == ("api-server a0", "vllm serve")
    assert ("worker dp0 pp1 tp0", "VLLM::Worker_PP1") in names(pipeline_parallel_size=2)


def test_replicas_are_whole_trees_named_by_their_replica():
    plan = vllm_plan(ParallelConfig(tensor_parallel_size=2), replicas=2)
    assert plan.formula == "1 front + 2 api-servers + 2 engine-cores + 4 workers = 9 processes, plus 2 helpers: 11 in all"
    assert [p.name for p in plan.processes] == [
        "front", "api-server r0 a0", "engine-core r0 dp0", "worker r0 dp0 pp0 tp0", "worker r0 dp0 pp0 tp1",
        "helper r0 resource-tracker", "api-server r1 a0", "engine-core r1 dp0", "worker r1 dp0 pp0 tp0",
        "worker r1 dp0 pp0 tp1", "helper r1 resource-tracker"]
    assert [p.name for p in tree_roots(plan)] == ["api-server r0 a0", "api-server r1 a0"]
    assert plan.processes[8].to_json()["r"] == 1 and "r" not in vllm_plan(ParallelConfig()).processes[1].to_json()
    cuda = vllm_plan(ParallelConfig(device="cuda", tensor_parallel_size=2), replicas=2)
    assert [p.device for p in cuda.processes if p.role == "worker"] == ["cuda:0", "cuda:1", "cuda:2", "cuda:3"]
    with pytest.raises(UsageError, match="--replicas is for --engine vllm"):
        check_replicas(False, 2)
    with pytest.raises(UsageError, match="at least 1"):
        check_replicas(True, 0)


def test_replicas_metrics_are_one_text_labelled_by_replica():
    one = ("# HELP vllm:num_requests_running Requests.\n# TYPE vllm:num_requests_running gauge\n"
           'vllm:num_requests_running{engine="0"} 1.0\n'
           "# HELP vllm:e2e Latency.\n# TYPE vllm:e2e histogram\n"
           'vllm:e2e_bucket{le="0.1"} 2.0\nvllm:e2e_count 2.0\n')
    merged = merge_replicas({0: one, 1: one.replace("1.0", "3.0")}).splitlines()
    assert merged == ["# HELP vllm:num_requests_running Requests.", "# TYPE vllm:num_requests_running gauge",
                      'vllm:num_requests_running{replica="r0",engine="0"} 1.0',
                      'vllm:num_requests_running{replica="r1",engine="0"} 3.0',
                      "# HELP vllm:e2e Latency.", "# TYPE vllm:e2e histogram",
                      'vllm:e2e_bucket{replica="r0",le="0.1"} 2.0', 'vllm:e2e_count{replica="r0"} 2.0',
                      'vllm:e2e_bucket{replica="r1",le="0.1"} 2.0', 'vllm:e2e_count{replica="r1"} 2.0']
    assert merge_replicas({}) == ""


def test_vllms_names_are_vsups_names():
    assert role_of_name("Worker_DP1_PP0_TP1") == Role("worker", dp=1, pp=0, tp=1)
    assert role_of_name("Worker_TP1") == Role("worker", dp=0, pp=0, tp=1)
    assert role_of_name("Worker") == Role("worker", settled=False)  # titled before its groups exist
    assert role_of_name("EngineCore_DP3") == Role("engine-core", dp=3)
    assert role_of_name("ApiServer_2") == role_of_name("APIServer_2") == Role("api-server", a=2)
    assert role_of_name("DPCoordinator") == Role("coordinator")
    assert role_of_title(["VLLM::EngineCore"]) == Role("engine-core", dp=0)
    assert role_of_title(["python", "-B", "-c", "from multiprocessing.resource_tracker import main;main(3)"]) \
        == Role("helper")
    assert role_of_title(["python", "-c", "from multiprocessing.spawn import spawn_main"]) is None


def test_vllms_lines_are_parsed_into_the_record():
    line = parse_line("(EngineCore_DP0 pid=77) WARNING 12-01 08:49:16 [core.py:133] low memory")
    assert (line.prefix_name, line.prefix_pid, line.level, line.source, line.message) == \
        ("EngineCore_DP0", 77, "warning", "core.py:133", "low memory")
    colored = parse_line("\x1b[36m(Worker_TP1 pid=9)\x1b[0m INFO 12-01 08:49:16 [a.py:1] hi")
    assert (colored.prefix_name, colored.message) == ("Worker_TP1", "hi")
    assert parse_line('INFO:     127.0.0.1:5 - "POST /v1/completions HTTP/1.1" 200 OK').level == "info"
    assert parse_line("[W1201 09:00:05.660 utils.cpp:68] Warning: NUMA").level == "warning"
    assert parse_line("\rLoading shards: 100% Completed | 1/1 [00:00<00:00, 247.73it/s]").level == "info"
    assert parse_line("x.py:3: FutureWarning: old").level == "warning"
    assert parse_line("Segmentation fault").level is None  # the stream decides


def flags(**kw):
    return ServeFlags(**{**dict(model="/m", served_model_name="m", host="127.0.0.1", port=8000, dtype="auto",
                                max_num_seqs=16, seed=3, drain_timeout=7.5, gpu_memory_utilization=0.8), **kw})


def test_vllm_gets_its_defaults_what_the_user_asked_and_what_supervision_needs():
    """No flag of vsup's own default reaches vLLM (no --enforce-eager, dtype, sequence limit, seed, memory
    share, binding): only those the user gave, and what vsup adds for supervision, each with why."""
    argv = serve_argv("vllm", ParallelConfig(device="cpu"), flags(uds="/run/vllm.sock"))
    assert argv == ["vllm", "serve", "/m", "--served-model-name", "m", "--uds", "/run/vllm.sock",
                    "--shutdown-timeout", "8"]
    assert [args for args, why in added(ParallelConfig(device="cpu"), "m", 7.5, "/run/vllm.sock") if why] == \
        [("--served-model-name", "m"), ("--uds", "/run/vllm.sock"), ("--shutdown-timeout", "8")]
    env = serve_env(ParallelConfig(device="cpu"), flags(), [], "secret")
    assert not {"VLLM_CPU_KVCACHE_SPACE", "VLLM_CPU_OMP_THREADS_BIND", "VLLM_CPU_NUM_OF_RESERVED_CPU"} & set(env)
    asked = flags(max_model_len=256, asked=frozenset({"--dtype", "--seed", "--max-num-seqs", "--max-model-len",
                                                      "--gpu-memory-utilization"}))
    text = " ".join(serve_argv("vllm", ParallelConfig(tensor_parallel_size=2, device="cpu"), asked, ("--x", "1")))
    assert text.startswith("vllm serve /m --served-model-name m --shutdown-timeout 8 --host 127.0.0.1 --port 8000 "
                           "--tensor-parallel-size 2 ")
    assert text.endswith(" --dtype auto --max-num-seqs 16 --seed 3 --max-model-len 256 --gpu-memory-utilization 0.8 "
                         "--x 1")
    assert "--enforce-eager" not in text
    cuda = serve_argv("vllm", ParallelConfig(device="cuda"), flags(kv_cache_bytes=5), ())
    assert "--kv-cache-memory-bytes 5" in " ".join(cuda) and "--gpu-memory-utilization" not in cuda
    env = serve_env(ParallelConfig(tensor_parallel_size=2, device="cpu"), flags(kv_cache_bytes=GIB), [[0], [1]],
                    "secret")  # (--kv-cache-memory and --cpu-reserve given)
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "1" and env["VLLM_CPU_OMP_THREADS_BIND"] == "0|1"
    assert env["VLLM_API_KEY"] == "secret" and "secret" not in argv
    assert cpu_kv_cache_gib(3 * GIB) == 3
    # one worker on 4 cores: it gets 3 and one is kept for the front, vLLM's API server and engine core
    assert cpu_placement([3, 0, 2, 1], 1) == ([[0, 1, 2]], [3])
    assert cpu_placement([0, 1], 2) == ([[0], [1]], [])  # TP=2 on two cores: nothing kept
    assert cpu_placement([0, 1, 2, 3], 0) == ([], [])  # CUDA: no CPU worker, no pinning
    with pytest.raises(UsageError, match="whole GiB"):
        cpu_kv_cache_gib(GIB // 2)


def test_a_tree_across_nodes_is_split_by_vllms_rank_order():
    """TP x PP ranks in order, `per node` each: node 0 has the API server, the engine core and its workers;
    every other node its `vllm serve --headless` (a helper, named with its node), workers and tracker."""
    head = vllm_plan(ParallelConfig(tensor_parallel_size=2, pipeline_parallel_size=2, nnodes=2, device="cuda"))
    assert [(p.node, p.name, p.title, p.device) for p in head.processes] == [
        (0, "front", "vsup::front", None), (0, "api-server a0", "vllm serve", None),
        (0, "engine-core dp0", "VLLM::EngineCore", None),
        (0, "worker dp0 pp0 tp0", "VLLM::Worker_PP0_TP0", "cuda:0"),
        (0, "worker dp0 pp0 tp1", "VLLM::Worker_PP0_TP1", "cuda:1"),
        (0, "helper resource-tracker", "multiprocessing.resource_tracker", None),
        (1, "helper node1 vllm-serve", "vllm serve", None),
        (1, "worker dp0 pp1 tp0", "VLLM::Worker_PP1_TP0", "cuda:0"),
        (1, "worker dp0 pp1 tp1", "VLLM::Worker_PP1_TP1", "cuda:1"),
        (1, "helper node1 resource-tracker", "multiprocessing.resource_tracker", None)]
    assert [p.name for p in tree_roots(head)] == ["api-server a0"]
    node = vllm_plan(ParallelConfig(tensor_parallel_size=4, nnodes=4, node_rank=3, headless=True))
    assert [p.name for p in node.processes] == ["helper node3 vllm-serve", "worker dp0 pp0 tp3",
                                                "helper node3 resource-tracker"]  # no front: it serves nothing
    assert [p.name for p in tree_roots(node)] == ["helper node3 vllm-serve"]
    many = vllm_plan(ParallelConfig(tensor_parallel_size=2, nnodes=2, api_server_count=2))
    assert [p.name for p in many.processes][1:4] == ["helper vllm-serve", "api-server a0", "api-server a1"]


def test_vsup_flags_across_nodes_become_vllms():
    head = ParallelConfig(tensor_parallel_size=2, nnodes=2, master_addr="10.0.0.1", master_port=29501)
    argv = " ".join(serve_argv("vllm", head, flags(uds="/run/v.sock")))
    assert "--shutdown-timeout 8 --nnodes 2 --node-rank 0 --master-addr 10.0.0.1 --master-port 29501" in argv
    node = ParallelConfig(tensor_parallel_size=2, nnodes=2, node_rank=1, headless=True, master_addr="10.0.0.1",
                          api_server_count=2)
    argv = serve_argv("vllm", node, flags(uds="/run/v.sock"))
    assert "--headless --nnodes 2 --node-rank 1 --master-addr 10.0.0.1" in " ".join(argv)
    assert "--uds" not in argv and "--api-server-count" not in argv  # (a headless node serves nothing)
    # vLLM's own guess of its address (the hostname's, or a route to 8.8.8.8) is not the head's network
    env = serve_env(head, flags(), [[0]], None, 0, ("10.0.0.7", "eth1"))
    assert (env["VLLM_HOST_IP"], env["GLOO_SOCKET_IFNAME"]) == ("10.0.0.7", "eth1")
    assert serve_env(ParallelConfig(), flags(), [[0]], None)["VLLM_HOST_IP"] == "127.0.0.1"
    check_supported(head, **{"--cluster-secret": True})  # (it signs what the nodes' vsups tell each other)
    with pytest.raises(UsageError, match="--cluster-secret not supported"):
        check_supported(ParallelConfig(), **{"--cluster-secret": True})
    with pytest.raises(UsageError, match="data parallel across nodes"):
        check_supported(ParallelConfig(data_parallel_size=2, data_parallel_size_local=1, dp_address="h:1"))
    check_nodes(head, 8081, 1)
    with pytest.raises(UsageError, match="needs --probe-port PORT, the same on every node"):
        check_nodes(head, None, 1)
    with pytest.raises(UsageError, match="one vLLM tree spans the nodes"):
        check_nodes(head, 8081, 2)


def test_flags_are_checked_against_vllms_help():
    known = parse_flags("options:\n  --api-server-count N, -asc N\n                        How many.\n"
                        "  --enforce-eager, --no-enforce-eager\n  --compilation-config CONFIG, -cc CONFIG\n")
    assert {"--api-server-count", "-asc", "--enforce-eager", "--no-enforce-eager", "-cc"} <= known
    assert unknown_flags(["--enforce-eager", "--compilation-config.mode=3", "-asc", "2", "--nope=1", "-3"],
                         known) == ["--nope"]


def test_a_hang_is_requests_waiting_with_no_token():
    progress = Progress(health_timeout=10, hang_timeout=5, now=0)
    assert progress.update(1, True, (0, 0)) is None          # idle: never a hang
    assert progress.update(2, True, (3, 10)) is None
    assert progress.update(6, True, (3, 10)) is None
    assert "no token for 6 s" in progress.update(8, True, (3, 10))
    progress = Progress(health_timeout=10, hang_timeout=5, now=0)
    assert progress.update(9, False, None) is None
    assert "/health has failed for 12 s" in progress.update(12, False, None)
    text = ('vllm:num_requests_running{engine="0",model_name="m"} 2.0\n'
            'vllm:num_requests_waiting{engine="0",model_name="m"} 1.0\n'
            'vllm:generation_tokens_total{engine="0",model_name="m"} 42.0\n'
            'vllm:generation_tokens_total{engine="1",model_name="m"} 8.0\n')
    assert parse_metrics(text) == (3.0, 50.0) and parse_metrics("nothing") is None


def test_plan_engine_vllm_on_the_command_line():
    out = subprocess.run([sys.executable, "-m", "vsup", "plan", "--engine", "vllm", "--device", "cpu", "-tp", "2",
                          "--json"], capture_output=True, text=True, check=True).stdout
    plan = json.loads(out)
    assert [p["name"] for p in plan["processes"]] == ["front", "api-server a0", "engine-core dp0",
                                                      "worker dp0 pp0 tp0", "worker dp0 pp0 tp1",
                                                      "helper resource-tracker"]
    assert plan["processes"][4]["title"] == "VLLM::Worker_TP1"
    assert [(a["args"][0], a["why"].split(":")[0]) for a in plan["vllm_serve_adds"]] == [
        ("--served-model-name", "--served-model-name"), ("--uds", "vsup's front serves --host/--port and resumes "
                                                                  "streams; vLLM serves the front alone"),
        ("--shutdown-timeout", "--drain-timeout")]
    text = subprocess.run([sys.executable, "-m", "vsup", "plan", "--engine", "vllm", "--device", "cpu",
                           "--drain-timeout", "61", "--served-model-name", "tiny"],
                          capture_output=True, text=True, check=True).stdout
    assert text.split("\n\n")[-1].splitlines() == [
        "vsup adds to `vllm serve` (the rest is vLLM's default, or yours):",
        "  --served-model-name tiny  --served-model-name: the same name under both engines",
        "  --uds RUN_DIR/vllm.sock   vsup's front serves --host/--port and resumes streams; vLLM serves the front "
        "alone",
        "  --shutdown-timeout 61     --drain-timeout: how long a stop lets running requests finish"]
    bad = subprocess.run([sys.executable, "-m", "vsup", "plan", "--engine", "vllm", "--no-multiprocessing"],
                         capture_output=True, text=True)
    assert bad.returncode == 2 and "not supported with --engine vllm" in bad.stderr
    extra = subprocess.run([sys.executable, "-m", "vsup", "plan", "--device", "cpu", "--", "--enforce-eager"],
                           capture_output=True, text=True)
    assert extra.returncode == 2 and "only --engine vllm" in extra.stderr


def test_the_tree_is_blamed_on_the_process_whose_end_ended_it(tmp_path):
    """A worker that exited 0 or died of its engine core's SIGTERM (sent after a 5 s grace a loaded machine
    passes) was told to stop: its engine core is blamed; a worker killed otherwise is; a process whose
    parent has ended too followed it out, but not one that its parent reaped: vLLM's engine core reaps its
    killed worker at once and exits a second or two later (CI saw both gone when it looked). The hook's
    reap log says how a reaped worker ended. A killed `vllm serve` that its supervisor has not reaped yet
    (its main thread a zombie while the others end) has ended: its engine core followed it out (CI)."""
    from types import SimpleNamespace

    from vsup.supervisor.vllm_replica import REAP_LOG, Observed, Tree

    gone, gone_too = subprocess.Popen(["true"]), subprocess.Popen(["true"])
    gone.wait(), gone_too.wait()
    zombie = subprocess.Popen(["true"])  # not reaped until the end
    wait_for(lambda: procfs.ending(zombie.pid), timeout=10, what="a zombie")
    assert not procfs.ending(os.getpid()) and procfs.running(zombie.pid) is False

    def blamed(worker_exit, core_alive=True, core_exit=None, reaped=None, root_pid=os.getppid()):
        root = SimpleNamespace(pid=root_pid, popen=SimpleNamespace(poll=lambda: None), alive=True,
                               name="api-server a0")
        core = Observed(pid=os.getpid() if core_alive else gone_too.pid, ppid=root.pid, pidfd=None,
                        name="engine-core dp0", last_exit=core_exit)
        worker = Observed(pid=gone.pid, ppid=core.pid, pidfd=None, name="worker dp0 pp0 tp0", last_exit=worker_exit)
        tree = Tree(r=None, root=root, id=None, socket="", dir=tmp_path, plan=None,
                    procs={core.pid: core, worker.pid: worker})
        (tmp_path / REAP_LOG).write_text(f"{root.pid} 0\nnot a line\n{worker.pid} {reaped}\n" if reaped is not None
                                         else "")
        tree.learn_reaped()
        return tree.name_of(tree.first_to_die(worker)), worker.last_exit

    worker, core, root = "worker dp0 pp0 tp0", "engine-core dp0", "api-server a0"
    assert blamed("exit 0")[0] == core
    assert blamed("signal 15 (SIGTERM)")[0] == core
    assert blamed("signal 9 (SIGKILL)")[0] == worker
    assert blamed("exit 1")[0] == worker
    assert blamed("signal 9 (SIGKILL)", core_alive=False, core_exit="signal 9 (SIGKILL)")[0] == core
    assert blamed("exit 0", core_alive=False, core_exit="exit 1")[0] == core
    # reaped by its engine core, which is gone too by the time the supervisor looks (its status unseen)
    assert blamed("exited", core_alive=False, core_exit="exit 1", reaped=signal.SIGKILL) == (worker,
                                                                                              "signal 9 (SIGKILL)")
    assert blamed("exited", core_alive=False, core_exit="exit 0", reaped=0) == (core, "exit 0")
    assert blamed("exited", core_alive=False, core_exit="exit 1")[0] == core
    # `vllm serve` killed: the engine core and its worker follow it out, seen before the root is reaped
    assert blamed("signal 9 (SIGKILL)", core_alive=False, core_exit="signal 9 (SIGKILL)",
                  root_pid=zombie.pid)[0] == root
    assert blamed("signal 9 (SIGKILL)", core_alive=False, core_exit="signal 9 (SIGKILL)")[0] == core
    zombie.wait()


def test_replicas_split_the_users_cuda_visible_devices_as_given():
    from vsup.vllm.args import replica_gpus

    assert replica_gpus(None, 2, 2) == ["0,1", "2,3"]  # none set: the GPUs from 0 on, as before
    assert replica_gpus("3,1,2,0", 2, 2) == ["3,1", "2,0"]  # the user's order, not ours
    uuids = "GPU-aa11,GPU-bb22, MIG-cc33"
    assert replica_gpus(uuids, 3, 1) == ["GPU-aa11", "GPU-bb22", "MIG-cc33"]
    assert replica_gpus("4,5,6,7", 2, 1) == ["4,5", "6,7"]  # more than a tree needs: each its share
    for visible, replicas, per_tree, why in [("0,1,2", 2, 1, "do not split into --replicas 2 shares of 1"),
                                             ("0,1", 2, 2, "do not split into --replicas 2 shares of 2"),
                                             ("0,gpu1", 2, 1, "'gpu1', which is no GPU index")]:
        with pytest.raises(UsageError, match=why):
            replica_gpus(visible, replicas, per_tree)


def test_serve_gives_each_replica_its_share_of_the_users_gpus(monkeypatch, tmp_path):
    """The plan `vsup serve --engine vllm --replicas 2 --device cuda` starts: each tree's environment has its
    share of the CUDA_VISIBLE_DEVICES the user set (the vLLM binary and its flags stand in)."""
    import vsup.vllm.launch as launch

    monkeypatch.setattr(launch, "find_vllm", lambda vllm_bin: "/usr/bin/true")
    monkeypatch.setattr(launch, "serve_flags", lambda binary, env: set())
    monkeypatch.setattr(launch, "unknown_flags", lambda argv, known: [])

    def trees(visible):
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
        plan = launch.vllm_deployment(ParallelConfig(device="cuda", tensor_parallel_size=2), flags(), None, (),
                                      None, launch.FrontFlags(60, 8, 1), str(tmp_path), replicas=2)
        return [p.env.get("CUDA_VISIBLE_DEVICES") for p in tree_roots(plan)]

    assert trees("GPU-a,GPU-b,GPU-c,GPU-d") == ["GPU-a,GPU-b", "GPU-c,GPU-d"]
    assert trees("7,6,5,4") == ["7,6", "5,4"]
    with pytest.raises(UsageError, match="lists 3 GPUs"):
        trees("0,1,2")
