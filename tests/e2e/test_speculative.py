"""Speculative decoding on the whole system (`tandem local --speculative ngram`, issue 45): the
built-in model's greedy text through the `openai` client is the same with speculation, without it
(a request's `"speculative": false`) and through a decode pod SIGKILLed while it speculated (the
request resumes on the other decode pod, which speculates too); the gateway's
vllm:spec_decode_* counters count the proposals. The colocated path (one worker prefills its
prompts and decodes them), there with a draft model's proposals (`--speculative draft
--draft-model builtin-draft`), gives the same text too, `n` = 2 choices included, and a sampled
request there gets the draft's sampled proposals, most of them kept.

The pods' gate is held in its speculating trial (gate_window very large) so every call that can
be a verify call is one, whatever this machine measures."""
from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import time

import httpx
import pytest

from tests.e2e.conftest import start_local, stop_local
from tests.e2e.fault_inject import wait_healthy
from tests.e2e.faults import FAST_HEARTBEAT

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

WANT = {"prefill": 1, "decode": 2}
# a prompt whose continuation repeats it: n-gram proposals every step, many of them kept
PROMPT = "".join(f"    self.{w} = {w}\n" for w in ("width", "indent", "expand", "replace", "drop")) * 3
SPEC_ENV = {**FAST_HEARTBEAT, "TANDEM_DECODE_HEARTBEAT_INTERVAL_S": "0.1",
            "TANDEM_DECODE_SPECULATIVE__GATE_WINDOW": "1000000", "TANDEM_DECODE_SPECULATIVE__MIN_N": "1"}


@pytest.fixture(scope="module")
def cluster():
    c = start_local("builtin", prefill=WANT["prefill"], decode=WANT["decode"], slots=4, max_len=512,
                    extra=["--speculative", "ngram", "--speculative-k", "4"], env=SPEC_ENV)
    try:
        asyncio.run(wait_healthy(c.base_url, WANT))
        _wait_spec_ready(c.base_url)
        yield c
    finally:
        stop_local(c.proc)


@pytest.fixture(scope="module")
def colocated():
    c = start_local("builtin", slots=4, max_len=512,
                    extra=["--colocated", "--speculative", "draft", "--draft-model", "builtin-draft",
                           "--speculative-k", "4"], env=SPEC_ENV)
    try:
        asyncio.run(wait_healthy(c.base_url, {"decode": 1}))
        _wait_spec_ready(c.base_url, pods=1)
        yield c
    finally:
        stop_local(c.proc)


def _workers(base: str) -> list[dict]:
    return httpx.get(base + "/admin/cluster", timeout=10).json()["workers"]


def _wait_spec_ready(base: str, pods: int = WANT["decode"], timeout_s: float = 480) -> None:
    """Until every decode pod compiled its verify call's shapes (it speculates only after), the
    grammar-masked ones too (the last of its idle-time compiles: ~230 s from start here with an
    empty compile cache, two decode pods on 2 cores)."""
    deadline = time.monotonic() + timeout_s
    while True:
        late = [w["extra"].get("late_compiles") or {} for w in _workers(base) if w["role"] == "decode"]
        if len(late) >= pods and all(x.get("done") == x.get("total") for x in late):
            return
        assert time.monotonic() < deadline, f"the decode pods' idle-time compiles did not finish: {late}"
        time.sleep(0.5)


def _drafts(base: str, name: str = "num_drafts") -> float:
    m = re.search(rf"^vllm:spec_decode_{name}_total (\S+)$", httpx.get(base + "/metrics", timeout=10).text,
                  re.MULTILINE)
    assert m, f"no vllm:spec_decode_{name}_total on /metrics"
    return float(m.group(1))


def _settle_drafts(base: str, timeout_s: float = 30) -> float:
    """The counter once the pods' heartbeats (0.1 s here) carry their last counts: the same in two
    reads 1.5 s apart (a loaded machine's heartbeats can lag a fixed wait)."""
    deadline = time.monotonic() + timeout_s
    last = _drafts(base)
    while True:
        time.sleep(1.5)
        now = _drafts(base)
        if now == last or time.monotonic() > deadline:
            return now
        last = now


def test_greedy_text_is_the_same_with_and_without_speculation(cluster):
    from openai import OpenAI

    client = OpenAI(base_url=cluster.base_url + "/v1", api_key="none", max_retries=0)
    before = _settle_drafts(cluster.base_url)
    spec = client.completions.create(model="builtin", prompt=PROMPT, max_tokens=120, temperature=0)
    after_spec = _settle_drafts(cluster.base_url)
    plain = client.completions.create(model="builtin", prompt=PROMPT, max_tokens=120, temperature=0,
                                      extra_body={"speculative": False})
    after_plain = _settle_drafts(cluster.base_url)
    assert spec.choices[0].text == plain.choices[0].text
    assert spec.usage.completion_tokens == plain.usage.completion_tokens == 120
    assert after_spec > before, "no proposal was checked: the test proved nothing"
    assert after_plain == after_spec, "a request that opted out was speculated"


def test_a_constrained_request_is_speculated_and_its_text_is_the_same(cluster):
    """A grammar (vLLM's guided_regex) that the prompt's own lines satisfy: the n-gram proposals are
    cut where the regex rejects them and checked under the mask of each position; the text is the
    one without speculation and matches the regex."""
    regex = r"(    self\.[a-z]+ = [a-z]+\n){3,8}"
    body = {"model": "builtin", "prompt": PROMPT, "max_tokens": 160, "temperature": 0, "guided_regex": regex}
    before = _settle_drafts(cluster.base_url)
    spec = httpx.post(cluster.base_url + "/v1/completions", json=body, timeout=180).json()
    after = _settle_drafts(cluster.base_url)
    plain = httpx.post(cluster.base_url + "/v1/completions", json={**body, "speculative": False}, timeout=180).json()
    text = spec["choices"][0]["text"]
    assert text == plain["choices"][0]["text"] and re.fullmatch(regex, text), (text, plain)
    assert after > before, "no proposal was checked: the test proved nothing"


def test_the_colocated_path_with_a_draft_model_gives_the_same_text_with_and_without_speculation(colocated):
    from openai import OpenAI

    client = OpenAI(base_url=colocated.base_url + "/v1", api_key="none", max_retries=0)
    before = _settle_drafts(colocated.base_url)
    spec = client.completions.create(model="builtin", prompt=PROMPT, max_tokens=120, temperature=0, n=2)
    after = _settle_drafts(colocated.base_url)
    plain = client.completions.create(model="builtin", prompt=PROMPT, max_tokens=120, temperature=0,
                                      extra_body={"speculative": False})
    assert [c.text for c in spec.choices] == [plain.choices[0].text] * 2
    assert after > before, "no proposal was checked: the test proved nothing"
    (pod,) = [w["extra"]["speculative"] for w in _workers(colocated.base_url) if w["role"] == "decode"]
    assert pod["method"] == "draft" and pod["draft"]["model"] == "tandem-tiny-py-draft" and pod["draft"]["calls"] > 0


def test_a_sampled_request_gets_the_draft_models_sampled_proposals_and_most_are_kept(colocated):
    """A sampled request (temperature 0.8, seeded) on the colocated path with the draft model:
    the draft samples its proposals at the request's parameters and hands its distribution to
    the verify call (docs/api.md), which keeps a proposal with probability min(1, p / q). The
    request streams its 120 tokens, the pod checks proposals for it, and most are kept (a greedy
    draft's argmax is kept with p(argmax) only: tests/unit/test_speculative_loop.py compares the
    two)."""
    from openai import OpenAI

    client = OpenAI(base_url=colocated.base_url + "/v1", api_key="none", max_retries=0)
    before = _settle_drafts(colocated.base_url)
    counts = {n: _drafts(colocated.base_url, n) for n in ("num_draft_tokens", "num_accepted_tokens")}
    out = client.completions.create(model="builtin", prompt=PROMPT, max_tokens=120, temperature=0.8, seed=3,
                                    extra_body={"ignore_eos": True})
    after = _settle_drafts(colocated.base_url)
    proposed, kept = (_drafts(colocated.base_url, n) - counts[n] for n in ("num_draft_tokens", "num_accepted_tokens"))
    assert out.usage.completion_tokens == 120 and out.choices[0].finish_reason == "length"
    assert after > before and proposed > 0, "no proposal was checked: the test proved nothing"
    assert kept / proposed >= 0.5, (kept, proposed)


def test_a_sampled_request_under_a_grammar_gets_drawn_proposals_and_its_text_matches(colocated):
    """A sampled request (temperature 0.8, seeded) with a grammar (vLLM's guided_regex) on the
    colocated path with the draft model: the draft's proposals are drawn from its q, kept up to
    their first token the regex rejects, which the verify call rejects surely (tandem_core/grammar.py
    Matcher.proposal_masks); the text matches the regex, with logprobs for every token, and the
    pod checked proposals for it and kept some."""
    regex = r"(    self\.[a-z]+ = [a-z]+\n){3,8}"
    _settle_drafts(colocated.base_url)
    counts = {n: _drafts(colocated.base_url, n) for n in ("num_draft_tokens", "num_accepted_tokens")}
    body = {"model": "builtin", "prompt": PROMPT, "max_tokens": 160, "temperature": 0.8, "seed": 5,
            "guided_regex": regex, "logprobs": 2}
    out = httpx.post(colocated.base_url + "/v1/completions", json=body, timeout=180).json()
    _settle_drafts(colocated.base_url)
    proposed, kept = (_drafts(colocated.base_url, n) - counts[n] for n in ("num_draft_tokens", "num_accepted_tokens"))
    choice = out["choices"][0]
    assert re.fullmatch(regex, choice["text"]), out
    assert choice["finish_reason"] in ("stop", "length") and len(choice["logprobs"]["tokens"]) == out["usage"][
        "completion_tokens"], out
    assert proposed > 0 and kept > 0, "no proposal was checked or kept: the test proved nothing"


def test_a_decode_pod_killed_while_it_speculates_resumes_the_request_with_the_same_tokens(cluster):
    seen = len(cluster.log)
    body = {"model": "builtin", "prompt": PROMPT, "max_tokens": 380, "temperature": 0, "ignore_eos": True}
    reference = httpx.post(cluster.base_url + "/v1/completions", json=body, timeout=180).json()
    chunks, killed = asyncio.run(_stream_killing_the_speculating_pod(cluster.base_url, body))
    assert killed is not None, "no decode pod was seen speculating on the request: this test proved nothing"
    assert len(chunks) == 380 and chunks[-1]["finish_reason"] == "length", (len(chunks), chunks[-1:])
    assert "".join(ch["text"] for ch in chunks) == reference["choices"][0]["text"]
    deadline = time.monotonic() + 20
    while not any("resumed request_id=" in line for line in cluster.log[seen:]):
        assert time.monotonic() < deadline, "no resume in the log:\n" + "".join(cluster.log[-40:])
        time.sleep(0.2)
    asyncio.run(wait_healthy(cluster.base_url, WANT))  # the supervisor restarted it


async def _stream_killing_the_speculating_pod(base: str, body: dict) -> tuple[list[dict], dict | None]:
    """Stream `body`; meanwhile poll the pods' heartbeats (every 0.1 s here) and SIGKILL the decode
    pod that holds the request once its proposal count has grown since the stream began. Returns
    the chunks and the killed pod's heartbeat (None: none was killed)."""
    async with httpx.AsyncClient(base_url=base, timeout=180) as c:
        start = {w["id"]: (w["extra"].get("speculative") or {}).get("drafts", 0)
                 for w in (await c.get("/admin/cluster")).json()["workers"] if w["role"] == "decode"}
        got: list[dict] = []
        killed: list[dict] = []
        done = asyncio.Event()

        async def watch() -> None:
            while not done.is_set() and not killed:
                for w in (await c.get("/admin/cluster")).json()["workers"]:
                    drafts = (w["extra"].get("speculative") or {}).get("drafts", 0)
                    if (w["role"] == "decode" and w["free_slots"] < w["slots"] and w["id"] in start
                            and drafts > start[w["id"]] and len(got) < body["max_tokens"] - 100):
                        os.kill(w["pid"], signal.SIGKILL)
                        killed.append(w)
                        return
                await asyncio.sleep(0.03)

        watcher = asyncio.create_task(watch())
        async with c.stream("POST", "/v1/completions", json={**body, "stream": True}) as resp:
            assert resp.status_code == 200, await resp.aread()
            async for line in resp.aiter_lines():
                if line.startswith("data: {"):
                    chunk = json.loads(line[6:])
                    assert "error" not in chunk, chunk
                    got += chunk["choices"]
        done.set()
        await watcher
    return got, killed[0] if killed else None
