"""The topology: flags -> process specs, and the count formula of DESIGN.md section 1."""

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
      "tensor_parallel_size": 2}, 6, "2 engine-cores + 4 workers = 6 processes"),
    ({"multiprocessing": False}, 1, "1 api-server = 1 process"),
    ({"multiprocessing": False, "tensor_parallel_size": 2}, 3, "1 api-server + 2 workers = 3 processes"),
])
def test_counts_of_documented_shapes(kwargs, total, formula):
    p = plan(ParallelConfig(**kwargs))
    assert p.total == total
    if formula:
        assert p.formula == formula


def test_headless_node_runs_only_its_ranks_on_its_devices():
    p = plan(ParallelConfig(headless=True, data_parallel_size=4, data_parallel_size_local=2,
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
        kwargs = dict(kwargs, headless=True, api_server_count=None, data_parallel_size_local=local,
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
