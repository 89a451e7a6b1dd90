"""Issue 30's two reuse paths on the whole cluster as a user runs it (`tandem local`, the `openai`
client): conversations on two paged decode pods (the prefill pod's prefix cache: its pool of blocks
on the device).

- The prefill pod's hits read the cached blocks in place: its `hit_copy_bytes` stays 0 while its
  hits count the conversations' earlier turns (tandem_engine/prefix_pool.py).
- The gateway steers each turn to the decode pod that decoded the conversation's last turn
  (gateway/decode_route.py); that pod keeps each finished turn's blocks and pulls only the
  positions after them (tandem_engine/block_cache.py, `PullKVRequest.from_position`). So with two
  decode pods too, every later turn pulls no more than its new tokens and one block: a turn that
  landed on the other pod would pull the whole conversation again.
- Every turn's text is the engine's own greedy run of the whole prompt.
"""
from __future__ import annotations

import os
import re
import signal

import httpx
import pytest

from tests.e2e.conftest import start_local, stop_local
from tests.e2e.test_prefix_cache import SYSTEM, client, counter, reference, text, until

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def engine():
    from tandem_engine import load_engine

    return load_engine("builtin", slots=2, max_len=512)


@pytest.fixture(scope="module")
def reuse_cluster():
    c = start_local(slots=2, decode=2, timeout_s=900)
    try:
        yield c
    finally:
        stop_local(c.proc)


def _workers(c) -> list[dict]:
    return httpx.get(c.base_url + "/admin/cluster", timeout=10).json()["workers"]


def _decode(c) -> dict[str, int]:
    """The decode pods' counts, summed (each turn runs alone: the difference is that turn's)."""
    out = {"pulled": 0, "tokens": 0, "pulled_kv_bytes": 0, "reused": 0, "pods": 0}
    for w in _workers(c):
        if w["role"] == "decode":
            x = w["extra"]
            out["pods"] += 1
            for k in ("pulled", "tokens", "pulled_kv_bytes"):
                out[k] += x[k]
            out["reused"] += (x.get("kv_reuse") or {}).get("reused_tokens", 0)  # (None: the pod keeps no blocks)
    return out


def _routes(c, reason: str) -> float:
    """The gateway's decode routing decisions with this reason."""
    got = re.search(rf'^tandem_decode_route_total{{reason="{reason}"}} ([0-9.e+]+)$',
                    httpx.get(c.base_url + "/metrics", timeout=10).text, re.M)
    return float(got.group(1)) if got else 0.0


def _prefill(c) -> dict:
    return next(w["extra"] for w in _workers(c) if w["role"] == "prefill")


def _turn(c, engine, prompt: list[int], per_token: int) -> tuple[list[int], int, int]:
    """One turn alone on the cluster: (its tokens, KV bytes pulled, prompt positions not pulled)."""
    before = until(lambda: (lambda d: d if d["pods"] == 2 else None)(_decode(c)))
    want = reference(engine, prompt, 8)
    got = client(c).completions.create(model=c.model, prompt=prompt, max_tokens=8, temperature=0,
                                       extra_body={"ignore_eos": True})
    assert got.choices[0].text == text(want), len(prompt)

    def settled(pulls=before["pulled"] + 1, tokens=before["tokens"] + 7):  # this turn is in the heartbeats
        d = _decode(c)
        return d if d["pulled"] >= pulls and d["tokens"] >= tokens else None

    after = until(settled)
    moved, reused = after["pulled_kv_bytes"] - before["pulled_kv_bytes"], after["reused"] - before["reused"]
    # the pull moved exactly the positions the decode pod did not hold (a whole one: the prompt's
    # bucket, padding included, as the prefill pod holds it)
    rows = len(prompt) - reused if reused else 1 << (len(prompt) - 1).bit_length()
    assert moved == rows * per_token, (moved, reused, len(prompt))
    return want, moved, reused


def test_conversations_move_only_new_kv_and_copy_no_hit(reuse_cluster, engine):
    c = reuse_cluster
    cfg = engine.cfg
    per_token = cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * 4  # float32 KV
    steered = counter(c, "tandem_decode_route_total")
    # two conversations, turns interleaved; the second does not share the first's system prompt
    prompts = [list(SYSTEM) + [400 + j for j in range(21)], [1] + [700 + j for j in range(84)]]
    moved: list[list[int]] = [[], []]
    reused: list[list[int]] = [[], []]
    for turn in range(3):
        for k in range(2):
            want, m, u = _turn(c, engine, prompts[k], per_token)
            moved[k].append(m)
            reused[k].append(u)
            prompts[k] = prompts[k] + want + [900 + 10 * turn + j for j in range(11)]  # the reply, a new message
    for k in range(2):
        assert reused[k][0] == 0 and reused[k][1] > 0 and reused[k][2] > reused[k][1], (k, reused)
        # turns 2 and 3 pulled less than one block more than their new tokens (8 of reply + 11 of
        # message): each went to the pod holding the conversation's last turn
        assert all(m <= (8 + 11 + 16) * per_token for m in moved[k][1:]), (k, moved)
    hits = _routes(c, "prefix_hit")
    assert hits >= 4, f"{hits} of {counter(c, 'tandem_decode_route_total') - steered} turns steered by prefix"
    pre = _prefill(c)["prefix_cache"]
    assert pre["hits"] >= 2 * len(SYSTEM), pre
    assert pre["hit_copy_bytes"] == 0, pre


def test_a_turn_steered_to_a_paused_decode_pod_is_taken_by_the_other(reuse_cluster, engine):
    """The decode pod holding a conversation stops (SIGSTOP: alive in the registry for a few seconds
    more, so the gateway still steers the next turn to it); the other pod takes the ready notice
    after `affinity_wait_ms` and the turn's text is still the engine's own."""
    c = reuse_cluster
    prompt = [2] + [1100 + j for j in range(70)]
    before = {w["id"]: w["extra"]["pulled"] for w in _workers(c) if w["role"] == "decode"}
    want = reference(engine, prompt, 8)
    got = client(c).completions.create(model=c.model, prompt=prompt, max_tokens=8, temperature=0,
                                       extra_body={"ignore_eos": True})
    assert got.choices[0].text == text(want)

    def holder():
        now = {w["id"]: w for w in _workers(c) if w["role"] == "decode"}
        moved = [i for i, w in now.items() if w["extra"]["pulled"] > before.get(i, 0)]
        return now[moved[0]] if moved else None

    held = until(holder)
    other = next(w for w in _workers(c) if w["role"] == "decode" and w["id"] != held["id"])
    stolen = other["extra"]["stolen"]
    hits = _routes(c, "prefix_hit")
    prompt = prompt + want + [1300 + j for j in range(11)]
    want = reference(engine, prompt, 8)
    os.kill(held["pid"], signal.SIGSTOP)
    try:
        got = client(c).completions.create(model=c.model, prompt=prompt, max_tokens=8, temperature=0,
                                           extra_body={"ignore_eos": True})
        assert got.choices[0].text == text(want)
        assert _routes(c, "prefix_hit") == hits + 1  # steered to the paused pod, which still looked alive
        until(lambda: next(w for w in _workers(c) if w["id"] == other["id"])["extra"]["stolen"] > stolen)
    finally:
        os.kill(held["pid"], signal.SIGCONT)
    until(lambda: len([w for w in _workers(c) if w["role"] == "decode"]) == 2, timeout_s=30)
