"""Pieces of the gateway's front door that need no Redis and no sockets: the resume start index,
chat templates, per-key limits (a fake clock) and the inference-extension load gauges. The HTTP
input checks against a real Redis are tests/integration/test_gateway_api.py."""
from __future__ import annotations

import json

import pytest

from gateway.chat import ChatTemplate, default_template
from gateway.limits import KeyLimiter
from gateway.metrics import cluster_load
from gateway.resume import start_index
from tandem_core.errors import AdmissionRejected, InvalidRequest
from tandem_core.models import resolve_model
from tests.unit.clock import Clock


def test_start_index():
    assert start_index(None, None) == 0
    assert start_index("4", None) == 5 and start_index(" 4 ", "2") == 5 and start_index("1", "7") == 7
    with pytest.raises(InvalidRequest):
        start_index("-1", None)


# ---------------------------------------------------------------- chat templates


def test_default_template():
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    assert default_template(msgs) == "<|system|>\nbe brief\n<|user|>\nhi\n<|assistant|>\n"
    assert ChatTemplate().render(msgs) == default_template(msgs) and ChatTemplate().kind == "default"


def test_model_template_from_tokenizer_config(tmp_path):
    pytest.importorskip("jinja2")
    src = ("{{ bos_token }}{% for m in messages %}{% if m.role == 'system' and not loop.first %}"
           "{{ raise_exception('system must come first') }}{% endif %}[{{ m.role }}]{{ m.content }}{{ eos_token }}"
           "{% endfor %}{% if add_generation_prompt %}[assistant]{% endif %}")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": [{"name": "default", "template": src}], "bos_token": {"content": "<s>"},
         "eos_token": "</s>"}))
    info = resolve_model("tiny").__class__(**{**resolve_model("tiny").__dict__, "path": str(tmp_path)})
    t = ChatTemplate.for_model(info)
    assert t.kind == "model"
    # The template writes BOS itself: its text is kept, and encoded without adding specials.
    assert t.render([{"role": "user", "content": "hi"}]) == "<s>[user]hi</s>[assistant]"
    assert not t.add_special_tokens and ChatTemplate().add_special_tokens
    with pytest.raises(InvalidRequest, match="system must come first"):
        t.render([{"role": "user", "content": "a"}, {"role": "system", "content": "b"}])
    assert ChatTemplate("{% for %}").kind == "default"  # a broken template falls back, logged


# ---------------------------------------------------------------- per-key limits


def test_concurrency_limit_per_key():
    lim = KeyLimiter(max_concurrent=2, tokens_per_minute=0, lease_ttl_s=30, retry_after_s=2, clock=Clock())
    a = lim.acquire("k1", 10)
    lim.acquire("k1", 10)
    with pytest.raises(AdmissionRejected, match="2 concurrent") as e:
        lim.acquire("k1", 10)
    assert e.value.retry_after_s == 2 and e.value.http_status == 429
    lim.acquire("k2", 10)  # another key has its own count
    a.release(5)
    a.release(5)  # idempotent
    lim.acquire("k1", 10)


def test_tokens_per_minute_window_refund_and_lost_leases():
    clock = Clock()
    lim = KeyLimiter(max_concurrent=1, tokens_per_minute=100, lease_ttl_s=30, retry_after_s=1, clock=clock)
    lease = lim.acquire("k", 60)
    lease.release(20)  # 40 of the 60 reserved were not generated: refunded
    clock.t += 10
    lim.acquire("k", 80).release(80)  # 20 + 80 = 100: fits exactly
    clock.t += 10
    with pytest.raises(AdmissionRejected) as e:
        lim.acquire("k", 20)
    assert e.value.retry_after_s == pytest.approx(40)  # the first entry (20 tokens) leaves at t+60
    with pytest.raises(AdmissionRejected) as e:
        lim.acquire("k", 30)
    assert e.value.retry_after_s == pytest.approx(50)  # 30 needs the second entry gone too (t+70)
    with pytest.raises(InvalidRequest, match="more than the limit"):
        lim.acquire("k", 101)  # can never pass: 400, not 429
    clock.t += 41
    lost = lim.acquire("k", 10)  # never released ...
    clock.t += 31
    lim.acquire("k", 10)  # ... its slot comes back after lease_ttl_s
    assert not lost.released


# ---------------------------------------------------------------- load gauges


def test_cluster_load_for_the_inference_extension():
    workers = [
        {"role": "decode", "slots": 8, "free_slots": 2, "draining": False},
        {"role": "decode", "slots": 8, "free_slots": 8, "draining": True},  # draining: not counted
        {"role": "prefill", "held_kv_bytes": 900, "extra": {"kv_budget_bytes": 1000}},
    ]
    assert cluster_load(workers, 5, 3) == (8, 6, 0.9)
    assert cluster_load(workers[:1], 0, 0) == (0, 6, 0.75)
    assert cluster_load([], 4, 0) == (4, 0, 0.0)


def test_cluster_load_reads_kv_blocks_of_paged_decode_pods():
    """A paged decode pod's KV usage is its blocks used / blocks, not its rows (which stay rows: 2
    of 32 rows in use here while 90 of 100 blocks are taken); slot-layout pods still count rows."""
    paged = {"role": "decode", "slots": 32, "free_slots": 30, "draining": False,
             "extra": {"kv": {"layout": "paged", "blocks_total": 100, "blocks_free": 10}}}
    slotted = {"role": "decode", "slots": 8, "free_slots": 6, "draining": False}
    assert cluster_load([paged], 0, 0) == (0, 2, 0.9)
    assert cluster_load([paged, slotted], 1, 0) == (1, 4, 0.9)  # the fuller pool
    assert cluster_load([slotted], 0, 0) == (0, 2, 0.25)
