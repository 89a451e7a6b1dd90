"""Admission control decisions of the gateway (gateway/admission.py), apart from Redis: reject at
once (429 open streams or backlog, 503 predicted time to first token past the deadline) instead of
queueing work that will miss; and the request it admits stays as validated (a frozen `Prepared`)."""
from __future__ import annotations

import dataclasses

import pytest

from gateway.cluster_view import ClusterView
from gateway.service import GatewayService
from gateway.settings import GatewaySettings
from gateway.validation import CompletionParams
from tandem_core.errors import AdmissionRejected, ServiceUnavailable


def _svc(**kw) -> GatewayService:
    return GatewayService(GatewaySettings(model="tiny", **kw))


def test_backlog_over_bound_is_429_with_retry_after():
    svc = _svc(admission_max_backlog=10, retry_after_s=2)
    with pytest.raises(AdmissionRejected) as e:
        svc.admission.check(11, ClusterView(prefill_workers=1, decode_workers=1, decode_free_slots=4))
    assert e.value.http_status == 429 and e.value.retry_after_s == 2 and "11" in e.value.message


def test_predicted_ttft_past_deadline_is_503():
    svc = _svc(first_token_timeout_s=5, admission_max_backlog=10_000)
    view = ClusterView(prefill_workers=2, decode_workers=1, decode_free_slots=0, prefill_s=0.5)
    svc.admission.check(10, view)  # (10/2 + 1) * 0.5 = 3 s: admitted
    with pytest.raises(ServiceUnavailable) as e:
        svc.admission.check(100, view)  # (100/2 + 1) * 0.5 = 25.5 s > 5 s
    assert e.value.http_status == 503 and e.value.retry_after_s >= 1
    assert "predicted time to first token is 25.5s" in e.value.message


def test_cluster_view_ignores_draining_workers():
    v = ClusterView.of([
        {"role": "prefill", "free_slots": 0, "extra": {"prefill_ema_s": 0.2}},
        {"role": "prefill", "free_slots": 0, "draining": True, "extra": {"prefill_ema_s": 9.0}},
        {"role": "decode", "free_slots": 3, "extra": {}},
    ])
    assert (v.prefill_workers, v.decode_workers, v.decode_free_slots, v.prefill_s) == (1, 1, 3, 0.2)


def test_direct_routing_counts_a_paged_decode_pods_free_blocks():
    """A paged decode pod's free rows count for direct routing only as far as its free KV blocks
    hold the prompt: 6 free rows but 10 free blocks of 16 take 2 prompts of 70 tokens (5 blocks
    each); the slot-layout pod's 3 free rows take 3."""
    paged = {"role": "decode", "free_slots": 6,
             "extra": {"kv": {"layout": "paged", "block_size": 16, "blocks_total": 64, "blocks_free": 10}}}
    v = ClusterView.of([{"role": "prefill", "free_slots": 0, "extra": {}}, paged,
                        {"role": "decode", "free_slots": 3, "extra": {}}])
    assert v.decode_free_slots == 9  # rows, as the load gauges count them
    assert v.decode_room_for(70) == 2 + 3
    assert v.decode_room_for(16) == 6 + 3
    full = ClusterView.of([{**paged, "extra": {"kv": {**paged["extra"]["kv"], "blocks_free": 0}}}])
    assert full.decode_room_for(10) == 0


def test_open_streams_at_their_bound_is_429():
    svc = _svc(max_open_streams=2, retry_after_s=3)
    view = ClusterView(prefill_workers=1, decode_workers=1, decode_free_slots=4)
    svc.streaming.open = 1
    svc.admission.check(0, view)
    svc.streaming.open = 2
    with pytest.raises(AdmissionRejected) as e:
        svc.admission.check(0, view)
    assert e.value.http_status == 429 and e.value.retry_after_s == 3 and "max_open_streams" in e.value.message


async def test_the_validated_request_is_frozen_and_completed_by_replace():
    svc = _svc()
    prep = await svc.prepare(CompletionParams(prompt="hi", max_tokens=2, stop=["x", "x"]))
    assert prep.stop == ("x",) and not prep.resumable
    with pytest.raises(dataclasses.FrozenInstanceError):
        prep.resumable = True  # type: ignore[misc]
    done = dataclasses.replace(prep, resumable=True)
    assert done.resumable and done.request is prep.request and not prep.resumable
