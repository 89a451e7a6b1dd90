"""Prefix caching through the whole cluster, with the `openai` client: a multi-turn conversation
gives the engine's own greedy tokens while its turns hit the cache (disaggregated: the prefill
pod's cache; colocated: the decode pod's KV pool, whose kept blocks a turn is seated over, only the
rest computed), the gateway's `vllm:prefix_cache_*` counters count it,
and with two prefill pods a shared prefix is routed to the pod that holds it; when that pod is
SIGKILLed its cache is lost, never a request."""
from __future__ import annotations

import os
import re
import signal
import time

import httpx
import openai
import pytest

from tandem_core.types import SamplingParams
from tandem_engine import load_engine

from tests.e2e.conftest import start_local, stop_local

pytestmark = pytest.mark.e2e
SYSTEM = [0] + [300 + (i * 53) % 1500 for i in range(63)]  # 64 tokens: 4 blocks of 16


@pytest.fixture(scope="module")
def engine():
    return load_engine("builtin", slots=2, max_len=512)


def reference(engine, prompt: list[int], n: int) -> list[int]:
    prefix = engine.prefill(prompt, SamplingParams())
    out = [prefix.first_token]
    state = engine.insert(prefix, engine.init_state(), 0, SamplingParams())
    while len(out) < n:
        state, toks = engine.generate(state, 2)
        out.append(int(toks[0]))
    return out


def text(ids: list[int]) -> str:
    from tandem_core.models import resolve_model
    from tandem_core.tokenizer import load_tokenizer
    return load_tokenizer(resolve_model("builtin")).decode(ids)


def client(c) -> openai.OpenAI:
    return openai.OpenAI(base_url=c.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)


def counter(c, name: str) -> float:
    """The sum over every label set of a metric on the gateway's /metrics."""
    text = httpx.get(c.base_url + "/metrics", timeout=10).text
    return sum(float(v) for v in re.findall(rf"^{re.escape(name)}(?:{{[^}}]*}})? ([0-9.e+]+)$", text, re.M))


def cache_of(c) -> dict[str, dict]:
    workers = httpx.get(c.base_url + "/admin/cluster", timeout=10).json()["workers"]
    return {w["id"]: w["extra"].get("prefix_cache", {}) for w in workers}


def until(fn, timeout_s: float = 15.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got = fn()
        if got:
            return got
        time.sleep(0.25)
    return fn()


def turn_prompt(k: int) -> list[int]:
    """Turn k of one conversation: the system prompt, then k user/assistant exchanges."""
    out = list(SYSTEM)
    for i in range(k):
        out += [400 + 7 * i + j for j in range(12)] + [900 + 5 * i + j for j in range(9)]
    return out


def test_a_conversation_hits_the_cache_and_keeps_its_tokens(both_paths, engine):
    c = both_paths
    hits0 = counter(c, "vllm:prefix_cache_hits_total")
    before = cache_of(c)
    sent = 0
    for k in range(1, 4):
        prompt = turn_prompt(k)
        sent += len(prompt)
        got = client(c).completions.create(model=c.model, prompt=prompt, max_tokens=8, temperature=0,
                                           extra_body={"ignore_eos": True})
        assert got.choices[0].text == text(reference(engine, prompt, 8)), f"turn {k}"
    # turns 2 and 3 hit at least the system prompt's 4 blocks (turn 3 also turn 2's exchange)
    assert until(lambda: counter(c, "vllm:prefix_cache_hits_total") - hits0 >= 2 * len(SYSTEM))
    assert counter(c, "vllm:prefix_cache_queries_total") >= counter(c, "vllm:prefix_cache_hits_total")
    if not any(w.startswith("prefill") for w in before):  # colocated: the decode pod's pool did it
        def grown() -> dict | None:
            (wid, now), = cache_of(c).items()
            d = {f: now[f] - before.get(wid, {}).get(f, 0) for f in ("queries", "hits", "computed")}
            return d if d["queries"] >= sent else None
        d = until(grown)
        assert d is not None and d["hits"] >= 2 * len(SYSTEM), d
        assert d["computed"] == d["queries"] - d["hits"] == sent - d["hits"], d  # only the uncached rest computed


@pytest.fixture(scope="module")
def two_prefill_pods():
    c = start_local(prefill=2, decode=1, slots=4)
    try:
        yield c
    finally:
        stop_local(c.proc)


def test_a_shared_prefix_goes_to_the_pod_that_holds_it(two_prefill_pods, engine):
    c = two_prefill_pods
    prompts = [turn_prompt(k % 3 + 1) for k in range(1, 7)]
    for prompt in prompts:  # one after another: the routed pod is never behind
        got = client(c).completions.create(model=c.model, prompt=prompt, max_tokens=4, temperature=0,
                                           extra_body={"ignore_eos": True})
        assert got.usage.completion_tokens == 4
    sent = sum(len(p) for p in prompts)

    def counted():  # once every prompt is in the pods' heartbeats
        cs = cache_of(c)
        return cs if sum(x.get("queries", 0) for w, x in cs.items() if w.startswith("prefill")) >= sent else None

    caches = until(counted)
    # each prompt counted once in the cluster, by the pod that prefilled it: the decode pod's pulls
    # reuse its pool's blocks (extra.kv_reuse) but are not prefix-cache queries
    assert sum(x.get("queries", 0) for x in caches.values()) == sent, caches
    holders = [wid for wid, s in caches.items() if wid.startswith("prefill") and s.get("queries")]
    assert len(holders) == 1, f"every turn should have gone to one prefill pod: {caches}"
    s = caches[holders[0]]
    assert s["hits"] >= 5 * len(SYSTEM), s  # every request after the first found the system prompt
    assert counter(c, "tandem_prefix_route_total") >= 6


def test_killing_the_pod_that_holds_the_prefix_loses_no_request(two_prefill_pods, engine):
    c = two_prefill_pods
    caches = cache_of(c)
    holder = max((w for w in caches if w.startswith("prefill")), key=lambda w: caches[w].get("queries", 0))
    pid = next(w["pid"] for w in httpx.get(c.base_url + "/admin/cluster", timeout=10).json()["workers"]
               if w["id"] == holder)
    os.kill(pid, signal.SIGKILL)
    prompt = turn_prompt(3)
    got = client(c).completions.create(model=c.model, prompt=prompt, max_tokens=6, temperature=0,
                                       extra_body={"ignore_eos": True})
    assert got.choices[0].text == text(reference(engine, prompt, 6))
