"""tandem_core/faults.py, the fault-at-an-await test aid: off by default, the plan's calls raise
and no others, `down` looks like Redis being down, a bad spec says what is wrong."""
from __future__ import annotations

import pytest
from redis.exceptions import ConnectionError as RedisConnectionError

from tandem_core import faults
from tandem_core.bus import conn


@pytest.fixture(autouse=True)
def _off_after():
    yield
    faults.configure("")


def calls_that_raise(site: str, n: int) -> list[int]:
    out = []
    for i in range(1, n + 1):
        try:
            faults.hit(site)
        except (faults.InjectedFault, RedisConnectionError):
            out.append(i)
    return out


def test_off_by_default_nothing_raises(monkeypatch):
    monkeypatch.delenv(faults.ENV, raising=False)
    faults._plan = None  # as in a fresh process: the environment is read at the first hit
    assert calls_that_raise("decode.publish", 50) == []


def test_the_environment_sets_the_plan_at_the_first_hit(monkeypatch):
    monkeypatch.setenv(faults.ENV, "decode.own@2")
    faults._plan = None
    assert calls_that_raise("decode.own", 5) == [2]


def test_single_range_and_open_ended_calls():
    faults.configure("decode.pull@3,decode.ack@2-4,decode.publish@5+")
    assert calls_that_raise("decode.pull", 6) == [3]
    assert calls_that_raise("decode.ack", 6) == [2, 3, 4]
    assert calls_that_raise("decode.publish", 7) == [5, 6, 7]
    assert faults.raised["decode.ack"] == 3 and faults.calls("decode.pull") == 6


def test_down_raises_what_redis_being_down_raises():
    faults.configure("decode.publish@1:down,decode.own@1")
    with pytest.raises(conn.REDIS_DOWN):
        faults.hit("decode.publish")
    with pytest.raises(faults.InjectedFault) as err:
        faults.hit("decode.own")
    assert not isinstance(err.value, conn.REDIS_DOWN)  # an error nothing retries
    assert "injected fault at decode.own (call 1)" in str(err.value)


def test_sleep_slows_the_planned_calls_and_raises_nothing(monkeypatch):
    slept: list[float] = []
    monkeypatch.setattr(faults.time, "sleep", slept.append)
    faults.configure("decode.step@2+:sleep30,decode.step@4")
    assert calls_that_raise("decode.step", 5) == [4]  # the sleep rule raises nothing, the other still fires
    assert slept == [0.03] * 4  # calls 2 to 5 (call 4 sleeps, then raises)
    assert faults.raised["decode.step"] == 1


@pytest.mark.parametrize("spec", ["nosuch.site@1", "decode.own", "decode.own@1:boom", "decode.own@x",
                                  "decode.step@1:sleep", "decode.step@1:sleepx"])
def test_a_bad_spec_says_what_is_wrong(spec):
    with pytest.raises(ValueError, match="bad fault spec"):
        faults.configure(spec)


def test_with_a_state_directory_each_planned_call_raises_once_across_process_lives(monkeypatch, tmp_path):
    monkeypatch.setenv(faults.STATE_ENV, str(tmp_path))
    faults.configure("decode.step@2")
    assert calls_that_raise("decode.step", 4) == [2]
    faults.configure("decode.step@2")  # a restarted process: its counts start again
    assert calls_that_raise("decode.step", 4) == []
    monkeypatch.delenv(faults.STATE_ENV)
    faults.configure("decode.step@2")  # without it, every life fires again
    assert calls_that_raise("decode.step", 4) == [2]
