"""Pure parts of the gateway: stop strings across token boundaries, incremental text, the
proto -> params mapping, the import rule (no JAX, no other service) and `--help`."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from gateway.grpc_api import to_params
from gateway.relay import TextAssembler
from gateway.settings import GatewaySettings
from gateway.validation import CompletionParams, build_request
from tandem_core.models import BYTE_EOS, resolve_model
from tandem_core.tokenizer import ByteTokenizer
from tandem_proto import generate_pb2

ROOT = Path(__file__).resolve().parents[2]


def _run(text: str, stop: list[str], eos: bool = False) -> tuple[str, bool, list[str]]:
    asm = TextAssembler(ByteTokenizer(), stop, (BYTE_EOS,))
    pieces = []
    for b in text.encode():
        pieces.append(asm.feed(b))
        if asm.stopped:
            break
    if eos and not asm.stopped:
        pieces.append(asm.feed(BYTE_EOS))
    if not asm.stopped:
        pieces.append(asm.finish())
    return "".join(pieces), asm.stopped, pieces


@pytest.mark.parametrize(
    "text,stop,want,stopped",
    [
        ("hello world", [], "hello world", False),
        ("hello world", ["wor"], "hello ", True),
        ("hello world", ["lo w", "o"], "hell", True),  # earliest match wins
        ("hello world", ["xyz"], "hello world", False),
        ("hello wo", ["world"], "hello wo", False),  # held-back prefix is released at the end
        ("héllo ✓ done", ["✓"], "héllo ", True),  # multi-byte stop across byte tokens
        ("aaab", ["aab"], "a", True),  # overlapping partial matches
    ],
)
def test_stop_strings(text, stop, want, stopped):
    got, did_stop, _ = _run(text, stop)
    assert (got, did_stop) == (want, stopped)


def test_text_that_may_start_a_stop_is_held_back_then_released():
    _, _, pieces = _run("ab cd", ["b c!"])
    assert pieces[:3] == ["a", "", ""]  # "b", "b " could start "b c!"
    assert "".join(pieces) == "ab cd"


def test_eos_is_not_text():
    got, stopped, _ = _run("hi", [], eos=True)
    assert got == "hi" and not stopped


def test_grpc_params_mapping():
    p = to_params(generate_pb2.GenerateRequest(prompt="x"))
    assert (p.prompt, p.prompt_ids, p.max_tokens, p.temperature, p.top_p) == ("x", None, None, 0.0, None)
    p = to_params(generate_pb2.GenerateRequest(
        prompt_token_ids=[256, 1], max_tokens=3, stop=["a"], priority="high",
        sampling=generate_pb2.SamplingParameters(temperature=0.5, top_p=0.9, top_k=4, seed=7),
    ))
    assert (p.prompt, p.prompt_ids, p.max_tokens, p.stop, p.priority) == (None, [256, 1], 3, ["a"], "high")
    assert (p.temperature, round(p.top_p, 3), p.top_k, p.seed) == (0.5, 0.9, 4, 7)
    assert not p.ignore_eos and to_params(generate_pb2.GenerateRequest(prompt="x", ignore_eos=True)).ignore_eos
    # issue 12: unset optional / zero fields are "off"
    assert (p.n, p.presence_penalty, p.frequency_penalty, p.repetition_penalty, p.logit_bias, p.min_tokens,
            p.stop_token_ids, p.logprobs, p.skip_special_tokens) == (None, None, None, None, None, None, [], None, True)
    p = to_params(generate_pb2.GenerateRequest(
        prompt="x", n=3, stop_token_ids=[5, 6], logprobs=0, skip_special_tokens=False,
        sampling=generate_pb2.SamplingParameters(presence_penalty=0.5, frequency_penalty=-1, repetition_penalty=1.5,
                                                 logit_bias={7: -100, 8: 2.5}, min_tokens=4),
    ))
    assert (p.n, p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (3, 0.5, -1.0, 1.5)
    assert (p.logit_bias, p.min_tokens, p.stop_token_ids) == ({7: -100.0, 8: 2.5}, 4, [5, 6])
    assert p.logprobs == 0 and not p.skip_special_tokens and p.temperature == 0.0
    bad = to_params(generate_pb2.GenerateRequest(prompt="x", sampling=generate_pb2.SamplingParameters(
        repetition_penalty=0)))
    assert bad.repetition_penalty == 0.0  # set explicitly: validation says (0, 2]


def test_grpc_response_reads_choice_and_logprobs_when_present():
    from types import SimpleNamespace

    from gateway.grpc_api import to_response
    from gateway.relay import Delta
    from tandem_core.types import TokenLogprobs

    tok = ByteTokenizer()
    old = SimpleNamespace(index=2, token_id=104, text="h", finish_reason=None)  # a Delta without the new fields
    r = to_response("r1", old, 9, tok)
    assert (r.choice_index, r.HasField("logprob"), list(r.top_logprobs), r.prompt_tokens) == (0, False, [], 0)
    d = Delta(3, 104, "h", "stop", 4)
    d.choice, d.logprobs = 2, TokenLogprobs(-0.25, ((104, -0.25), (0xC3, -2.0)))
    r = to_response("r1", d, 9, tok)
    assert (r.choice_index, r.logprob, r.finish_reason, r.prompt_tokens) == (2, -0.25, "stop", 9)
    assert [(t.token_id, t.logprob, t.text) for t in r.top_logprobs] == [(104, -0.25, "h"), (0xC3, -2.0, "\ufffd")]


def test_build_request_defaults():
    s = GatewaySettings(model="tiny", default_max_tokens=16, max_context_len=20, max_prompt_len=20)
    info = resolve_model(s.model)
    prep = build_request(CompletionParams(prompt="hello", ignore_eos=False), s, info, ByteTokenizer())
    req = prep.request
    assert req.prompt_ids == [256, *b"hello"] and req.stop_token_ids == [BYTE_EOS]
    assert req.max_tokens == 14  # default clamped to what fits in the context
    assert req.sampling.temperature == 1.0 and req.priority == "normal"
    assert req.deadline_ts - req.enqueued_ts == pytest.approx(s.request_timeout_s)
    ign = build_request(CompletionParams(prompt="hi", ignore_eos=True, max_tokens=2), s, info, ByteTokenizer())
    assert ign.request.stop_token_ids == [] and ign.request.ignore_eos


def test_gateway_imports_no_jax_and_no_other_service():
    code = (
        "import sys, gateway.__main__, gateway.app\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in "
        "{'jax', 'jaxlib', 'tandem_engine', 'prefill_svc', 'decode_svc'})\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, timeout=60)


def test_help_names_the_environment():
    out = subprocess.run(
        [sys.executable, "-m", "gateway", "--help"], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0
    assert "TANDEM_GATEWAY_REDIS__URL" in out.stdout and "TANDEM_GATEWAY_MODEL" in out.stdout
