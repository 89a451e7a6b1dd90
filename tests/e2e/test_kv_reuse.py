"""Issue 30's two reuse paths on the whole cluster as a user runs it (`tandem local`, the `openai`
client): a conversation on a paged decode pod with the prefill pod's prefix cache on the device.

- The prefill pod's hits read the cached blocks in place: its `hit_copy_bytes` stays 0 while its
  hits count the conversation's earlier turns (tandem_engine/prefix_pool.py).
- The decode pod keeps each finished turn's blocks and pulls only the positions after them for
  the next turn: the KV bytes it pulls per turn are the turn's tokens it did not hold
  (tandem_engine/block_cache.py, `PullKVRequest.from_position`).
- Every turn's text is the engine's own greedy run of the whole prompt.
"""
from __future__ import annotations

import httpx
import pytest

from tests.e2e.conftest import start_local, stop_local
from tests.e2e.test_prefix_cache import SYSTEM, client, reference, text, until

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def engine():
    from tandem_engine import load_engine

    return load_engine("builtin", slots=2, max_len=512)


@pytest.fixture(scope="module")
def reuse_cluster():
    c = start_local(slots=2, extra=["--kv-layout", "paged"], timeout_s=600,
                    env={"TANDEM_PREFILL_PREFIX_CACHE__ON_DEVICE": "true"})
    try:
        yield c
    finally:
        stop_local(c.proc)


def _extras(c) -> dict[str, dict]:
    workers = httpx.get(c.base_url + "/admin/cluster", timeout=10).json()["workers"]
    return {w["id"].split("-")[0]: w["extra"] for w in workers}


def _reused(decode: dict) -> int:
    return (decode.get("kv_reuse") or {}).get("reused_tokens", 0)  # (None: the pod keeps no blocks)


def test_a_conversation_moves_only_new_kv_and_copies_no_hit(reuse_cluster, engine):
    c = reuse_cluster
    cfg = engine.cfg
    per_token = cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * 4  # float32 KV
    prompt = list(SYSTEM) + [400 + j for j in range(21)]
    moved, reused = [], []
    for turn in range(3):
        before = until(lambda: _extras(c).get("decode"))
        want = reference(engine, prompt, 8)
        got = client(c).completions.create(model=c.model, prompt=prompt, max_tokens=8, temperature=0,
                                           extra_body={"ignore_eos": True})
        assert got.choices[0].text == text(want), f"turn {turn + 1}"
        def settled(pulls=before["pulled"] + 1, tokens=before["tokens"] + 7):  # this turn is in the heartbeat
            x = _extras(c)["decode"]
            return x if x["pulled"] >= pulls and x["tokens"] >= tokens else None

        after = until(settled)
        moved.append(after["pulled_kv_bytes"] - before["pulled_kv_bytes"])
        reused.append(_reused(after) - _reused(before))
        # the pull moved exactly the positions the decode pod did not hold (a whole one: the
        # prompt's bucket, padding included, as the prefill pod holds it)
        rows = len(prompt) - reused[-1] if reused[-1] else 1 << (len(prompt) - 1).bit_length()
        assert moved[-1] == rows * per_token, (turn, moved, reused, len(prompt))
        prompt = prompt + want + [900 + 10 * turn + j for j in range(11)]  # the reply, then a new message
    assert reused[0] == 0 and reused[1] > 0 and reused[2] > reused[1], reused
    # turns 2 and 3 pulled less than one block more than their new tokens (8 of reply + 11 of message)
    assert all(m <= (8 + 11 + 16) * per_token for m in moved[1:]), moved
    pre = _extras(c)["prefill"]["prefix_cache"]
    assert pre["on_device"] and pre["hits"] >= 2 * len(SYSTEM), pre
    assert pre["hit_copy_bytes"] == 0, pre
