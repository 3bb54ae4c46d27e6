"""The L3 and user-state circuit breaker: opens after failures in a row, one trial after the cooldown."""

import pytest

from recserve.backends.store.redis_tier import CLOSED, HALF_OPEN, OPEN, CircuitBreaker


def opened() -> tuple[CircuitBreaker, list[float]]:
    now = [0.0]
    breaker = CircuitBreaker(2, 1.0, clock=lambda: now[0])
    breaker.failure()
    assert breaker.state == CLOSED and breaker.allow()
    breaker.failure()
    assert breaker.state == OPEN and not breaker.allow()
    now[0] = 1.0
    assert breaker.allow() and breaker.state == HALF_OPEN
    assert not breaker.allow()  # one trial at a time
    return breaker, now


def test_a_trial_that_returns_closes_the_breaker():
    breaker, _ = opened()
    breaker.trial(lambda: None)
    assert breaker.state == CLOSED and breaker.consecutive == 0 and breaker.allow()


@pytest.mark.parametrize("error", [TimeoutError, ConnectionError, RuntimeError])
def test_a_trial_that_raises_opens_it_for_another_cooldown(error):
    def away():
        raise error("still away")

    breaker, now = opened()
    breaker.trial(away)
    assert breaker.state == OPEN and breaker.opened_at == 1.0 and breaker.opened_total == 2
    now[0] = 1.5
    assert not breaker.allow()
    now[0] = 2.0
    assert breaker.allow()
