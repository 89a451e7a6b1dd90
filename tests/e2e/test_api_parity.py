"""OpenAI parity through the whole cluster, with the real clients (`openai`, `langchain-openai`):
logprobs, n, penalties, logit_bias, min_tokens, echo, chat without max_tokens. Each runs through
the disaggregated cluster (a long prompt: prefill pod -> KV pull -> decode pod; a short one: the
decode pod prefills it itself) and through a colocated cluster. Greedy tokens are checked against
the engine run in this process with the same processing, so "correct tokens" is checked, not
just shapes."""
from __future__ import annotations

import math
import time

import httpx
import openai
import pytest

from tests.e2e.conftest import until_quiet

from tandem_core.types import SamplingParams
from tandem_engine import load_engine


pytestmark = pytest.mark.e2e
LONG = [0] + [300 + (i * 37) % 1500 for i in range(40)]  # > direct_prefill_max_tokens: the prefill pod
SHORT = [0, 400, 401, 402]  # routed straight to the decode pod, which prefills it
EOS = 1


@pytest.fixture(scope="module")
def engine():
    return load_engine("builtin", slots=2, max_len=512)


def _client(c) -> openai.OpenAI:
    return openai.OpenAI(base_url=c.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)


def reference(engine, prompt: list[int], n: int, sampling: SamplingParams, stop_ids=(EOS,)) -> list[int]:
    """Greedy tokens from the engine in this process: prefill, insert, generate (penalties on)."""
    prefix = engine.prefill(prompt, sampling, stop_ids=list(stop_ids))
    out = [prefix.first_token]
    state = engine.insert(prefix, engine.init_state(), 0, sampling, history=prompt, stop_ids=list(stop_ids))
    while len(out) < n and out[-1] not in stop_ids:
        state, toks = engine.generate(state, 2)
        out.append(int(toks[0]))
    return out


@pytest.mark.parametrize("prompt", [LONG, SHORT], ids=["prefill-pod", "decode-prefills"])
def test_penalties_and_bias_give_the_engines_tokens(both_paths, engine, prompt):
    client = _client(both_paths)
    kw = dict(frequency_penalty=1.5, presence_penalty=0.5, logit_bias={"300": 5})
    got = client.completions.create(model=both_paths.model, prompt=prompt, max_tokens=12, temperature=0,
                                    extra_body={"repetition_penalty": 1.3, "ignore_eos": True}, **kw)
    s = SamplingParams(frequency_penalty=1.5, presence_penalty=0.5, repetition_penalty=1.3, logit_bias=((300, 5.0),))
    want = reference(engine, prompt, 12, s, stop_ids=())
    plain = reference(engine, prompt, 12, SamplingParams(), stop_ids=())
    assert want != plain, "the penalties must change these tokens, or this test proves nothing"
    assert got.choices[0].text == engine_text(want) and got.usage.completion_tokens == 12


def engine_text(ids: list[int]) -> str:
    from tandem_core.models import resolve_model
    from tandem_core.tokenizer import load_tokenizer
    return load_tokenizer(resolve_model("builtin")).decode(ids)


@pytest.mark.parametrize("prompt", [LONG, SHORT], ids=["prefill-pod", "decode-prefills"])
def test_completion_logprobs_and_echo(both_paths, engine, prompt):
    client = _client(both_paths)
    r = client.completions.create(model=both_paths.model, prompt=prompt, max_tokens=6, temperature=0, logprobs=3,
                                  echo=True, extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(prompt) + 6 == len(lp.token_logprobs) == len(lp.top_logprobs)
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    for tok_lp, top in zip(lp.token_logprobs[len(prompt):], lp.top_logprobs[len(prompt):]):
        assert len(top) <= 3 and math.isclose(tok_lp, max(top.values()), abs_tol=1e-4)  # greedy: the best
    assert lp.text_offset == sorted(lp.text_offset)
    # the first output token's logprobs are the engine's, to float precision
    logits_lp = engine.prompt_logprobs(prompt, 3)
    pairs = zip(lp.token_logprobs[1:len(prompt)], logits_lp[1:])
    assert all(math.isclose(a, b.logprob, abs_tol=1e-3) for a, b in pairs)
    prefix = engine.prefill(prompt, SamplingParams(logprobs=3))
    assert math.isclose(lp.token_logprobs[len(prompt)], prefix.first_logprobs[0].logprob, abs_tol=1e-3)
    echoed = engine_text(prompt)
    assert r.choices[0].text.startswith(echoed)

    chunks = list(client.completions.create(model=both_paths.model, prompt=prompt, max_tokens=6, temperature=0,
                                            logprobs=3, stream=True, extra_body={"ignore_eos": True}))
    streamed = [x for ch in chunks for x in ch.choices[0].logprobs.token_logprobs]
    assert streamed == pytest.approx(lp.token_logprobs[len(prompt):], abs=1e-6)


def test_chat_logprobs_streamed_and_whole(both_paths):
    client = _client(both_paths)
    msgs = [{"role": "user", "content": "def add(a, b):"}]
    whole = client.chat.completions.create(model=both_paths.model, messages=msgs, max_tokens=8, temperature=0,
                                           logprobs=True, top_logprobs=4)
    content = whole.choices[0].logprobs.content
    assert len(content) == whole.usage.completion_tokens
    for c in content:
        assert len(c.top_logprobs) == 4 and c.logprob == pytest.approx(c.top_logprobs[0].logprob, abs=1e-5)
        assert bytes(c.bytes).decode("utf-8", "replace") == c.token
    chunks = list(client.chat.completions.create(model=both_paths.model, messages=msgs, max_tokens=8, temperature=0,
                                                 logprobs=True, top_logprobs=4, stream=True))
    streamed = [c for ch in chunks if ch.choices and ch.choices[0].logprobs for c in ch.choices[0].logprobs.content]
    assert [c.token for c in streamed] == [c.token for c in content]


@pytest.mark.parametrize("prompt", [LONG, SHORT], ids=["prefill-pod", "decode-prefills"])
def test_n_choices_one_request(both_paths, prompt):
    client = _client(both_paths)
    r = client.completions.create(model=both_paths.model, prompt=prompt, max_tokens=10, temperature=1.0, seed=11, n=3,
                                  extra_body={"ignore_eos": True})
    assert sorted(c.index for c in r.choices) == [0, 1, 2]
    assert r.usage.completion_tokens == 30
    texts = [c.text for c in sorted(r.choices, key=lambda c: c.index)]
    assert len(set(texts)) > 1, "independent seeds: three samples should not all agree"
    again = client.completions.create(model=both_paths.model, prompt=prompt, max_tokens=10, temperature=1.0,
                                      seed=11, n=3,
                                      extra_body={"ignore_eos": True})
    assert [c.text for c in sorted(again.choices, key=lambda c: c.index)] == texts  # seeded: reproducible
    # streamed: chunks tagged by choice assemble to the same texts
    parts = {0: "", 1: "", 2: ""}
    for ch in client.completions.create(model=both_paths.model, prompt=prompt, max_tokens=10, temperature=1.0, seed=11,
                                        n=3, stream=True, extra_body={"ignore_eos": True}):
        for c in ch.choices:
            parts[c.index] += c.text
    assert [parts[i] for i in range(3)] == texts
    # choice 0 of n is the request with n=1 and the same seed
    one = client.completions.create(model=both_paths.model, prompt=prompt, max_tokens=10, temperature=1.0, seed=11,
                                    extra_body={"ignore_eos": True})
    assert one.choices[0].text == texts[0]


def test_min_tokens_holds_back_eos(both_paths):
    client = _client(both_paths)
    r = client.completions.create(model=both_paths.model, prompt=SHORT, max_tokens=10, temperature=0,
                                  logit_bias={str(EOS): 100}, extra_body={"min_tokens": 3})
    assert r.usage.completion_tokens == 4 and r.choices[0].finish_reason == "stop"
    r = client.completions.create(model=both_paths.model, prompt=LONG, max_tokens=10, temperature=0,
                                  logit_bias={str(EOS): 100})
    assert r.usage.completion_tokens == 1 and r.choices[0].finish_reason == "stop"


def test_chat_without_max_tokens_runs_to_the_context_end(both_paths):
    client = _client(both_paths)
    r = client.chat.completions.create(model=both_paths.model, messages=[{"role": "user", "content": "x = 1"}],
                                       temperature=0, extra_body={"ignore_eos": True})
    assert r.choices[0].finish_reason == "length"
    assert r.usage.prompt_tokens + r.usage.completion_tokens == both_paths.max_len


def _decode_counters(base: str) -> dict:
    workers = httpx.get(base + "/admin/cluster", timeout=10).json()["workers"]
    dec = [w for w in workers if w["role"] == "decode"]
    assert len(dec) == 1, workers
    return {"free": int(dec[0]["free_slots"]) == int(dec[0]["slots"]), **dec[0]["extra"]}


def test_cancel_frees_every_choice(both_paths):
    """A streamed n=3 request dropped after its first chunk: the decode pod cancels all three choices
    (its cancel counter: three `cancelled` finishes), long before their 400 tokens (its token
    counter), and all three slots come back. Slots alone would not tell: natural completion frees
    them too."""
    base = both_paths.base_url
    before = until_quiet(base)  # an earlier test's last tokens and cancels counted before, not in, this one
    with httpx.stream("POST", base + "/v1/completions", timeout=60,
                      json={"model": both_paths.model, "prompt": LONG, "max_tokens": 400, "n": 3, "stream": True,
                            "temperature": 1.0, "ignore_eos": True}) as resp:
        assert resp.status_code == 200, resp.read()[:300]
        for line in resp.iter_lines():
            if line.startswith("data: {"):
                break
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        now = _decode_counters(base)
        if now["free"] and now["cancelled"] - before["cancelled"] >= 3:
            break
        time.sleep(0.3)
    assert now["free"], f"slots not freed after the client left: {now}"
    assert now["cancelled"] - before["cancelled"] == 3, f"the decode pod did not cancel the 3 choices: {now}"
    assert now["tokens"] - before["tokens"] < 3 * 399 // 2, f"the choices ran on after the client left: {now}"


def test_langchain_logprobs_and_n(both_paths):
    from langchain_core.messages import HumanMessage
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(model=both_paths.model, base_url=both_paths.base_url + "/v1", api_key="unused", temperature=0,
                     max_tokens=6, logprobs=True, max_retries=0)
    msg = llm.invoke("def add(a, b):")
    content = msg.response_metadata["logprobs"]["content"]
    assert len(content) == msg.response_metadata["token_usage"]["completion_tokens"]
    assert all(c["logprob"] <= 0 for c in content)
    many = ChatOpenAI(model=both_paths.model, base_url=both_paths.base_url + "/v1", api_key="unused", temperature=1.0,
                      max_tokens=6, n=2, max_retries=0)
    gens = many.generate([[HumanMessage("def add(a, b):")]]).generations[0]
    assert len(gens) == 2 and all(isinstance(g.text, str) for g in gens)


def test_grpc_generate_with_n_logprobs_and_penalties(both_paths, engine):
    """The gRPC front end takes the same fields: n choices tagged by choice_index, each token with
    its logprob and top alternatives, penalties giving the engine's tokens."""
    import grpc

    from tandem_proto import generate_pb2, generate_pb2_grpc

    with grpc.insecure_channel(f"127.0.0.1:{both_paths.grpc_port}") as ch:
        stub = generate_pb2_grpc.TandemStub(ch)
        req = generate_pb2.GenerateRequest(
            prompt_token_ids=LONG, max_tokens=6, n=2, logprobs=2, ignore_eos=True,
            sampling=generate_pb2.SamplingParameters(temperature=0, frequency_penalty=1.5, repetition_penalty=1.3))
        got: dict[int, list] = {0: [], 1: []}
        for resp in stub.Generate(req, timeout=120):
            got[resp.choice_index].append(resp)
    want = reference(engine, LONG, 6, SamplingParams(frequency_penalty=1.5, repetition_penalty=1.3), stop_ids=())
    for choice in (0, 1):
        assert [r.token_id for r in got[choice]] == want
        assert got[choice][-1].finish_reason == "length"
        for r in got[choice]:
            assert len(r.top_logprobs) == 2 and r.top_logprobs[0].token_id == r.token_id
            assert r.logprob == pytest.approx(r.top_logprobs[0].logprob)
