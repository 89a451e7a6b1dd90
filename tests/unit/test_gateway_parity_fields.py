"""OpenAI/vLLM parity of the request surface (issue 12), apart from HTTP and Redis: the new fields
reach the contract (`GenerationRequest`, `SamplingParams`, `Prepared`), chat runs to the context
end without max_tokens, and the bodies map to `CompletionParams`. The HTTP side is
tests/integration/test_gateway_parity.py."""
from __future__ import annotations

from gateway.schemas import ChatBody, CompletionBody
from gateway.settings import GatewaySettings
from gateway.validation import CompletionParams, build_request
from tandem_core.models import BYTE_BOS, BYTE_EOS, resolve_model
from tandem_core.tokenizer import ByteTokenizer

TINY = resolve_model("tiny")


# ---------------------------------------------------------------- into the contract


def _build(p: CompletionParams, **settings):
    s = GatewaySettings(model="tiny", max_context_len=64, max_prompt_len=32, max_tokens_limit=40, **settings)
    return build_request(p, s, TINY, ByteTokenizer())


def test_new_fields_reach_the_request():
    p = CompletionParams(prompt="hi", max_tokens=8, n=3, presence_penalty=0.5, frequency_penalty=-1,
                         repetition_penalty=1.2, logit_bias={65: 5.0, 10: -100}, min_tokens=2,
                         stop_token_ids=[10, BYTE_EOS, 10], logprobs=4, echo=True, skip_special_tokens=False,
                         continuous_usage=True, seed=7)
    prep = _build(p)
    req, sp = prep.request, prep.request.sampling
    assert (req.n, req.prompt_logprobs, req.stop_token_ids) == (3, 4, [BYTE_EOS, 10])
    assert (sp.presence_penalty, sp.frequency_penalty, sp.repetition_penalty) == (0.5, -1.0, 1.2)
    assert sp.logit_bias == ((10, -100.0), (65, 5.0)) and sp.min_tokens == 2 and sp.logprobs == 4 and sp.seed == 7
    assert (prep.echo, prep.logprobs, prep.skip_special_tokens, prep.continuous_usage, prep.n) == (
        True, 4, False, True, 3)
    assert prep.prompt_text == "hi"
    back = type(req).from_json(req.to_json())  # survives the admission stream
    assert back.sampling == sp and back.n == 3 and back.prompt_logprobs == 4


def test_defaults_and_switches():
    plain = _build(CompletionParams(prompt="hi"))
    assert plain.request.n == 1 and plain.request.prompt_logprobs is None and plain.logprobs is None
    assert plain.request.sampling.to_dict() == {"temperature": 1.0, "top_k": 0, "top_p": 1.0, "seed": None}
    assert _build(CompletionParams(prompt="hi", logprobs=2)).request.prompt_logprobs is None  # no echo
    assert _build(CompletionParams(prompt="hi", echo=True)).request.prompt_logprobs is None  # no logprobs
    ign = _build(CompletionParams(prompt="hi", ignore_eos=True, stop_token_ids=[10]))
    assert ign.request.stop_token_ids == [10] and ign.request.ignore_eos  # EOS dropped, the client's kept
    ids = _build(CompletionParams(prompt_ids=[BYTE_BOS, 65], echo=True))
    assert ids.prompt_text is None and ids.echo


def test_chat_without_max_tokens_runs_to_the_context_end():
    chat = CompletionParams(prompt="hello", max_tokens_to_context=True)
    assert _build(chat).request.max_tokens == 40  # max_tokens_limit (64 - 6 would fit 58)
    assert _build(CompletionParams(prompt="x" * 30, max_tokens_to_context=True)).request.max_tokens == 64 - 31
    assert _build(CompletionParams(prompt="hello")).request.max_tokens == 16  # completions: OpenAI's 16
    budget = _build(chat, tokens_per_minute_per_key=20)  # what a per-key token budget can ever admit
    assert budget.request.max_tokens == 20 - 6


def test_bodies_to_params():
    c = CompletionBody.model_validate({"prompt": "x", "logprobs": 5, "echo": True, "n": 2,
                                       "logit_bias": {"7": 1}, "stream_options": {"continuous_usage_stats": True}})
    p = c.to_params()
    assert (p.logprobs, p.echo, p.n, p.logit_bias, p.continuous_usage) == (5, True, 2, {7: 1.0}, True)
    assert not p.max_tokens_to_context
    chat = ChatBody.model_validate({"messages": [{"role": "user", "content": "x"}], "logprobs": True})
    assert chat.to_params().logprobs == 0 and chat.to_params().logprobs_param == "top_logprobs"
    assert chat.to_params().max_tokens_to_context
    top = ChatBody.model_validate({"messages": [{"role": "user", "content": "x"}], "logprobs": True,
                                   "top_logprobs": 20})
    assert top.to_params().logprobs == 20
    off = ChatBody.model_validate({"messages": [{"role": "user", "content": "x"}], "logprobs": False})
    assert off.to_params().logprobs is None
    # 4.0 is the integer 4 in JSON (and JSON Schema); 4.5, "4" and true are refused (test_gateway_validation)
    whole = CompletionBody.model_validate({"prompt": [1.0, 2], "max_tokens": 4.0, "n": 2.0, "seed": -1.0})
    assert (whole.prompt, whole.max_tokens, whole.n, whole.seed) == ([1, 2], 4, 2, -1)
    assert all(type(x) is int for x in (*whole.prompt, whole.max_tokens, whole.n, whole.seed))


def test_a_request_opts_out_of_speculative_decoding_over_http_and_grpc():
    from gateway.grpc_api import to_params
    from tandem_proto import generate_pb2

    on, off = _build(CompletionParams(prompt="hi")), _build(CompletionParams(prompt="hi", speculative=False))
    assert on.request.speculative and not off.request.speculative
    assert "speculative" not in on.request.to_dict()  # the default stays off the wire (older pods read it)
    back = type(off.request).from_json(off.request.to_json())  # through the admission stream and resumes
    assert back.speculative is False and back.choice(1).speculative is False
    assert CompletionBody(prompt="hi", speculative=False)._params(None, None, "logprobs").speculative is False
    assert to_params(generate_pb2.GenerateRequest(prompt="x")).speculative is True
    assert to_params(generate_pb2.GenerateRequest(prompt="x", speculative=False)).speculative is False
