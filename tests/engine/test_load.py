"""engine/load.py: busy shares by kind with a clock, and the reports the supervisor keeps for ps."""

import asyncio
import threading

from engine.load import LoadMeter, measure_event_loop


class Clock:
    def __init__(self):
        self.now = 10.0

    def __call__(self):
        return self.now


def test_busy_time_is_a_share_of_the_window_and_work_under_way_counts_up_to_now():
    clock = Clock()
    meter = LoadMeter(clock)
    with meter.busy("step"):
        clock.now += 0.5
    token = meter.start("step")  # still running at the report
    clock.now += 0.5
    meter.count("waves", 3)
    meter.set(num_running=2)
    assert meter.take() == {"window_s": 1.0, "busy": {"step": 1.0}, "rates": {"waves": 3.0}, "num_running": 2}
    clock.now += 1.0
    meter.stop(token)  # its first half was the last window's
    clock.now += 1.0
    assert meter.take() == {"window_s": 2.0, "busy": {"step": 0.5}, "rates": {}, "num_running": 2}


def test_overlapping_work_from_threads_is_capped_at_the_whole_window():
    clock = Clock()
    meter = LoadMeter(clock)
    a, b = meter.start("tokenize"), meter.start("tokenize")
    clock.now += 1.0
    meter.stop(a), meter.stop(b)
    assert meter.take()["busy"] == {"tokenize": 1.0}


def test_the_event_loop_is_busy_while_it_runs_callbacks_not_while_it_waits():
    meter = LoadMeter()

    async def work():
        assert measure_event_loop(meter, asyncio.get_running_loop())
        meter.take()
        await asyncio.sleep(0.3)  # idle, in select()
        idle = meter.take()["busy"].get("loop", 0.0)
        threading.Event().wait(0.3)  # blocks the loop
        await asyncio.sleep(0)
        busy = meter.take()["busy"].get("loop", 0.0)
        return idle, busy

    idle, busy = asyncio.run(work())
    assert idle < 0.2 and busy > 0.8, (idle, busy)
