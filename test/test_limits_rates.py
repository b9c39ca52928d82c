"""A rate of several windows ("20 per second; 600 per minute", as RATE_LIMIT_EVENTS' default)
holds in each of them (zwdx/server/limits.py): the per-minute part was not counted when only the
first window was read. Fast lane, in process."""
from __future__ import annotations

import pytest

from zwdx.errors import RateLimited
from zwdx.server import limits
from zwdx.server.limits import RateLimits


def test_every_window_of_a_rate_is_held(app, monkeypatch):
    ctx = app.extensions["zwdx"]
    monkeypatch.setattr(ctx, "settings", ctx.settings.replace(RATE_LIMIT_EVENTS="1000 per second; 2 per minute",
                                                              RATE_LIMIT_ROOMS="5 per minute; 1 per day"))
    monkeypatch.setattr(ctx, "limiter", RateLimits("memory://"))
    with app.test_request_context():
        limits.check_event_rate("j1", 0)
        limits.check_event_rate("j1", 0)
        with pytest.raises(RateLimited):  # under 1000 a second, over 2 a minute
            limits.check_event_rate("j1", 0)
        assert ctx.limiter.hit("RATE_LIMIT_ROOMS", "rooms")
        assert not ctx.limiter.allowed("RATE_LIMIT_ROOMS", "rooms")  # the day's window is full
        assert not ctx.limiter.hit("RATE_LIMIT_ROOMS", "rooms")


def test_a_donor_tokens_registers_are_held_to_each_window(app):
    limiter = RateLimits("memory://")
    with app.test_request_context():
        assert limiter.hit_rate("100 per minute; 1 per hour", "registers", "t1")
        assert not limiter.hit_rate("100 per minute; 1 per hour", "registers", "t1")
        assert limiter.hit_rate("100 per minute; 1 per hour", "registers", "t2")  # another token
