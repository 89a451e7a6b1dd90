from __future__ import annotations

from tandem_core import keys
from tandem_core.scheduling import PriorityRotation, choose_route, predicted_ttft_s

KS = keys.KeySpace(1)  # a plain Redis: one key shard (a service builds its own from its settings)


def test_high_first_but_low_gets_a_share():
    rot = PriorityRotation(KS, "p", high_weight=4)
    orders = [rot.next_order() for _ in range(100)]
    high, low = KS.admission_stream("p", "high", 0), KS.admission_stream("p", "normal", 0)
    assert sum(o[0] == high for o in orders) == 80
    assert sum(o[0] == low for o in orders) == 20
    # Never more than high_weight reads in a row put low last.
    run = longest = 0
    for o in orders:
        run = run + 1 if o[0] == high else 0
        longest = max(longest, run)
    assert longest == 4


def test_routes():
    kw = dict(direct_max_tokens=32, backlog=0, prefill_workers=2, decode_free_slots=4, backlog_threshold=8)
    assert choose_route(10, **kw).reason == "short_prompt"
    assert choose_route(100, **kw) .reason == "remote"
    assert choose_route(100, **{**kw, "backlog": 8}).reason == "prefill_backlog"
    assert choose_route(100, **{**kw, "backlog": 8, "decode_free_slots": 0}).direct is False
    assert choose_route(100, **{**kw, "prefill_workers": 0}).reason == "no_prefill_workers"


def test_predicted_ttft_grows_with_backlog_and_shrinks_with_workers():
    assert predicted_ttft_s(0, 1, 0.1) == 0.1
    assert predicted_ttft_s(10, 1, 0.1) > predicted_ttft_s(10, 2, 0.1) > predicted_ttft_s(0, 2, 0.1)
