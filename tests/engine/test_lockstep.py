"""--dp-lockstep: the coordinator's wave barrier (pure, then as a process with fake cores over real
sockets), and the dummy step every worker runs when its rank has no work."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
import torch
import zmq

from engine.coordinator.waves import WaveBarrier
from engine.core.wave_follower import WaveFollower
from engine.wire.protocol import CoreLoad, WaveEnd, WaveGo, WaveReport, coordinator_out, encoder, from_waves
from engine.wire.scheduler_output import SchedulerOutput


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def barrier(ranks=(0, 1), **kwargs):
    clock = Clock()
    b = WaveBarrier(ranks, "e1", clock=clock, **kwargs)
    return b, clock


def report(b, rank, has_work, step=None, wave=None, epoch=None):
    return b.on_report(WaveReport(rank, b.epoch if epoch is None else epoch, b.wave if wave is None else wave,
                                  b.step if step is None else step, has_work))


# the barrier, pure


def test_a_wave_runs_while_any_rank_has_work_and_ends_when_none_has():
    b, clock = barrier()
    b.heard(0), b.heard(1)
    assert report(b, 1, False, step=-1) == []  # a rank without work starts nothing
    assert report(b, 0, True, wave=-1, step=-1, epoch="") == [WaveGo("e1", 0, 0, [0, 1])]
    assert report(b, 0, True) == []  # the barrier waits for rank 1
    assert report(b, 1, False) == [WaveGo("e1", 0, 1, [0, 1])]  # rank 0 still has work: step again
    assert report(b, 1, False) == []
    assert report(b, 0, False) == [WaveEnd("e1", 0)]
    assert not b.running and b.wave == 1 and b.num_steps == 2
    # the next request starts wave 1
    assert report(b, 1, True, wave=0, step=1) == [WaveGo("e1", 1, 0, [0, 1])]


def test_new_work_after_saying_none_keeps_the_wave_going():
    b, clock = barrier()
    b.heard(0), b.heard(1)
    report(b, 0, True, step=-1)
    assert report(b, 0, False) == []
    assert report(b, 0, True) == []  # a request came before the others answered: the latest word wins
    assert report(b, 1, False) == [WaveGo("e1", 0, 1, [0, 1])]


def test_a_stale_or_foreign_report_never_completes_a_step():
    b, clock = barrier()
    b.heard(0), b.heard(1)
    report(b, 0, True, step=-1)
    report(b, 0, True)
    assert report(b, 1, False, step=-1) == []       # not this step
    assert report(b, 1, False, epoch="old") == []   # not this coordinator's step
    assert report(b, 1, False, wave=7) == []
    assert report(b, 1, False) == [WaveGo("e1", 0, 1, [0, 1])]


def test_a_rank_that_never_joined_or_went_silent_holds_nobody_up():
    b, clock = barrier(ranks=(0, 1, 2))
    b.heard(0), b.heard(1)  # rank 2 never joined
    clock.now += 2  # past the startup grace
    assert report(b, 0, True, step=-1) == [WaveGo("e1", 0, 0, [0, 1])]
    report(b, 0, True)
    clock.now += 3  # rank 1: 5 s since heard, the step has waited 3 s
    assert b.tick() == [WaveGo("e1", 0, 0, [0, 1])]  # still waited for: the go goes out again
    clock.now += 0.1  # rank 1: silent past 5 s
    assert b.tick() == [WaveGo("e1", 0, 1, [0])]
    assert report(b, 0, False) == [WaveEnd("e1", 0)]


def test_a_live_rank_that_leaves_a_go_unanswered_is_left_out_until_it_answers():
    b, clock = barrier()
    b.heard(0), b.heard(1)
    report(b, 0, True, step=-1)
    report(b, 0, True)
    for _ in range(10):  # rank 1's heartbeats come, its reports do not (it cannot hear the gos)
        clock.now += 0.5
        b.heard(1)
        out = b.tick()
        if out and out[0].step == 1:
            break
        assert out in ([], [WaveGo("e1", 0, 0, [0, 1])])  # the go, published again
    assert out == [WaveGo("e1", 0, 1, [0])] and b.deaf == {1}
    assert report(b, 0, True) == [WaveGo("e1", 0, 2, [0])]  # no waiting for rank 1 now
    assert report(b, 1, False, step=0) == []  # late, but it answers: back in, and waited for
    assert b.waited() == {0, 1} and not b.deaf
    assert report(b, 0, True) == []
    clock.now += 0.5
    assert b.tick() == [WaveGo("e1", 0, 2, [0, 1])]  # published again: rank 1 syncs to step 2
    assert report(b, 1, False) == [WaveGo("e1", 0, 3, [0, 1])]


def test_the_go_is_published_again_while_the_barrier_waits():
    b, clock = barrier(republish_s=0.5)
    b.heard(0), b.heard(1)
    report(b, 0, True, step=-1)
    clock.now += 0.4
    assert b.tick() == [] and 0.09 < b.seconds_to_tick() <= 0.1
    clock.now += 0.1
    assert b.tick() == [WaveGo("e1", 0, 0, [0, 1])]


def test_a_rank_that_rejoins_mid_wave_is_waited_for_from_the_next_go():
    b, clock = barrier()
    b.heard(0)
    clock.now += 2
    report(b, 0, True, step=-1)
    assert report(b, 0, True) == [WaveGo("e1", 0, 1, [0])]
    b.heard(1)  # a replacement core: its first heartbeat
    assert report(b, 0, True) == []  # now the barrier waits for rank 1
    clock.now += 0.5
    assert b.tick() == [WaveGo("e1", 0, 1, [0, 1])]  # rank 1 hears it, runs step 1 and is in step
    assert report(b, 1, False) == [WaveGo("e1", 0, 2, [0, 1])]


def test_a_new_coordinator_waits_for_every_core_heartbeat_before_its_first_wave():
    b, clock = barrier(startup_grace_s=1.5)
    b.heard(0)
    assert report(b, 0, True, epoch="old", wave=41, step=3) == []  # rank 1 not heard yet
    assert 1.4 < b.seconds_to_tick() <= 1.5
    b.heard(1)
    assert b.tick() == [WaveGo("e1", 0, 0, [0, 1])]
    b2, clock2 = barrier(startup_grace_s=1.5)
    b2.heard(0)
    report(b2, 0, True, step=-1)
    clock2.now += 1.5  # rank 1 never came: go without it
    assert b2.tick() == [WaveGo("e1", 0, 0, [0])]


def test_with_every_rank_gone_the_wave_ends():
    b, clock = barrier()
    b.heard(0), b.heard(1)
    report(b, 0, True, step=-1)
    clock.now += 6
    assert b.tick() == [WaveEnd("e1", 0)]


# the coordinator process, fake cores over real sockets


# the core's half, pure


def follower(**kwargs):
    clock = Clock()
    return WaveFollower(1, clock=clock, **kwargs), clock


def test_a_follower_runs_each_go_once_and_reports_the_step_it_ran():
    f, clock = follower()
    assert f.wants_report(has_work=True)  # work and no wave: ask for one
    assert f.report(True) == WaveReport(1, "", -1, -1, True)
    assert not f.wants_report(has_work=True)  # asked; wait for the go
    assert f.on_wave(WaveGo("e1", 0, 0, [0, 1])) is False and f.in_wave
    assert f.take_go() == (0, 0) and f.take_go() is None
    f.stepped((0, 0))
    assert f.report(False) == WaveReport(1, "e1", 0, 0, False)
    f.on_wave(WaveGo("e1", 0, 0, [0, 1]))  # published again while others lag: nothing to run twice
    assert f.take_go() is None
    f.on_wave(WaveEnd("e1", 0))
    assert not f.in_wave


def test_a_go_published_again_for_the_step_we_ran_asks_for_our_report_again():
    f, _ = follower()
    f.on_wave(WaveGo("e1", 2, 5, [0, 1]))
    f.stepped(f.take_go())
    assert f.on_wave(WaveGo("e1", 2, 5, [0, 1])) is True  # our report may have been lost
    assert f.on_wave(WaveGo("e1", 2, 4, [0, 1])) is False  # an older go: nothing


def test_the_newest_go_wins_and_a_go_of_an_ended_wave_is_dropped():
    f, _ = follower()
    f.on_wave(WaveGo("e1", 0, 1, [0, 1]))
    f.on_wave(WaveGo("e1", 0, 3, [0, 1]))  # fell behind: sync to the newest
    assert f.take_go() == (0, 3)
    f.on_wave(WaveGo("e1", 1, 0, [0, 1]))
    f.on_wave(WaveEnd("e1", 1))  # the wave ended without us: running its go would step alone
    assert f.take_go() is None


def test_a_new_coordinator_starts_the_follower_afresh():
    f, _ = follower()
    f.on_wave(WaveGo("e1", 7, 2, [0, 1]))
    f.stepped(f.take_go())
    f.on_wave(WaveGo("e2", 0, 0, [0, 1]))  # its waves count from 0 again: not taken for stale ones
    assert f.epoch == "e2" and f.take_go() == (0, 0)


def test_with_work_and_no_go_the_follower_asks_again_after_resync():
    f, clock = follower(resync_s=2.0)
    f.report(True)
    clock.now += 1.9
    assert not f.wants_report(has_work=True)
    clock.now += 0.2
    assert f.wants_report(has_work=True)
    assert not f.wants_report(has_work=False)  # nothing to ask for


def test_coordinator_process_runs_waves_leaves_a_dead_rank_out_and_drops_malformed(tmp_path):
    addresses = {k: f"ipc://{tmp_path}/{k}.sock" for k in ("in", "out", "waves")}
    proc = subprocess.Popen([sys.executable, "-m", "engine.coordinator", "--data-parallel-size", "3", "--dp-lockstep",
                             "--input-address", addresses["in"], "--output-address", addresses["out"],
                             "--wave-address", addresses["waves"]], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    ctx = zmq.Context()
    push, waves, load = ctx.socket(zmq.PUSH), ctx.socket(zmq.SUB), ctx.socket(zmq.SUB)
    for sub in (waves, load):
        sub.setsockopt(zmq.SUBSCRIBE, b"")
    push.connect(addresses["in"])
    waves.connect(addresses["waves"])
    load.connect(addresses["out"])

    def next_wave_message(timeout_s=3.0):
        assert waves.poll(timeout_s * 1000), "no wave message"
        return from_waves.decode(waves.recv())

    try:
        assert load.poll(15_000), "the coordinator did not start"
        # ranks 0 and 1 live (heartbeats); rank 2 never joins. Rank 1 then dies mid-wave.
        push.send(encoder.encode(CoreLoad(0, 0, 0, 0)))
        push.send(encoder.encode(CoreLoad(1, 0, 0, 0)))
        push.send(b"\xc1 not msgpack")
        push.send(encoder.encode(WaveReport(0, "", -1, -1, True)))
        go = next_wave_message()
        assert isinstance(go, WaveGo) and (go.wave, go.step, go.ranks) == (0, 0, [0, 1])
        epoch = go.epoch
        for step in range(3):  # both step; rank 0 has work
            push.send(encoder.encode(WaveReport(0, epoch, 0, step, True)))
            push.send(encoder.encode(WaveReport(1, epoch, 0, step, False)))
            while (go := next_wave_message()).step == step:
                pass  # a go published again
            assert (go.wave, go.step, go.ranks) == (0, step + 1, [0, 1])
        # rank 1 goes silent; rank 0 keeps its heartbeat: the barrier goes on without rank 1 within ~5 s
        silent_since = time.monotonic()
        push.send(encoder.encode(WaveReport(0, epoch, 0, 3, True)))
        while True:
            assert time.monotonic() - silent_since < 60, "the barrier still waits for a dead rank"
            push.send(encoder.encode(CoreLoad(0, 0, 1, 3)))
            if not waves.poll(500):
                continue
            go = from_waves.decode(waves.recv())
            assert isinstance(go, WaveGo)
            if go.step == 4:
                break
        assert go.ranks == [0] and time.monotonic() - silent_since > 4.0  # its liveness timeout, not before
        push.send(encoder.encode(WaveReport(0, epoch, 0, 4, False)))
        end = next_wave_message()
        while isinstance(end, WaveGo):
            end = next_wave_message()
        assert end == WaveEnd(epoch, 0)
        # the counters reach the API servers
        push.send(encoder.encode(CoreLoad(0, 0, 0, 5, 0, 1)))
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            assert load.poll(2000)
            stats = coordinator_out.decode(load.recv())
            if stats.counters.get(0) == [5, 0, 1]:
                break
        assert stats.counters[0] == [5, 0, 1]
    finally:
        for sock in (push, waves, load):
            sock.close(linger=0)
        ctx.term()
        proc.terminate()
        out, err = proc.communicate(timeout=10)
    lines = [json.loads(line) for line in out.splitlines() if line.startswith(b"{")]
    events = [line["event"] for line in lines]
    assert "dropped malformed message" in events, out
    assert "rank silent; the barrier goes on without it" in events


# the dummy step


BLOCK = 4


def _worker(model_dir):
    from engine.worker.worker import Worker, WorkerConfig

    worker = Worker(WorkerConfig(model=str(model_dir), kv_cache_bytes=1 << 20, block_size=BLOCK))
    worker.init_device()
    worker.load_model()
    worker.initialize_cache(16)
    return worker


def _greedy_steps(execute, prompt, num_tokens, dummy_between=False):
    """One request: prefill, then decodes, a dummy step between every two when asked."""
    from engine.wire.sampling_params import SamplingParams
    from engine.wire.scheduler_output import CachedRequest, NewRequest

    greedy = SamplingParams(temperature=0.0, max_tokens=None)
    tokens, out = list(prompt), []
    blocks = list(range(1, 1 + -(-(len(prompt) + num_tokens) // BLOCK)))
    step_id, computed = 1, 0
    while len(out) < num_tokens:
        if computed == 0:
            so = SchedulerOutput(step_id, [NewRequest("r", tokens, len(prompt), greedy, blocks, 0)], [],
                                 {"r": len(tokens)})
        else:
            so = SchedulerOutput(step_id, [], [CachedRequest("r", computed, [tokens[-1]])], {"r": 1})
        result = execute(so)
        computed = len(tokens)
        tokens.append(result.sampled_token_ids[0])
        out.append(result.sampled_token_ids[0])
        step_id += 1
        if dummy_between:
            dummy = execute(SchedulerOutput(step_id=-step_id, dummy=True))
            assert dummy.step_id == -step_id and dummy.req_ids == [] and dummy.sampled_token_ids == []
    return out


def test_dummy_step_runs_the_model_touches_no_request_kv_and_samples_nothing(tiny_model):
    worker = _worker(tiny_model("llama"))
    runner = worker.runner
    before = [(k.clone(), v.clone()) for k, v in runner.kv_caches]
    calls = []
    hook = runner.model.register_forward_hook(lambda m, args, out: calls.append(args[0].tolist()))
    result = worker.execute(SchedulerOutput(step_id=-1, dummy=True))
    hook.remove()
    assert result.step_id == -1 and not result.req_ids
    assert calls == [[0]], "a dummy step is a real forward of one token"
    assert all(torch.equal(k, k0) and torch.equal(v, v0) for (k, v), (k0, v0) in zip(runner.kv_caches, before))
    assert any(k.abs().sum() > 0 for k, _ in runner.dummy_kv_caches), "its K/V went to the scratch block"
    assert runner.requests == {}
    # dummy steps between a request's steps change none of its tokens
    prompt = [5, 17, 42, 99, 3, 250, 7]
    assert _greedy_steps(worker.execute, prompt, 6, dummy_between=True) == \
        _greedy_steps(_worker(tiny_model("llama")).execute, prompt, 6)
    worker.shutdown()


@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2)])
def test_dummy_steps_flow_through_tp_and_pp_worker_groups(tmp_path, tiny_model, tp, pp):
    """Real worker processes: dummy steps between real ones (TP collectives, PP stage to stage)
    answer, and leave the request's greedy tokens as they were without them."""
    from engine.executor.worker_group import WorkerGroup

    model_dir = tiny_model("llama_tied")
    group = WorkerGroup(f"ipc://{tmp_path}/w.sock", tp * pp, ring_prefix=f"vsup-test-{tmp_path.name}",
                        wakeup_address=f"ipc://{tmp_path}/wakeup.sock")
    procs = []
    for rank in range(tp * pp):
        argv = [sys.executable, "-m", "engine.worker", "--model", str(model_dir), "--pp-rank", str(rank // tp),
                "--tp-rank", str(rank % tp), "--tensor-parallel-size", str(tp), "--pipeline-parallel-size", str(pp),
                "--kv-cache-bytes", str(1 << 20), "--block-size", str(BLOCK), "--core-address",
                f"ipc://{tmp_path}/w.sock", "--dist-init-method", f"file://{tmp_path}/dist", "--num-threads", "1"]
        procs.append(subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      env={**os.environ, "VSUP_PROCESS_NAME": f"worker dp0 pp{rank // tp} tp{rank % tp}"}))
    try:
        group.wait_for_ready(timeout_s=120)
        group.initialize_cache()
        prompt = [5, 17, 42, 99, 3, 250, 7]
        execute = lambda so: group.execute(so, timeout_s=60)  # noqa: E731
        with_dummies = _greedy_steps(execute, prompt, 5, dummy_between=True)
        for i in range(3):  # dummy steps back to back, with no request at all
            assert group.execute(SchedulerOutput(step_id=-100 - i, dummy=True), timeout_s=60).step_id == -100 - i
        assert with_dummies == _greedy_steps(execute, prompt, 5)  # (same request id: a fresh NewRequest resets it)
        group.close()
        assert [p.wait(timeout=30) for p in procs] == [0] * (tp * pp)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait(timeout=30)
