"""Data parallelism under `vsup serve`: requests spread over the ranks with the tokens of DP=1, and
--dp-lockstep: no rank steps alone while another has work (read from the per-rank step counters
in /metrics); without it, an idle rank does not step."""

from __future__ import annotations

import os
import signal
import threading

import httpx
import pytest

from tests.e2e.served import Streams, complete, complete_all
from tests.polling import wait_for

def test_dp2_spreads_requests_over_both_ranks_with_the_tokens_of_dp1(serve):
    dp1, dp2 = serve(name="dp1"), serve("-dp", "2", name="dp2")  # both start at once
    dp1.wait_serving(), dp2.wait_serving()
    prompts = [f"request {i} says" for i in range(16)]
    before = dp2.settled_counters()
    spread = complete_all(dp2.client, prompts, n=8)
    alone = [complete(dp1.client, p, n=8) for p in prompts]
    assert all(spread) and spread == alone
    after = dp2.settled_counters()
    took = {r: after[r][2] - before.get(r, (0, 0, 0))[2] for r in after}
    assert sorted(took) == [0, 1] and sum(took.values()) == 16, after
    assert min(took.values()) >= 3, f"requests not spread over the ranks: {took}"
    assert all(after[r][0] > before.get(r, (0, 0, 0))[0] and after[r][1] == 0 for r in after), after
    for s in (dp1, dp2):
        assert s.stop()[0] == 0


def deltas(before, after):
    return {r: tuple(a - b for a, b in zip(after[r], before.get(r, (0, 0, 0)))) for r in after}


@pytest.mark.parametrize("lockstep,flags", [(True, []), (False, []), (True, ["-pp", "2"])],
                         ids=["lockstep", "independent", "lockstep-pp2"])
def test_idle_rank_steps_with_the_busy_one_only_in_lockstep(serve, lockstep, flags):
    s = serve("-dp", "2", *(["--dp-lockstep"] if lockstep else []), *flags)
    s.wait_serving()
    seen = set()
    for i in range(3):  # one request at a time: it lands on one rank, the other is idle
        before = s.settled_counters()
        assert len(complete(s.client, f"one at a time {i}", n=6, stream=False)) > 0
        change = deltas(before, s.settled_counters())
        busy = [r for r, (_, _, took) in change.items() if took]
        assert len(busy) == 1 and sorted(change) == [0, 1], change
        busy, idle = busy[0], 1 - busy[0]
        seen.add(busy)
        steps, dummies, _ = change[busy]
        assert steps >= 6 and dummies == 0, change  # a prefill and a decode per further token at least
        if lockstep:  # every step of the busy rank had the idle rank's dummy step beside it
            assert change[idle][0] == 0 and abs(change[idle][1] - steps) <= 1, change
        else:  # the idle rank did not step at all
            assert change[idle][:2] == (0, 0), change
    assert s.stop()[0] == 0


def test_lockstep_survives_a_coordinator_restart_mid_request(serve):
    s = serve("-dp", "2", "--dp-lockstep")
    s.wait_serving()
    prompt, n = "the coordinator dies", 200
    reference = complete(s.client, prompt, n=n, stream=False)
    coordinator = next(p["pid"] for p in s.ps()["processes"] if p["name"] == "coordinator")
    streaming, chunks = threading.Event(), []

    def stream():
        for chunk in s.client.completions.create(model="tiny", prompt=prompt, max_tokens=n, temperature=0,
                                                 stream=True, extra_body={"ignore_eos": True}):
            chunks.append(chunk.choices[0].text if chunk.choices else "")
            streaming.set()

    thread = threading.Thread(target=stream)
    thread.start()
    assert streaming.wait(30)
    os.kill(coordinator, signal.SIGKILL)
    assert thread.is_alive(), "the request ended before the coordinator died: make it longer"
    thread.join(timeout=60)
    assert "".join(chunks) == reference  # the cores waited for the new coordinator, then went on
    s.wait_serving(timeout=60)  # the coordinator is back
    before = s.settled_counters()
    assert complete(s.client, "and after", n=6, stream=False)
    change = deltas(before, s.settled_counters())
    busy = next(r for r, c in change.items() if c[2])
    assert abs(change[1 - busy][1] - change[busy][0]) <= 1, change  # the new coordinator keeps them in step
    code, out, err = s.stop()
    assert code == 0
    assert "a new coordinator runs the waves; following it" in out  # (a stall of ~2 s may be logged too)


def test_a_draining_rank_gets_no_new_request_while_another_can_take_them(serve):
    """`vsup restart --role worker --dp 0` under 8 streams drains dp0 (its running requests finish, then
    its workers restart): the requests that come meanwhile go to dp1 instead of waiting in dp0's queue
    for the restart, and every stream completes."""
    s = serve("-dp", "2", "--max-model-len", "512")  # the tiny model's longest: streams that outlast a busy /health
    s.wait_serving()
    streams = Streams(s.client, [f"story {i}" for i in range(8)], n=480)
    wait_for(streams.all_streaming, timeout=60, what="8 streams under way")
    restart = threading.Thread(target=lambda: s.vsup("restart", "--role", "worker", "--dp", "0"))
    restart.start()

    def draining():
        ranks = httpx.get(f"{s.url}/health", timeout=10).json().get("dp_ranks", {})
        return ranks.get("0", {}).get("draining")
    try:
        wait_for(draining, timeout=30, what="dp0 draining, as the API servers see it")
        assert streams.running(), "every stream ended before the drain: make them longer"
        took = {r: c[2] for r, c in s.counters().items()}  # requests each core took so far
        assert all(complete(s.client, f"while dp0 drains {i}", n=4) for i in range(6))
        now = wait_for(lambda: (c := s.counters()) and c[1][2] >= took[1] + 6 and c, timeout=60,
                       what="dp1's count of the 6 requests")
        assert now[0][2] == took[0] and now[1][2] == took[1] + 6, (took, now)
    finally:
        restart.join(timeout=120)
    assert all(isinstance(t, str) for t in streams.texts())
    assert s.stop()[0] == 0
