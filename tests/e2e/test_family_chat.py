"""Chat per family through the real engine: a checkpoint of the family (transformers' class,
random weights) with a tokenizer carrying the family's markers and its chat template, served by
`tandem local`; a forced tool call through the `openai` SDK comes back as `tool_calls` with
arguments that parse and match the schema: the grammar wrote the family's own wrapper (Hermes
`<tool_call>` for Qwen3, `[TOOL_CALLS]` for Mistral, the commentary channel for gpt-oss), the
family's parser read it back, the engine ran the family's layers."""
from __future__ import annotations

import json
import shutil

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")
openai = pytest.importorskip("openai")

from tests.chat_family import family_dir
from tests.e2e.conftest import start_local, stop_local
from tests.families import build_family

pytestmark = pytest.mark.e2e
TOOL = {"type": "function", "function": {
    "name": "set_light", "description": "Turn the light on or off",
    "parameters": {"type": "object", "properties": {"on": {"type": "boolean"}}, "required": ["on"],
                   "additionalProperties": False}}}
CASES = [("qwen3", "qwen3"), ("mistral", "mistral_v11"), ("gpt_oss", "gpt_oss")]


@pytest.mark.parametrize("family,template", CASES)
def test_forced_tool_call_in_the_family_format(family, template, tmp_path):
    chat = family_dir(tmp_path / "chat", template)
    vocab = json.loads((chat / "config.json").read_text())["vocab_size"]
    ckpt = tmp_path / family
    build_family(family, ckpt, seed=3, vocab_size=vocab)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (chat / name).is_file():
            shutil.copy(chat / name, ckpt / name)
    cluster = start_local(str(ckpt), slots=2, max_len=512)
    try:
        client = openai.OpenAI(base_url=cluster.base_url + "/v1", api_key="unused", max_retries=0)
        resp = client.chat.completions.create(
            model=client.models.list().data[0].id, messages=[{"role": "user", "content": "Lights on, please."}],
            tools=[TOOL], tool_choice={"type": "function", "function": {"name": "set_light"}},
            max_tokens=60, temperature=1.0, seed=1)
        calls = resp.choices[0].message.tool_calls
        assert calls and calls[0].function.name == "set_light", resp.model_dump_json()
        args = json.loads(calls[0].function.arguments)
        assert set(args) == {"on"} and isinstance(args["on"], bool)
    finally:
        stop_local(cluster.proc)
