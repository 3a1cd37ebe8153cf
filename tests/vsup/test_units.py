"""Restart units, pure: which processes restart together, and whether what is left can serve."""

from vsup.supervisor.units import UnitId, UnitKind, can_serve, members, unit_of, units
from vsup.topology import ParallelConfig, plan


def names(specs):
    return [p.name for p in specs]


def test_a_worker_restarts_its_group_and_a_core_brings_its_group_along():
    specs = list(plan(ParallelConfig(tensor_parallel_size=2, data_parallel_size=2)).processes)
    by_name = {p.name: p for p in specs}
    group = unit_of(by_name["worker dp1 pp0 tp0"])
    assert group == UnitId.worker_group(1) and str(group) == "worker-group dp1" and group.kind == UnitKind.WORKER_GROUP
    assert names(members(group, specs)) == ["worker dp1 pp0 tp0", "worker dp1 pp0 tp1"]
    core = unit_of(by_name["engine-core dp0"])
    assert str(core) == "engine-core dp0"
    assert names(members(core, specs)) == ["engine-core dp0", "worker dp0 pp0 tp0", "worker dp0 pp0 tp1"]
    assert names(members(unit_of(by_name["coordinator"]), specs)) == ["coordinator"]
    assert [str(u) for u in units(specs)] == ["api-server a0", "api-server a1", "engine-core dp0", "engine-core dp1",
                                              "worker-group dp0", "worker-group dp1", "coordinator"]


def test_what_is_left_serves_while_one_api_server_and_one_whole_rank_are():
    every = units(list(plan(ParallelConfig(data_parallel_size=2)).processes))
    a0, a1 = UnitId.api_server("api-server a0"), UnitId.api_server("api-server a1")
    assert can_serve(every, {UnitId.engine_core(0), UnitId.worker_group(1)}) is False
    assert can_serve(every, {UnitId.engine_core(0), a0}) is True
    assert can_serve(every, {a0, a1}) is False
    assert can_serve(every, {UnitId.coordinator()}) is True


def test_what_is_left_of_vllm_serves_while_the_front_and_one_tree_are():
    trees = [UnitId.front(), UnitId.vllm_tree(0), UnitId.vllm_tree(1)]
    assert can_serve(trees, {UnitId.vllm_tree(0)}) is True
    assert can_serve(trees, {UnitId.vllm_tree(0), UnitId.vllm_tree(1)}) is False
    assert can_serve(trees, {UnitId.front()}) is False  # nothing holds --port any more


def test_in_process_mode_serves_while_its_api_server_does():
    alone = units(list(plan(ParallelConfig(multiprocessing=False)).processes))
    assert alone == [UnitId.api_server("api-server a0")]
    assert can_serve(alone, set()) is True and can_serve(alone, set(alone)) is False


def test_a_vllm_tree_is_spelled_as_before():
    assert str(UnitId.vllm_tree(None)) == "vllm" and str(UnitId.vllm_tree(1)) == "vllm r1"
