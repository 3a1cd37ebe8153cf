"""Backoff and start limit: 0.5 s, x2, cap 30 s, reset after 60 s, 5 in 300 s."""

import pytest

from vsup.supervisor.restart_policy import Restarts, RestartPolicy, decide


def delays(policy: RestartPolicy, times, restarts: Restarts = Restarts()) -> tuple[list, Restarts]:
    """The delay decided for a failure at each (now, started_at) in turn."""
    found = []
    for now, started_at in times:
        decision = decide(policy, restarts, now, started_at, failure=True)
        restarts = decision.restarts
        found.append(decision.delay)
    return found, restarts


def test_backoff_doubles_to_the_cap_then_the_limit_fails_the_unit():
    found, restarts = delays(RestartPolicy(max_restarts=8, window_s=10_000), [(t, t) for t in range(9)])
    assert found == [0.5, 1, 2, 4, 8, 16, 30, 30, None]
    assert restarts.total == 8
    assert decide(RestartPolicy(max_restarts=8, window_s=10_000), restarts, 9, 9, True).why_not == \
        "8 restarts within 10000 s"


def test_healthy_running_resets_the_backoff():
    found, restarts = delays(RestartPolicy(), [(t, t) for t in (0, 1, 2)])
    assert found == [0.5, 1, 2]
    assert decide(RestartPolicy(), restarts, now=100, started_at=30, failure=True).delay == 0.5


def test_start_limit_counts_only_the_window():
    found, restarts = delays(RestartPolicy(max_restarts=2, window_s=300), [(0, 0), (1, 1), (2, 2)])
    assert None not in found[:2] and found[2] is None
    # the old restarts left the window
    assert decide(RestartPolicy(max_restarts=2, window_s=300), restarts, 400, 399, True).delay is not None


@pytest.mark.parametrize("policy,failure,expected", [
    ("on-failure", True, True), ("on-failure", False, False),
    ("always", False, True), ("always", True, True), ("never", True, False), ("never", False, False),
])
def test_policy_decides_what_is_restarted(policy, failure, expected):
    decision = decide(RestartPolicy(policy), Restarts(), 0.0, 0.0, failure)
    assert (decision.delay is not None) is expected
    assert decision.why_not == (None if expected else f"--restart-policy {policy}")


def test_a_restart_asked_for_counts_only_in_the_total():
    restarts = Restarts((1.0,), 0.5, 1).asked()
    assert restarts == Restarts((1.0,), 0.5, 2)


def test_bad_policy_names_the_flag():
    with pytest.raises(ValueError, match="--restart-policy"):
        RestartPolicy("sometimes")


def test_restart_max_delay_caps_the_backoff():
    found, _ = delays(RestartPolicy(max_restarts=8, max_s=2.0), [(float(i), float(i)) for i in range(5)])
    assert found == [0.5, 1.0, 2.0, 2.0, 2.0]
    assert decide(RestartPolicy(max_s=0.1), Restarts(), 0.0, 0.0, True).delay == 0.1  # below the first
    with pytest.raises(ValueError, match="--restart-max-delay"):
        RestartPolicy(max_s=0)
