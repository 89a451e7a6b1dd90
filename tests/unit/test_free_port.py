"""`tandem.redis_proc.free_port`: ports a server binds later, never ones the kernel hands out to clients."""
from __future__ import annotations

import socket

from tandem import redis_proc
from tandem.redis_proc import _ephemeral_low, free_port


def test_free_ports_lie_below_the_ephemeral_range_are_distinct_and_bindable():
    low = _ephemeral_low()
    ports = [free_port() for _ in range(50)]
    assert len(set(ports)) == len(ports)
    assert all(1024 < p < low for p in ports), (low, ports)
    for p in ports[:5]:
        with socket.socket() as s:
            s.bind(("127.0.0.1", p))


def test_a_port_in_use_is_passed_over(monkeypatch):
    with socket.socket() as listener:
        listener.bind(("0.0.0.0", 0))
        busy = listener.getsockname()[1] % 10000 + 20000
    with socket.socket() as held:
        try:
            held.bind(("127.0.0.1", busy))
        except OSError:  # something else holds it already: in use either way
            pass
        held.listen()
        tries = iter([busy, busy + 1, busy + 2, busy + 3])
        monkeypatch.setattr(redis_proc._RANDOM, "randrange", lambda lo, hi: next(tries))
        assert free_port() != busy
