"""The official `openai` client, sync and async, streamed and not, completions and chat, against
`tandem local` (the whole cluster as processes). Greedy decoding, so streamed and whole responses
of the same request must carry the same text. A few short requests only."""
from __future__ import annotations

import asyncio

import openai
import pytest

from tandem_core.models import BUILTIN_DIR

from tests.e2e.conftest import start_local, stop_local

pytestmark = pytest.mark.e2e
MESSAGES = [{"role": "system", "content": "You write Python."}, {"role": "user", "content": "def add(a, b):"}]


@pytest.fixture(scope="module")
def local(request):
    """The session cluster (model "builtin") when the trained checkpoint is there; else a cluster
    of the random-weight preset "tiny" for this module."""
    if (BUILTIN_DIR / "config.json").is_file():
        yield request.getfixturevalue("local_cluster")
        return
    c = start_local(model="tiny", slots=2, max_len=256)
    try:
        yield c
    finally:
        stop_local(c.proc)


def _sync(c) -> openai.OpenAI:
    return openai.OpenAI(base_url=c.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)


def _async(c) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=c.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)


def test_sync_completions_and_chat(local):
    client = _sync(local)
    plain = client.completions.create(model=local.model, prompt="import os\n", max_tokens=8, temperature=0)
    assert plain.id == plain.id.strip() and plain.usage.completion_tokens <= 8
    assert plain.choices[0].finish_reason in ("stop", "length")

    chunks = list(client.chat.completions.create(
        model=local.model, messages=MESSAGES, max_tokens=8, temperature=0, stream=True,
        stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    streamed = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and 1 <= usage.completion_tokens <= 8
    whole = client.chat.completions.create(model=local.model, messages=MESSAGES, max_tokens=8, temperature=0)
    assert whole.choices[0].message.content == streamed
    assert whole.usage.prompt_tokens == usage.prompt_tokens


def test_async_completions_and_chat(local):
    async def run():
        client = _async(local)
        stream = await client.completions.create(model=local.model, prompt="import os\n", max_tokens=8,
                                                 temperature=0, stream=True)
        text = "".join([ch.choices[0].text async for ch in stream if ch.choices])
        plain = await client.completions.create(model=local.model, prompt="import os\n", max_tokens=8,
                                                temperature=0)
        chat = await client.chat.completions.create(model=local.model, messages=MESSAGES, max_tokens=4,
                                                    temperature=0, seed=1)
        await client.close()
        return text, plain, chat

    text, plain, chat = asyncio.run(run())
    assert text == plain.choices[0].text
    assert chat.object == "chat.completion" and chat.choices[0].message.role == "assistant"
    assert chat.choices[0].finish_reason in ("stop", "length") and chat.usage.completion_tokens <= 4


def test_unsupported_parameter_is_a_clear_400(local):
    with pytest.raises(openai.BadRequestError, match="not supported yet"):
        _sync(local).completions.create(model=local.model, prompt="x", max_tokens=2, suffix="y")
