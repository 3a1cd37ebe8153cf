"""DP rank states and least-loaded routing, with a fake clock."""

from __future__ import annotations

import json

import pytest

from engine.api_server.dp_ranks import DpRanks, EngineUnavailable


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def ready_ranks(n: int, clock: Clock) -> DpRanks:
    ranks = DpRanks(n, heartbeat_timeout_s=5.0, clock=clock)
    for r in range(n):
        ranks.on_hello(r, f"i{r}", 1000 + r)
        ranks.on_ready(r, 256)
    return ranks


def test_nothing_is_routable_before_ready_and_health_says_starting():
    ranks = DpRanks(2, clock=Clock())
    with pytest.raises(EngineUnavailable, match="no engine core is ready yet"):
        ranks.choose()
    ranks.on_hello(0, "i0", 1)
    with pytest.raises(EngineUnavailable):
        ranks.choose()
    assert ranks.summary()["status"] == "starting" and ranks.max_model_len() is None


def test_least_loaded_rank_wins_and_the_coordinator_hook_adds_load():
    clock = Clock()
    ranks = ready_ranks(3, clock)
    picks = []
    for _ in range(6):
        r = ranks.choose()
        ranks.get(r).num_in_flight += 1
        picks.append(r)
    assert picks == [0, 1, 2, 0, 1, 2]
    ranks.set_external_load(0, 10)  # other API servers keep rank 0 busy
    assert ranks.choose() == 1
    assert ranks.max_model_len() == 256


def test_a_draining_rank_is_the_last_choice_until_its_new_instance_says_hello():
    clock = Clock()
    ranks = ready_ranks(2, clock)
    ranks.get(1).num_in_flight = 20
    ranks.on_ready(0, 256, draining=True)  # vsup restart: dp0 finishes what runs, then restarts
    assert ranks.choose() == 1  # busier, but not draining
    assert ranks.summary()["dp_ranks"]["0"]["draining"] is True and "draining" not in ranks.summary()["dp_ranks"]["1"]
    assert ranks.choose(exclude=frozenset({1})) == 0  # alone, it still takes requests: they wait there
    ranks.on_hello(0, "i0-new", 2000)
    ranks.on_ready(0, 256)
    assert ranks.choose() == 0 and not ranks.get(0).draining


def test_failed_rank_is_routed_around_until_a_new_instance_says_hello():
    clock = Clock()
    ranks = ready_ranks(2, clock)
    ranks.on_failed(0, "workers never came back")
    assert [ranks.choose() for _ in range(3)] == [1, 1, 1]
    health = ranks.summary()
    assert health["status"] == "degraded" and health["failed"] == [0] and health["up"] == [1]
    assert health["dp_ranks"]["0"]["error"] == "workers never came back"
    ranks.on_failed(1, "oom")
    with pytest.raises(EngineUnavailable, match="dp0: workers never came back; dp1: oom"):
        ranks.choose()
    assert ranks.summary()["status"] == "unavailable"
    assert ranks.on_hello(0, "new", 7)  # replaced
    assert ranks.choose() == 0  # a restart of a rank that served before: requests wait for it
    assert ranks.get(0).num_restarts == 1


def test_replacement_counts_and_same_instance_is_no_replacement():
    ranks = ready_ranks(1, Clock())
    assert not ranks.on_hello(0, "i0", 1000)
    assert ranks.on_hello(0, "i0-b", 1001)
    assert ranks.summary()["dp_ranks"]["0"]["state"] == "starting"
    assert ranks.on_ready(0, 256) and not ranks.on_ready(0, 256)


def test_silent_rank_is_down_for_health_and_last_choice_for_routing():
    clock = Clock()
    ranks = ready_ranks(2, clock)
    clock.now += 3
    ranks.heard(1)
    clock.now += 3  # rank 0 silent for 6 s, rank 1 for 3 s
    assert ranks.summary()["up"] == [1] and ranks.summary()["dp_ranks"]["0"]["state"] == "unresponsive"
    ranks.get(1).num_in_flight = 50
    assert ranks.choose() == 1  # heard from lately beats less loaded
    clock.now += 10
    assert ranks.summary()["status"] == "unavailable" and ranks.choose() in (0, 1)  # still routable: they may return


def test_a_rank_beyond_the_configured_size_is_served():
    ranks = DpRanks(1, clock=Clock())
    ranks.on_hello(3, "x", 1)
    ranks.on_ready(3, 128)
    assert ranks.choose() == 3 and "3" in ranks.summary()["dp_ranks"]


def test_the_ranks_vsup_gave_up_on_are_read_from_its_state_file(tmp_path):
    from engine.api_server import supervisor_state

    path = tmp_path / "state.json"
    assert supervisor_state.read(str(path)) == {} and supervisor_state.read(None) == {}  # not written yet
    path.write_text(json.dumps({"units": {"engine-core dp1": {"state": "failed", "restarts": 0},
                                          "worker-group dp2": {"state": "failed", "restarts": 5},
                                          "engine-core dp0": {"state": "running", "restarts": 3},
                                          "api-server a0": {"state": "failed", "restarts": 5}},
                                "processes": [{"role": "worker", "restarts": 2}, {"role": "worker", "restarts": 1}]}))
    state = supervisor_state.read(str(path))
    failed = supervisor_state.failed_ranks(state)
    assert sorted(failed) == [1, 2] and "engine-core dp1 after 0 restarts (--max-restarts)" in failed[1]
    assert supervisor_state.restarts_by_role(state, ("worker", "coordinator")) == {"worker": 3, "coordinator": 0}
    path.write_text("{half")
    assert supervisor_state.read(str(path)) == {}
