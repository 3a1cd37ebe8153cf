"""The LOAD column and the diagnoses of `vsup ps`, pure: exact strings for exact snapshots."""

from vsup.diagnosis import STALE_S, device_memory, diagnose, load_figures, summary


def api(name, loop, tokenize, requests=16):
    return {"name": name, "role": "api-server", "dp": None,
            "load": {"busy": {"loop": loop, "tokenize": tokenize}, "rates": {}, "num_requests": requests}}


def core(dp, steps, running=0, waiting=0, kv=0.1, kv_stalls=0.0):
    return {"name": f"engine-core dp{dp}", "role": "engine-core", "dp": dp,
            "load": {"busy": {"step": steps}, "rates": {"kv_stalls": kv_stalls}, "num_running": running,
                     "num_waiting": waiting, "kv_cache_usage": kv}}


def test_an_api_server_busy_tokenising_while_the_core_waits_is_the_bottleneck():
    assert diagnose([api("api-server a0", 0.99, 0.97), core(0, 0.12, running=3)]) == [
        "api-server a0 is the bottleneck: 97% busy tokenising while engine-core dp0 steps 12% of the time; "
        "add --api-server-count"]
    # busy, but not with tokenizing: the figure is the loop's
    assert diagnose([api("api-server a0", 0.9, 0.1), core(0, 0.2)]) == [
        "api-server a0 is the bottleneck: 90% busy while engine-core dp0 steps 20% of the time; "
        "add --api-server-count"]


def test_no_bottleneck_while_the_core_steps_or_the_api_server_has_room():
    assert diagnose([api("api-server a0", 0.99, 0.97), core(0, 0.6)]) == []  # the engine is the limit
    assert diagnose([api("api-server a0", 0.5, 0.4), core(0, 0.1)]) == []
    assert diagnose([api("api-server a0", 0.99, 0.97)]) == []  # no core reported: nothing to compare with
    # the busiest core decides: one rank stepping most of the time is not waiting on the API servers
    assert diagnose([api("api-server a0", 0.99, 0.97), core(0, 0.1), core(1, 0.7)]) == []


def test_requests_waiting_for_kv_blocks_say_raise_kv_cache_memory():
    assert diagnose([core(0, 0.9, running=2, waiting=14, kv=0.89, kv_stalls=12.5)]) == [
        "KV cache full (89%, 12.5 steps/s wait for blocks), 14 requests waiting: raise --kv-cache-memory"]
    assert diagnose([core(0, 0.9, running=2, waiting=0, kv=0.99, kv_stalls=3)]) == []  # full, but nobody waits
    # waiting with room in the cache: held back by the batch limits (--max-num-seqs), not by the cache
    assert diagnose([core(0, 0.9, running=2, waiting=14, kv=0.99)]) == []
    assert diagnose([core(0, 0.9, running=20, waiting=20, kv=0.99, kv_stalls=9),
                     core(1, 0.9, running=20, waiting=20, kv=0.5)])[0] \
        .startswith("KV cache full on engine-core dp0 (99%, 9.0 steps/s wait for blocks), 20 requests waiting")


def test_an_idle_rank_beside_a_queue_is_named():
    assert diagnose([core(0, 0.9, running=8, waiting=30, kv=0.5), core(1, 0.0)]) == [
        "dp1 idle while dp0 has 30 waiting: the API servers route by the coordinator's load figures; "
        "see `vsup logs --role coordinator`"]
    assert diagnose([core(0, 0.9, running=8, waiting=3, kv=0.5), core(1, 0.0)]) == []  # a short queue


def test_a_report_counts_only_for_its_own_pid_and_while_recent():
    record = {"pid": 7, "received_at": 100.0, "window_s": 2.0, "busy": {"step": 0.5}, "rates": {},
              "num_running": 1, "event": "load", "level": "info", "name": "engine-core dp0"}
    assert load_figures(record, 7, 101.0) == {"window_s": 2.0, "busy": {"step": 0.5}, "rates": {}, "num_running": 1}
    assert load_figures(record, 8, 101.0) is None  # a restarted process: the old one's figures are not its
    assert load_figures(record, 7, 100.0 + STALE_S + 0.1) is None
    assert load_figures(None, 7, 101.0) is None


def test_the_load_column_and_device_memory_per_role():
    assert summary("api-server", api("a", 0.42, 0.3)["load"]) == "loop 42%, tokenizing 30%, 16 requests"
    assert summary("engine-core", core(0, 0.12, 2, 14, 0.98)["load"]) == "steps 12%, 2 running, 14 waiting, KV 98%"
    assert summary("worker", {"busy": {"forward": 0.11}, "rates": {}}) == "forward 11%"
    assert summary("coordinator", {"busy": {}, "rates": {"waves": 2.5, "load_reports": 10.0}, "lockstep": True}) \
        == "2.5 waves/s, 10.0 load reports/s"
    assert summary("worker", None) == "-"
    assert device_memory({"weight_bytes": 100, "kv_cache_bytes": 20}) == 120
    assert device_memory({"weight_bytes": 100, "kv_cache_bytes": 20, "device_reserved_bytes": 500}) == 500
    assert device_memory(None) is None
