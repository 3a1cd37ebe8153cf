"""Backoff and start limit: 0.5 s, x2, cap 30 s, reset after 60 s, 5 in 300 s."""

import pytest

from vsup.supervisor.restart_policy import RestartPolicy, RestartState


def test_backoff_doubles_to_the_cap_then_the_limit_fails_the_unit():
    state = RestartState(RestartPolicy(max_restarts=8, window_s=10_000))
    delays = [state.next_delay(now=t, started_at=t) for t in range(9)]
    assert delays == [0.5, 1, 2, 4, 8, 16, 30, 30, None]
    assert state.total == 8


def test_healthy_running_resets_the_backoff():
    state = RestartState(RestartPolicy())
    assert [state.next_delay(t, t) for t in (0, 1, 2)] == [0.5, 1, 2]
    assert state.next_delay(now=100, started_at=30) == 0.5


def test_start_limit_counts_only_the_window():
    state = RestartState(RestartPolicy(max_restarts=2, window_s=300))
    assert state.next_delay(0, 0) is not None and state.next_delay(1, 1) is not None
    assert state.next_delay(2, 2) is None
    assert state.next_delay(400, 399) is not None  # the old restarts left the window


@pytest.mark.parametrize("policy,code,expected", [
    ("on-failure", 1, True), ("on-failure", None, True), ("on-failure", 0, False),
    ("always", 0, True), ("never", 1, False), ("never", None, False),
])
def test_policy_decides_what_is_restarted(policy, code, expected):
    assert RestartState(RestartPolicy(policy)).wants_restart(code) is expected
    assert RestartState(RestartPolicy(policy)).wants_restart(code, requested=True)


def test_bad_policy_names_the_flag():
    with pytest.raises(ValueError, match="--restart-policy"):
        RestartPolicy("sometimes")


def test_restart_max_delay_caps_the_backoff():
    state = RestartState(RestartPolicy(max_restarts=8, max_s=2.0))
    assert [state.next_delay(now=float(i), started_at=float(i)) for i in range(5)] == [0.5, 1.0, 2.0, 2.0, 2.0]
    assert RestartState(RestartPolicy(max_s=0.1)).next_delay(now=0.0, started_at=0.0) == 0.1  # below the first
    with pytest.raises(ValueError, match="--restart-max-delay"):
        RestartPolicy(max_s=0)
