"""n choices merged and logprobs in OpenAI's shapes: pure pieces of the gateway, no sockets."""
from __future__ import annotations

import asyncio

import pytest

from gateway.choices import merge
from gateway.logprobs import TokenText
from gateway.relay import Delta
from gateway.resume import StreamMeta
from gateway.sse import Formatter
from prefill_svc.kv_store import KVStore
from tandem_core.tokenizer import ByteTokenizer
from tandem_core.types import KVPayload, TokenLogprobs

import numpy as np


async def _gen(items, delay=0.0, fail=None):
    for d in items:
        await asyncio.sleep(delay)
        yield d
    if fail:
        raise fail


def _d(i, text, fin=None, n=0, lp=None):
    return Delta(i, 65 + i, text, fin, n, logprobs=lp)


def test_merge_tags_choices_and_counts_every_token():
    async def run():
        a = _gen([_d(0, "a", None, 1), _d(1, "b", "length", 2)])
        b = _gen([_d(0, "x", None, 1), _d(1, "y", None, 2), _d(2, "z", "stop", 3)], delay=0.001)
        return [d async for d in merge([a, b])]

    out = asyncio.run(run())
    assert sorted((d.choice, d.text) for d in out) == [(0, "a"), (0, "b"), (1, "x"), (1, "y"), (1, "z")]
    assert out[-1].completion_tokens == 5


def test_merge_raises_a_choice_error_and_stops_the_others():
    closed = []

    async def forever():
        try:
            while True:
                await asyncio.sleep(0.01)
                yield _d(0, "w", None, 1)
        finally:
            closed.append(True)

    async def run():
        return [d async for d in merge([forever(), _gen([_d(0, "a", None, 1)], fail=RuntimeError("boom"))])]

    with pytest.raises(RuntimeError, match="boom"):
        asyncio.run(run())
    assert closed == [True]


def _meta(kind, **kw):
    return StreamMeta(kind, "id1", 0, "m", 3, **kw)


def test_chat_logprobs_shape_whole_and_streamed():
    names = TokenText(ByteTokenizer())
    lp = TokenLogprobs(-0.1, ((65, -0.1), (66, -2.5)))
    f = Formatter(_meta("chat", logprobs=2), names, [256, 1, 2])
    d = Delta(0, 65, "A", None, 1, logprobs=lp)
    c = f.chunk(d)["choices"][0]
    assert c["logprobs"] == {"content": [{"token": "A", "logprob": -0.1, "bytes": [65], "top_logprobs": [
        {"token": "A", "logprob": -0.1, "bytes": [65]}, {"token": "B", "logprob": -2.5, "bytes": [66]}]}],
        "refusal": None}
    f.add(d)
    f.add(Delta(1, 66, "B", "length", 2, logprobs=TokenLogprobs(-1.0, ((65, -0.5),))))
    body = f.whole()
    assert [x["token"] for x in body["choices"][0]["logprobs"]["content"]] == ["A", "B"]
    assert body["choices"][0]["message"]["content"] == "AB" and body["usage"]["completion_tokens"] == 2


def test_completion_echo_and_logprobs_shape():
    names = TokenText(ByteTokenizer())
    f = Formatter(_meta("completion", logprobs=1, echo="hi"), names, [256, 104, 105])  # BOS first
    prompt_lp = [None, TokenLogprobs(-2.0, ((104, -2.0),)), TokenLogprobs(-3.0, ((104, -1.0),))]
    f.add(Delta(0, 33, "!", None, 1, logprobs=TokenLogprobs(-0.5, ((33, -0.5),)), prompt_logprobs=prompt_lp))
    f.add(Delta(1, 33, "!", "length", 2, logprobs=TokenLogprobs(-0.25, ((33, -0.25),))))
    ch = f.whole()["choices"][0]
    assert ch["text"] == "hi!!"
    assert ch["logprobs"] == {"tokens": ["", "h", "i", "!", "!"], "token_logprobs": [None, -2.0, -3.0, -0.5, -0.25],
                              "top_logprobs": [None, {"h": -2.0}, {"h": -1.0}, {"!": -0.5}, {"!": -0.25}],
                              "text_offset": [0, 0, 1, 2, 3]}  # BOS adds no text: offsets follow the text


def test_n_choices_whole_body_and_continuous_usage():
    f = Formatter(_meta("completion", continuous_usage=True))
    assert f.chunk(Delta(0, 65, "A", None, 1, choice=1))["usage"] == {
        "prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}
    f.add(Delta(0, 65, "A", "length", 1, choice=1))
    f.add(Delta(0, 66, "B", "stop", 2, choice=0))
    body = f.whole()
    assert [(c["index"], c["text"], c["finish_reason"]) for c in body["choices"]] == [(0, "B", "stop"),
                                                                                      (1, "A", "length")]
    assert body["usage"]["completion_tokens"] == 2


def test_kv_store_counts_a_shared_payload_once():
    p = KVPayload(np.zeros((1, 4, 1, 2), np.float32), np.zeros((1, 4, 1, 2), np.float32), 3, 0)
    store = KVStore(p.nbytes, 60)
    held = store.put_shared(["r~0", "r~1", "r~2"], p)
    assert len({h.capability for h in held}) == 3 and store.held_bytes == p.nbytes
    store.release("r~0")
    store.release("r~1")
    assert store.held_bytes == p.nbytes and store.get("r~2") is not None
    store.release("r~2")
    assert store.held_bytes == 0 and store.room_for(p.nbytes) == 1
