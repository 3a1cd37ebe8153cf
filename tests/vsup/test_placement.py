"""The placement policy (vsup/placement.py): exact cases, and properties over generated plans and machines."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vsup.errors import UsageError
from vsup.cpulist import cpu_list
from vsup.placement import API_SERVER_NICE, Machine, Placement, default_reserve, numa_split, place, split
from vsup.topology import ParallelConfig, plan


def processes(device="cpu", **flags):
    return plan(ParallelConfig(device=device, **flags)).processes


def test_a_two_core_host_keeps_one_core_for_the_api_server_and_the_engine_core():
    placed = place(processes(), Machine((0, 1)))
    assert placed["worker dp0 pp0 tp0"] == Placement((0,), threads=1, exclusive=True)
    # shared; the engine core's step wins the CPU over the API server
    assert placed["api-server a0"] == Placement((1,), threads=1, nice=5)
    assert placed["engine-core dp0"] == Placement((1,))
    assert [placed[n].describe() for n in ("api-server a0", "engine-core dp0", "worker dp0 pp0 tp0")] == [
        "1 (shared, nice 5)", "1 (shared)", "0"]


def test_reserve_0_is_the_model_on_every_core_and_the_rest_unpinned():
    placed = place(processes(), Machine((0, 1)), reserve=0)
    assert placed["worker dp0 pp0 tp0"] == Placement((0, 1), threads=2, exclusive=True)
    assert placed["api-server a0"] == Placement() == placed["engine-core dp0"]  # nice 0 beside the workers
    assert placed["api-server a0"].describe() == "any"


def test_with_enough_cores_each_process_beside_the_workers_has_its_own():
    placed = place(processes(tensor_parallel_size=2, api_server_count=2), Machine(tuple(range(16))))
    assert default_reserve(processes(tensor_parallel_size=2, api_server_count=2), Machine(tuple(range(16)))) == 3
    assert placed["worker dp0 pp0 tp0"].cpus == tuple(range(0, 6)) and placed["worker dp0 pp0 tp1"].cpus == tuple(
        range(6, 12))
    assert [placed[n].cpus for n in ("api-server a0", "api-server a1", "engine-core dp0")] == [(13,), (14,), (15,)]
    assert all(placed[n].exclusive for n in ("api-server a0", "api-server a1", "engine-core dp0"))
    assert placed["worker dp0 pp0 tp0"].threads == 6


def test_as_many_cores_as_workers_reserves_nothing():
    assert default_reserve(processes(tensor_parallel_size=2), Machine((0, 1))) == 0
    placed = place(processes(tensor_parallel_size=2), Machine((0, 1)))
    assert placed["worker dp0 pp0 tp0"].cpus == (0,) and placed["worker dp0 pp0 tp1"].cpus == (1,)


def test_fewer_cores_than_workers_pins_nothing():
    placed = place(processes(tensor_parallel_size=4), Machine((0, 1)))
    assert all(p.cpus == () for p in placed.values())
    assert placed["worker dp0 pp0 tp0"].threads == 1  # two cores over four workers: a thread each at most


def test_in_process_mode_runs_the_model_in_the_api_server_on_every_core():
    placed = place(processes(multiprocessing=False), Machine((0, 1)))
    assert placed == {"api-server a0": Placement((0, 1), threads=2, exclusive=True)}


def test_a_reserve_that_leaves_a_worker_no_core_is_refused_with_the_most_it_can_be():
    with pytest.raises(UsageError, match=r"--cpu-reserve 2 leaves 0 of this node's 2 CPUs to its 1 CPU worker; "
                                         r"use at most --cpu-reserve 1"):
        place(processes(), Machine((0, 1)), reserve=2)
    with pytest.raises(UsageError, match="0 or more"):
        place(processes(), Machine((0, 1)), reserve=-1)


def test_on_a_gpu_host_each_process_near_its_gpu():
    # two NUMA nodes of 4 CPUs; GPU 0 on node 1, GPU 1 on node 0
    machine = Machine(tuple(range(8)), numa=((0, 1, 2, 3), (4, 5, 6, 7)), gpu_numa=(1, 0))
    placed = place(processes("cuda", data_parallel_size=2), machine)
    assert placed["worker dp0 pp0 tp0"].cpus == (4,) and placed["worker dp1 pp0 tp0"].cpus == (0,)
    assert placed["engine-core dp0"].cpus[0] in (4, 5, 6, 7) and placed["engine-core dp1"].cpus[0] in (0, 1, 2, 3)
    assert all(p.exclusive for p in placed.values())
    assert place(processes("cuda", data_parallel_size=2), Machine((0, 1)))["worker dp0 pp0 tp0"] == Placement()


def test_on_two_numa_nodes_no_worker_straddles_them():
    # 2 x 8 CPUs, TP 4: two workers on each node; a core of node 1 kept for the API server and engine core
    machine = Machine(tuple(range(16)), numa=(tuple(range(8)), tuple(range(8, 16))))
    placed = place(processes(tensor_parallel_size=4), machine)
    assert [placed[f"worker dp0 pp0 tp{t}"].cpus for t in range(4)] == [(0, 1, 2), (3, 4, 5), (8, 9, 10),
                                                                       (11, 12, 13)]
    assert placed["api-server a0"].cpus == (14,) and placed["engine-core dp0"].cpus == (15,)
    # (a flat split of 0-13 in threes gives tp2 6-8: across the nodes)


def test_helpers():
    assert cpu_list([0, 1, 2, 3, 8, 10, 11]) == "0-3,8,10-11" and cpu_list([5]) == "5"
    assert split([0, 1], 2) == [[0], [1]]
    assert split([0, 1, 2, 3, 7], 2) == [[0, 1], [2, 3]]  # 7 left over
    assert split([0, 1], 3) == [[], [], []]
    assert split([0], 0) == []


shapes = st.fixed_dictionaries({
    "device": st.sampled_from(["cpu", "cuda"]), "tensor_parallel_size": st.integers(1, 4),
    "pipeline_parallel_size": st.integers(1, 2), "data_parallel_size": st.integers(1, 3),
    "api_server_count": st.one_of(st.none(), st.integers(1, 3)), "multiprocessing": st.booleans()})


@st.composite
def machines(draw):
    cpus = tuple(sorted(draw(st.sets(st.integers(0, 63), min_size=1, max_size=40))))
    nodes = draw(st.integers(1, 2))
    numa = tuple(tuple(c for c in cpus if c % nodes == n) for n in range(nodes)) if nodes > 1 else ()
    return Machine(cpus, numa, tuple(draw(st.lists(st.integers(0, nodes - 1), max_size=8))))


@settings(max_examples=300, deadline=None)
@given(shape=shapes, machine=machines(), reserve=st.one_of(st.none(), st.integers(0, 40)))
def test_properties(shape, machine, reserve):
    try:
        procs = processes(**shape)
    except UsageError:
        return  # a shape the flags refuse (in-process mode with DP > 1, ...)
    try:
        placed = place(procs, machine, reserve)
    except UsageError as e:
        assert reserve is not None and "--cpu-reserve" in str(e)
        return
    # every process placed
    assert set(placed) == {p.name for p in procs}
    for name, p in placed.items():
        # at least one CPU: pinned to some of the machine's, or to none (every CPU); and a thread
        assert set(p.cpus) <= set(machine.cpus) and p.threads >= 1
        assert len(set(p.cpus)) == len(p.cpus) and p.nice in (0, API_SERVER_NICE)
        if p.exclusive:  # no other process is given any of them
            assert p.cpus and all(not set(p.cpus) & set(q.cpus) for n, q in placed.items() if n != name)
    # the default never refuses; deterministic
    assert place(procs, machine, reserve) == placed
    assert place(procs, machine) == place(procs, machine)


@settings(max_examples=300, deadline=None)
@given(machine=machines(), n=st.integers(1, 12))
def test_a_numa_split_keeps_each_share_on_one_node_and_equal(machine, n):
    shares = numa_split(list(machine.cpus), n, machine.numa)
    if shares is None:
        return
    assert len(shares) == n and len({len(s) for s in shares}) == 1 and shares[0]
    assert all(any(set(s) <= set(node) for node in machine.numa) for s in shares)
    assert len({c for s in shares for c in s}) == sum(map(len, shares))  # no CPU twice
