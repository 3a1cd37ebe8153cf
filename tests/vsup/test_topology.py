"""The topology: flags -> process specs, and the count formula of docs/ARCHITECTURE.md."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vsup.errors import UsageError
from vsup.topology import API_SERVER, COORDINATOR, ENGINE_CORE, WORKER, ParallelConfig, plan, process_name, process_title


def test_names_and_titles_are_spelled_one_way():
    assert process_name(WORKER, dp=0, pp=0, tp=1) == "worker dp0 pp0 tp1"
    assert process_name(API_SERVER, a=2) == "api-server a2"
    assert process_name(ENGINE_CORE, dp=3) == "engine-core dp3"
    assert process_name(COORDINATOR) == "coordinator"
    assert process_title("worker dp0 pp0 tp1") == "vsup::worker_dp0_pp0_tp1"


@pytest.mark.parametrize("kwargs,total,formula", [
    ({}, 3, "1 api-server + 1 engine-core + 1 worker = 3 processes"),
    ({"tensor_parallel_size": 4}, 6, "1 api-server + 1 engine-core + 4 workers = 6 processes"),
    ({"tensor_parallel_size": 2, "pipeline_parallel_size": 2}, 6, None),
    ({"tensor_parallel_size": 2, "data_parallel_size": 4}, 17,
     "4 api-servers + 4 engine-cores + 8 workers + 1 coordinator = 17 processes"),
    ({"data_parallel_size": 2, "api_server_count": 1}, 6, None),
    ({"headless": True, "data_parallel_size": 4, "data_parallel_size_local": 2, "data_parallel_start_rank": 2,
      "tensor_parallel_size": 2, "dp_address": "10.0.0.1:29550"}, 6, "2 engine-cores + 4 workers = 6 processes"),
    ({"multiprocessing": False}, 1, "1 api-server = 1 process"),
    ({"multiprocessing": False, "tensor_parallel_size": 2}, 3, "1 api-server + 2 workers = 3 processes"),
])
def test_counts_of_documented_shapes(kwargs, total, formula):
    p = plan(ParallelConfig(**kwargs))
    assert p.total == total
    if formula:
        assert p.formula == formula


def test_headless_node_runs_only_its_ranks_on_its_devices():
    p = plan(ParallelConfig(headless=True, data_parallel_size=4, data_parallel_size_local=2, dp_address="head:29550",
                            data_parallel_start_rank=2, tensor_parallel_size=2, device="cuda"))
    assert {s.role for s in p.processes} == {ENGINE_CORE, WORKER}
    assert sorted({s.dp for s in p.processes}) == [2, 3]
    assert {s.node for s in p.processes} == {1}
    assert sorted(s.device for s in p.processes if s.role == WORKER) == ["cuda:0", "cuda:1", "cuda:2", "cuda:3"]


def test_worker_spec_carries_what_serve_needs_to_launch_it():
    p = plan(ParallelConfig(tensor_parallel_size=2, device="cuda"), python="py", engine_args=("--model", "m"))
    w = next(s for s in p.processes if s.name == "worker dp0 pp0 tp1")
    assert w.argv[:3] == ("py", "-m", "engine.worker")
    assert ("--tp-rank", "1") == w.argv[w.argv.index("--tp-rank"):w.argv.index("--tp-rank") + 2]
    assert w.argv[-2:] == ("--model", "m")
    assert w.device == "cuda:1"
    assert w.env["VSUP_PROCESS_TITLE"] == "vsup::worker_dp0_pp0_tp1"
    assert w.to_json() == {"name": "worker dp0 pp0 tp1", "role": "worker", "dp": 0, "pp": 0, "tp": 1,
                           "device": "cuda:1", "title": "vsup::worker_dp0_pp0_tp1", "node": 0}


@pytest.mark.parametrize("kwargs,flag", [
    ({"tensor_parallel_size": 0}, "-tp/--tensor-parallel-size"),
    ({"pipeline_parallel_size": -1}, "-pp/--pipeline-parallel-size"),
    ({"data_parallel_size": 0}, "-dp/--data-parallel-size"),
    ({"multiprocessing": False, "data_parallel_size": 2}, "--no-multiprocessing"),
    ({"multiprocessing": False, "api_server_count": 2}, "--no-multiprocessing"),
    ({"headless": True, "data_parallel_size": 2}, "--dp-start-rank"),
    ({"data_parallel_size": 2, "data_parallel_size_local": 3}, "--dp-size-local"),
    ({"headless": True, "data_parallel_size": 2, "data_parallel_start_rank": 1, "data_parallel_size_local": 2},
     "--dp-start-rank"),
    ({"data_parallel_start_rank": 1, "data_parallel_size": 2}, "--headless"),
    ({"headless": True, "data_parallel_size": 2, "data_parallel_start_rank": 1}, "--dp-address"),
    ({"data_parallel_size": 4, "data_parallel_size_local": 2}, "--dp-address"),
    ({"data_parallel_size": 2, "dp_address": "nohost"}, "--dp-address"),
    ({"data_parallel_size": 2, "dp_address": "h:65534"}, "--dp-address"),
    ({"dp_address": "h:29550"}, "--dp-address"),
    ({"data_parallel_size": 2, "api_server_count": 0}, "--api-server-count"),
])
def test_mistakes_name_the_flag(kwargs, flag):
    with pytest.raises(UsageError, match=flag.replace("-", r"\-")):
        ParallelConfig(**kwargs)


shapes = st.fixed_dictionaries({
    "tensor_parallel_size": st.integers(1, 8),
    "pipeline_parallel_size": st.integers(1, 4),
    "data_parallel_size": st.integers(1, 8),
    "api_server_count": st.none() | st.integers(1, 4),
    "device": st.sampled_from(["cpu", "cuda"]),
})


@settings(max_examples=300, deadline=None)
@given(shapes)
def test_formula_holds_for_every_shape(kwargs):
    config = ParallelConfig(**kwargs)
    p = plan(config)
    tp, pp, dp = kwargs["tensor_parallel_size"], kwargs["pipeline_parallel_size"], kwargs["data_parallel_size"]
    a = kwargs["api_server_count"] or dp
    assert p.total == a + dp + dp * tp * pp + (1 if dp > 1 else 0)
    assert p.count(API_SERVER) == a and p.count(ENGINE_CORE) == dp and p.count(WORKER) == dp * tp * pp
    assert p.formula.endswith(f"= {p.total} processes")


@settings(max_examples=300, deadline=None)
@given(shapes, st.booleans(), st.data())
def test_names_unique_ranks_contiguous_devices_not_shared(kwargs, headless, data):
    dp = kwargs["data_parallel_size"]
    if headless and dp > 1:
        local = data.draw(st.integers(1, dp - 1))
        kwargs = dict(kwargs, headless=True, dp_address="head:29550", data_parallel_size_local=local,
                      data_parallel_start_rank=data.draw(st.integers(1, dp - local)))
    p = plan(ParallelConfig(**kwargs))
    names = [s.name for s in p.processes]
    assert len(set(names)) == len(names)
    assert len({s.title for s in p.processes}) == len(names)
    assert all(s.title == process_title(s.name) for s in p.processes)
    cores = sorted(s.dp for s in p.processes if s.role == ENGINE_CORE)
    assert cores == list(range(cores[0], cores[0] + len(cores)))
    for core in cores:
        ranks = sorted((s.pp, s.tp) for s in p.processes if s.role == WORKER and s.dp == core)
        assert ranks == [(i, j) for i in range(kwargs["pipeline_parallel_size"])
                         for j in range(kwargs["tensor_parallel_size"])]
    assert sorted(s.a for s in p.processes if s.role == API_SERVER) == list(range(p.count(API_SERVER)))
    if kwargs["device"] == "cuda":
        for node in p.nodes():
            devices = [s.device for s in p.on_node(node) if s.role == WORKER]
            assert len(set(devices)) == len(devices)


def test_nodes_meet_over_tcp_at_the_dp_address_and_locally_over_ipc():
    head = plan(ParallelConfig(data_parallel_size=2, data_parallel_size_local=1, api_server_count=2,
                               dp_address="10.0.0.1:29550"), run_dir="/run/x", deployment="x")
    node = plan(ParallelConfig(data_parallel_size=2, data_parallel_start_rank=1, headless=True, api_server_count=2,
                               dp_address="10.0.0.1:29550"), run_dir="/run/y", deployment="y")
    assert [p.name for p in head.processes] == ["api-server a0", "api-server a1", "engine-core dp0",
                                                 "engine-core dp1", "worker dp0 pp0 tp0", "worker dp1 pp0 tp0",
                                                 "coordinator"]
    assert [p.node for p in head.processes] == [0, 0, 0, 1, 0, 1, 0]
    assert [p.name for p in node.processes] == ["engine-core dp1", "worker dp1 pp0 tp0"]

    def arg(spec, flag):
        return [spec.argv[i + 1] for i, a in enumerate(spec.argv) if a == flag]

    a1 = next(p for p in head.processes if p.name == "api-server a1")
    core = node.processes[0]
    assert arg(a1, "--engine-address") == ["tcp://10.0.0.1:29554"]
    assert arg(core, "--api-server-address") == ["tcp://10.0.0.1:29553", "tcp://10.0.0.1:29554"]
    assert arg(core, "--coordinator-address") == ["tcp://10.0.0.1:29550"]
    assert arg(core, "--wave-address") == ["tcp://10.0.0.1:29552"]
    assert arg(node.processes[1], "--core-address")[0].startswith("ipc:///run/y/")  # its workers stay local


def test_a_group_spanning_nodes_splits_its_workers_and_meets_at_the_master_port():
    head = plan(ParallelConfig(tensor_parallel_size=2, pipeline_parallel_size=2, nnodes=2, device="cuda",
                               master_addr="10.0.0.1", master_port=29500), run_dir="/run/x", deployment="x")
    node = plan(ParallelConfig(tensor_parallel_size=2, pipeline_parallel_size=2, nnodes=2, node_rank=1,
                               headless=True, device="cuda", master_addr="10.0.0.1", master_port=29500),
                run_dir="/run/y", deployment="y")
    assert [(p.name, p.node, p.device) for p in head.processes if p.role == WORKER] == [
        ("worker dp0 pp0 tp0", 0, "cuda:0"), ("worker dp0 pp0 tp1", 0, "cuda:1"),
        ("worker dp0 pp1 tp0", 1, "cuda:0"), ("worker dp0 pp1 tp1", 1, "cuda:1")]
    assert [p.name for p in node.processes] == ["worker dp0 pp1 tp0", "worker dp0 pp1 tp1"]

    def arg(spec, flag):
        return spec.argv[spec.argv.index(flag) + 1]

    core = next(p for p in head.processes if p.role == ENGINE_CORE)
    assert arg(core, "--worker-address") == "tcp://10.0.0.1:29501"
    assert arg(core, "--ring-remote-address") == "tcp://10.0.0.1:29502"
    assert arg(node.processes[0], "--core-address") == "tcp://10.0.0.1:29501"
    assert arg(node.processes[0], "--node-rank") == "1"
    assert "--node-rank" not in plan(ParallelConfig(tensor_parallel_size=2)).processes[-1].argv


@pytest.mark.parametrize("kwargs,flag", [
    ({"nnodes": 0}, "--nnodes"),
    ({"nnodes": 2, "node_rank": 2, "tensor_parallel_size": 2}, "--node-rank"),
    ({"nnodes": 2, "tensor_parallel_size": 3}, "--nnodes"),
    ({"nnodes": 2, "tensor_parallel_size": 2, "data_parallel_size": 2}, "--dp-address"),
    ({"nnodes": 2, "tensor_parallel_size": 2, "node_rank": 1}, "--headless"),
    ({"nnodes": 2, "tensor_parallel_size": 2, "headless": True}, "--node-rank"),
    ({"nnodes": 2, "tensor_parallel_size": 2, "master_port": 65534}, "--master-port"),
    ({"nnodes": 2, "tensor_parallel_size": 2, "multiprocessing": False}, "--nnodes"),
])
def test_spanning_mistakes_name_the_flag(kwargs, flag):
    with pytest.raises(UsageError, match=flag.replace("-", r"\-")):
        ParallelConfig(**kwargs)
