"""bench/spec_ceiling.py's replay of the n-gram lookup over known outputs: an output that copies
its prompt gives k + 1 tokens a call, every proposal kept; one with nothing to copy, one a call."""
from __future__ import annotations

from bench.spec_ceiling import replay_lookup


def test_an_output_that_copies_its_prompt_gives_k_plus_one_tokens_a_call():
    doc = list(range(100, 160))  # distinct tokens: each 2-gram occurs once
    prompt = doc + doc[:3]  # the document, then its opening again
    out = doc[3:23]  # the model copies the rest: 20 tokens, the first the prefill's
    r = replay_lookup([prompt], [out], k=4)
    assert r.calls == 4 and r.tokens_per_call == 19 / 4 and r.acceptance == 1.0  # 5, 5, 5, then the last 4


def test_an_output_with_nothing_to_copy_gives_one_token_a_call():
    prompt = list(range(100, 160))
    out = list(range(500, 520))
    r = replay_lookup([prompt], [out], k=4)
    assert r.calls == 19 and r.tokens_per_call == 1.0 and r.acceptance == 0.0


def test_a_wrong_guess_costs_the_call_its_proposal_but_emits_the_target_token():
    doc = list(range(100, 160))
    out = doc[3:6] + [999] + doc[7:15]  # the copy breaks once, inside the first proposal
    r = replay_lookup([doc + doc[:3]], [out], k=4)
    # calls: 104 105 kept, 106 rejected, 999 emitted (3); "105 999" and "999 107" recur nowhere:
    # one token each (107, 108); "107 108" does: 109-112 kept, 113 (5); 114 kept, the last (1)
    assert (r.calls, r.tokens_per_call) == (5, 11 / 5) and r.acceptance == 7 / 12
