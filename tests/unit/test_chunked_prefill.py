"""Chunked prefill in a decode pod's loop (colocated mode): a long local prompt arriving while a
stream runs is seated in a row and prefilled a chunk a call beside that stream's steps (the engine's ragged call), which keep coming,
with every token the same as with whole prefills; a seated prompt cancelled mid-prompt ends with
its entry's ack and gives its blocks back; a next turn's seated prompt starts after the pool's own
blocks of the turn before. A short local prompt whose leading blocks the pool keeps (a colocated
next turn) is seated over them too, alone or beside a stream, only the rest computed, with a whole
prefill's tokens; one the ragged call cannot serve (n > 1, prompt logprobs) is prefilled whole.
Real engine (tiny preset), no Redis: the loop's queues are driven directly."""
from __future__ import annotations

import queue
import time

import numpy as np
import pytest

from decode_svc.bridge import Bridge
from decode_svc.items import LocalPrefill
from decode_svc.loop import EngineLoop
from decode_svc.requests import RequestTable
from tandem_core.types import FINISH_CANCELLED, GenerationRequest, SamplingParams, choice_ids
from tandem_engine import load_engine, reference_greedy

CHUNK = 16
GREEDY = SamplingParams()


@pytest.fixture(scope="module")
def engine():
    return load_engine("tiny", slots=2, max_len=96, prefill_buckets=(16, 64), prefix_chunk=CHUNK)


def _run(engine, chunk_tokens: int, long_ids: list[int] | None = None) -> tuple[dict[str, list[int]], int, int]:
    """A 6-token stream and a 60-token prompt (or `long_ids`) arrive together: the stream is
    prefilled first (nothing runs yet: whole), the long prompt while the stream runs. Returns
    every request's tokens, how many of the stream's steps gave a token before the long prompt's
    token 0, and the loop's ragged calls."""
    rng = np.random.default_rng(1)
    stream = GenerationRequest("stream", rng.integers(0, 256, 6).tolist(), 40, GREEDY, ignore_eos=True)
    ids = rng.integers(0, 256, 60).tolist() if long_ids is None else long_ids
    long = GenerationRequest("long", ids, 6, GREEDY, ignore_eos=True)
    with Turns(engine, chunk_tokens) as t:
        got = t.serve(stream, long)
    first_long = next(i for i, e in enumerate(t.order) if e.request_id == "long")
    between = sum(e.request_id == "stream" and e.index > 0 for e in t.order[:first_long])
    return {rid: [e.token for e in es] for rid, es in got.items()}, between, t.loop.stats.ragged_calls


def test_a_long_prompt_is_prefilled_between_a_running_streams_steps(engine):
    whole, between_whole, ragged_whole = _run(engine, 0)
    chunked, between, ragged = _run(engine, CHUNK)  # one chunk a call beside the stream's step: 4 for 60 tokens
    assert chunked == whole, "chunked prefill changed the tokens"
    assert (ragged_whole, ragged) == (0, 4)
    assert between_whole == 0  # whole: before the stream's first step
    # the stream's row joins the call after the first chunk's (its whole prefill is dispatched before
    # that call and waited for after it: decode_svc/loop.py _finish_prefills), so it steps beside 3
    assert between == 3, f"the stream got {between} tokens out while the long prompt was prefilled in 4 chunks"


def test_a_next_turn_is_seated_over_the_blocks_its_turn_before_left_in_the_pool():
    engine = load_engine("tiny", slots=2, max_len=96, prefill_buckets=(16, 64), prefix_chunk=CHUNK,
                         kv_block_size=4)
    rng = np.random.default_rng(5)

    def turn(t: Turns, name: str, ids: list[int]) -> list[int]:
        """A stream and the prompt `ids` arrive together (the prompt is seated beside the stream)."""
        stream = GenerationRequest(f"stream-{name}", rng.integers(0, 256, 6).tolist(), 40, GREEDY, ignore_eos=True)
        return _tokens(t.serve(stream, GenerationRequest(name, ids, 6, GREEDY, ignore_eos=True))[name])

    with Turns(engine, CHUNK) as t:
        first = rng.integers(0, 256, 40).tolist()
        answer = turn(t, "first", first)
        calls, hits = t.loop.stats.ragged_calls, engine.kv_reuse_summary()["hits"]
        assert calls == 3  # 40 tokens in chunks of 16
        # the next turn: the first prompt, its answer (all but its last token were fed) and 9 new tokens
        ids = first + answer[:5] + rng.integers(0, 256, 9).tolist()
        again = turn(t, "next", ids)
        assert engine.kv_reuse_summary()["hits"] > hits, "the next turn did not reuse the pool's blocks"
        assert t.loop.stats.ragged_calls - calls == 1, "the 10 tokens after the 44 kept are one chunk"
        assert again == reference_greedy(engine.params, engine.cfg, ids, 6, pad_to=96)


def test_a_seated_prompt_cancelled_mid_prompt_acks_its_entry_and_frees_its_blocks(engine):
    table = RequestTable(2)
    bridge = Bridge(2, 256)
    loop = EngineLoop(engine, table, bridge, prefill_chunk_tokens=CHUNK)  # driven here, not started
    rng = np.random.default_rng(3)
    stream = GenerationRequest("stream", rng.integers(0, 256, 6).tolist(), 40, GREEDY, ignore_eos=True)
    long = GenerationRequest("long", rng.integers(0, 256, 60).tolist(), 6, GREEDY, ignore_eos=True)
    state = engine.init_state()
    free = engine.kv_blocks_free()
    for req, ack in ((stream, b"0-1"), (long, b"0-2")):
        assert table.reserve(1) == 1
        bridge.inserts.put(LocalPrefill(req, ("s", "g", ack), table.claim(req.request_id)))
        state = loop._finish_prefills(loop._apply_inserts(state, 0.0))  # (a whole prefill: its row now)
    seated = [a for a in table.snapshot() if a.seated]
    assert [a.req.request_id for a in seated] == ["long"] and engine.prompts_pending == 1
    call, state = loop._dispatch(state, None)
    assert call.ragged and call.first_slot is None  # one chunk of four
    state = loop._process(call, state)
    loop.cancel({"long"})
    state = loop._apply_cancels(state)
    out = [e for batch in iter(lambda: None if bridge.outputs.empty() else bridge.outputs.get(), None)
           for e in batch if e.request_id == "long"]
    assert [(e.index, e.token, e.finish, e.ack) for e in out] == [(0, -1, FINISH_CANCELLED, ("s", "g", b"0-2"))]
    assert engine.prompts_pending == 0 and table.used == 1
    state = loop._free(state, table.snapshot()[0])
    assert engine.kv_blocks_free() == free


class Turns:
    """A started loop (colocated: every prompt prefilled here) driven through its queues: `serve`
    puts prompts in together and returns every token stream's tokens and entries once all end."""

    def __init__(self, engine, chunk_tokens: int = 2048) -> None:
        self.engine = engine
        self.table = RequestTable(2)
        self.bridge = Bridge(2, 256)
        self.loop = EngineLoop(engine, self.table, self.bridge, prefill_chunk_tokens=chunk_tokens)

    def __enter__(self) -> Turns:
        self.loop.start()
        return self

    def __exit__(self, *exc) -> None:
        self.loop.stop()

    def serve(self, *reqs: GenerationRequest) -> dict[str, list]:
        streams = {rid for req in reqs for rid in choice_ids(req.request_id, req.n)}
        for req in reqs:
            assert self.table.reserve(1) == 1
            self.bridge.inserts.put(LocalPrefill(req, ("s", "g", req.request_id.encode()),
                                                 self.table.claim(req.request_id)))
        got: dict[str, list] = {}
        self.order: list = []  # every entry, in the order the loop emitted them
        finished, deadline = set(), time.monotonic() + 60
        while finished != streams:
            assert time.monotonic() < deadline and self.loop.error is None, f"not finished: {got}"
            try:
                batch = self.bridge.outputs.get(timeout=1)
            except queue.Empty:
                continue
            for e in batch:
                got.setdefault(e.request_id, []).append(e)
                self.order.append(e)
                if e.finish is not None:
                    finished.add(e.request_id)
        return got

    def counts(self) -> tuple[int, int, int]:
        """(ragged calls, prompt tokens found in the pool's block cache, prompt tokens computed)."""
        return self.loop.stats.ragged_calls, self.engine.kv_reuse_summary()["hits"], self.loop.stats.prompt_computed


def _tokens(entries) -> list[int]:
    return [e.token for e in entries if e.index >= 0]


def _next_turn(rng, first: list[int], answer: list[int]) -> list[int]:
    """The first prompt, its answer (all but its last token were fed: their KV is in the pool) and
    9 new tokens."""
    return first + answer[:5] + rng.integers(0, 256, 9).tolist()


@pytest.mark.parametrize("beside_a_stream", [False, True])
def test_a_colocated_next_turn_is_computed_only_past_the_pools_blocks(engine, beside_a_stream):
    """A short next turn (far below prefill_chunk_tokens) is seated over the blocks its turn before
    left in the pool, alone or while another stream runs: only the 22 tokens past the 2 kept blocks
    of 16 are computed (2 ragged calls of 16), its tokens are a whole prefill's without a cache, and
    its entry is acked with its first token. The turn before, a miss, was prefilled whole."""
    rng = np.random.default_rng(11)
    first = rng.integers(0, 256, 40).tolist()
    with Turns(engine) as t:
        answer = _tokens(t.serve(GenerationRequest("first", first, 6, GREEDY, ignore_eos=True))["first"])
        assert t.counts() == (0, 0, 40)  # a miss: whole, between two steps
        ids = _next_turn(rng, first, answer)  # 54 tokens: 45 fed, 2 full blocks kept
        reqs = [GenerationRequest("next", ids, 6, GREEDY, ignore_eos=True)]
        if beside_a_stream:  # the stream first: it runs when the next turn arrives
            reqs.insert(0, GenerationRequest("stream", rng.integers(0, 256, 6).tolist(), 30, GREEDY, ignore_eos=True))
        got = t.serve(*reqs)
        calls, hits, computed = t.counts()
        assert (calls, hits, computed) == (2, 32, 40 + 22 + 6 * beside_a_stream)
        if beside_a_stream:
            assert len(_tokens(got["stream"])) == 30
    again = got["next"]
    assert [e.ack for e in again] == [("s", "g", b"next")] + [None] * 5  # acked with token 0, and only then
    with Turns(engine) as t:  # a fresh pool: the same prompt misses and is prefilled whole
        whole = _tokens(t.serve(GenerationRequest("next", ids, 6, GREEDY, ignore_eos=True))["next"])
        assert t.counts() == (0, 0, 54)
    assert _tokens(again) == whole == reference_greedy(engine.params, engine.cfg, ids, 6, pad_to=96)


FORCED = {"kind": "choice", "choices": ["abcdefghijkl"]}  # the byte-level tiny preset: 12 forced tokens, then EOS


@pytest.mark.parametrize("what", ["n", "prompt_logprobs", "grammar", "beside_a_grammar"])
def test_a_hit_the_ragged_call_cannot_serve_is_prefilled_whole(engine, what):
    """A next turn whose leading blocks the pool keeps, with choices (n = 2), prompt logprobs or a
    grammar, or arriving while a grammar row runs (the ragged call has no masked variant), is
    prefilled whole without a cache (all 54 tokens computed again, no ragged call) and is still right."""
    rng = np.random.default_rng(12)
    first = rng.integers(0, 256, 40).tolist()
    with Turns(engine) as t:
        answer = _tokens(t.serve(GenerationRequest("first", first, 6, GREEDY, ignore_eos=True))["first"])
        ids = _next_turn(rng, first, answer)
        extra = {"n": {"n": 2}, "prompt_logprobs": {"prompt_logprobs": 1}, "grammar": {"grammar": FORCED}}.get(what, {})
        reqs = [GenerationRequest("next", ids, 6 + 20 * (what == "grammar"), GREEDY, ignore_eos=True, **extra)]
        if what == "beside_a_grammar":
            reqs.insert(0, GenerationRequest("constrained", [256, 70], 30, GREEDY, ignore_eos=True, grammar=FORCED))
        got = t.serve(*reqs)
        assert t.counts() == (0, 0, 40 + 54 + 2 * (what == "beside_a_grammar"))
    want = reference_greedy(engine.params, engine.cfg, ids, 6, pad_to=96)
    if what == "grammar":
        want = list(b"abcdefghijkl") + [257]
    streams = choice_ids("next", 2 if what == "n" else 1)
    assert sorted(got) == sorted(streams + ["constrained"] * (what == "beside_a_grammar"))
    for rid in streams:
        assert _tokens(got[rid]) == want, rid
    if what == "prompt_logprobs":
        assert got["next"][0].index == -1 and got["next"][0].prompt_logprobs
    if what == "beside_a_grammar":
        assert _tokens(got["constrained"]) == list(b"abcdefghijkl") + [257]


def test_a_hit_cancelled_mid_prompt_acks_its_entry_and_the_pools_blocks_stay_kept(engine):
    """A next turn seated over the pool's 2 kept blocks, cancelled after its first chunk of 22
    tokens: its entry is acked with the cancel, the blocks it computed go back, the kept ones stay
    in the block cache (and free for the taking), and no seated prompt is left."""
    table = RequestTable(2)
    bridge = Bridge(2, 256)
    loop = EngineLoop(engine, table, bridge, prefill_chunk_tokens=2048)  # driven here, not started
    rng = np.random.default_rng(13)
    first = rng.integers(0, 256, 40).tolist()
    state = engine.init_state()
    free = engine.kv_blocks_free()
    assert table.reserve(1) == 1
    bridge.inserts.put(LocalPrefill(GenerationRequest("first", first, 6, GREEDY, ignore_eos=True), ("s", "g", b"0-1"),
                                    table.claim("first")))
    state = loop._finish_prefills(loop._apply_inserts(state, 0.0))  # a miss: whole, and into its row
    state = loop._free(state, table.snapshot()[0])  # finished: its prompt's 2 full blocks kept
    assert engine.kv_reuse_summary()["blocks"] == 2 and engine.kv_blocks_free() == free
    ids = first + rng.integers(0, 256, 14).tolist()
    assert table.reserve(1) == 1
    bridge.inserts.put(LocalPrefill(GenerationRequest("next", ids, 6, GREEDY, ignore_eos=True), ("s", "g", b"0-2"),
                                    table.claim("next")))
    state = loop._apply_inserts(state, 0.0)
    assert [a.req.request_id for a in table.snapshot() if a.seated] == ["next"] and engine.prompts_pending == 1
    assert engine.kv_reuse_summary()["hits"] == 32 and engine.kv_blocks_free() == free - 4  # 2 shared, 2 its own
    call, state = loop._dispatch(state, None)
    assert call.ragged and call.first_slot is None  # the first of 2 chunks
    state = loop._process(call, state)
    loop.cancel({"next"})
    state = loop._apply_cancels(state)
    out = [e for batch in iter(lambda: None if bridge.outputs.empty() else bridge.outputs.get(), None) for e in batch]
    assert [(e.request_id, e.index, e.finish, e.ack) for e in out] == [("first", 0, None, ("s", "g", b"0-1")),
                                                                       ("next", 0, FINISH_CANCELLED, ("s", "g", b"0-2"))]
    assert engine.prompts_pending == 0 and table.used == 0
    assert engine.kv_reuse_summary()["blocks"] == 2 and engine.kv_blocks_free() == free


def test_a_whole_local_prefill_is_waited_for_after_the_next_call_is_dispatched(engine, monkeypatch):
    """A short prompt arriving while a stream runs is prefilled whole: its prefill is dispatched
    before the stream's next call and waited for only after that call is dispatched too (so the
    host's part, the first token's copy, its publish and the insert, overlaps the call), and its
    row joins the call after. The tokens are those of the prompt alone."""
    from decode_svc.local_prefill import Started

    waits: list[tuple[int, int]] = []  # (the loop's calls when the prefill was dispatched, when it was waited for)
    start, result = Started.__init__, Started.result

    def started(self, *a, **kw):
        start(self, *a, **kw)
        self.calls_then = t.loop.stats.calls

    def waited(self):
        waits.append((self.calls_then, t.loop.stats.calls))
        return result(self)

    monkeypatch.setattr(Started, "__init__", started)
    monkeypatch.setattr(Started, "result", waited)
    rng = np.random.default_rng(14)
    stream = GenerationRequest("stream", rng.integers(0, 256, 6).tolist(), 60, GREEDY, ignore_eos=True)
    short = GenerationRequest("short", rng.integers(0, 256, 10).tolist(), 8, GREEDY, ignore_eos=True)
    with Turns(engine) as t:
        assert t.table.reserve(1) == 1
        t.bridge.inserts.put(LocalPrefill(stream, ("s", "g", b"1-1"), t.table.claim("stream")))
        deadline = time.monotonic() + 30
        while not any(e.request_id == "stream" and e.index >= 5 for e in t.bridge.outputs.get(timeout=5)):
            assert time.monotonic() < deadline
        got = t.serve(short)
    (alone, alone_at), (launched, waited_at) = waits  # the stream's (nothing ran), the short prompt's
    assert alone_at == alone and waited_at == launched + 1, waits  # the stream's next call came in between
    assert _tokens(got["short"]) == reference_greedy(engine.params, engine.cfg, short.prompt_ids, 8, pad_to=96)
