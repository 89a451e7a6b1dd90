"""The pipelined decode loop against the two bugs the vLLM review found in exactly this pipeline:

- deadlock: the step that primes the pipeline (or the last one, with nothing dispatched after it)
  never gets its answer -> a request whose tokens all come from such steps must still finish;
- livelock: a queue nobody drains -> with a publisher slower than the engine and inserts waiting
  for busy slots, every queue still makes progress and every token arrives once, in order.
Real engine (tiny preset), no Redis: the loop's queues are driven directly.
"""
from __future__ import annotations

import json
import queue
import threading
import time

import pytest

from decode_svc.bridge import Bridge
from decode_svc.items import Insert, LocalPrefill
from decode_svc.loop import EngineLoop
from decode_svc.requests import RequestTable
from tandem_core.types import GenerationRequest, SamplingParams
from tandem_engine import load_engine

SLOTS = 2


@pytest.fixture(scope="module")
def engine():
    return load_engine("tiny", slots=SLOTS, max_len=64, prefill_buckets=(16,))


def _req(rid: str, max_tokens: int) -> GenerationRequest:
    return GenerationRequest(rid, [256, 70, 71, 72], max_tokens, SamplingParams(), ignore_eos=True)


def _collect(outputs: queue.Queue, want_finished: int, timeout_s: float) -> dict[str, list]:
    got: dict[str, list] = {}
    finished = 0
    deadline = time.monotonic() + timeout_s
    while finished < want_finished:
        left = deadline - time.monotonic()
        assert left > 0, f"only {finished}/{want_finished} requests finished: {got}"
        try:
            batch = outputs.get(timeout=left)
        except queue.Empty:
            continue
        for e in batch:
            got.setdefault(e.request_id, []).append((e.index, e.finish))
            finished += e.finish is not None
    return got


def _start(engine, outputs_size=64, pipelined=True):
    table = RequestTable(SLOTS)
    bridge = Bridge(SLOTS, outputs_size)  # no event loop to wake: the test reads the queues
    loop = EngineLoop(engine, table, bridge, pipelined=pipelined)
    loop.start()
    return loop, table, bridge.inserts, bridge.outputs


def _seat(table: RequestTable, rid: str) -> int:
    """What the I/O side does before it hands the engine an item: a ticket, then a claimed record."""
    assert table.reserve(1) == 1
    return table.claim(rid)


@pytest.mark.parametrize("pipelined", [True, False])
@pytest.mark.parametrize("max_tokens", [2, 3, 5])
def test_every_step_gets_its_answer_no_deadlock(engine, max_tokens, pipelined):
    loop, table, inserts, outputs = _start(engine, pipelined=pipelined)
    try:
        req = _req(f"r{max_tokens}", max_tokens)
        inserts.put(Insert(engine.export_prefix(engine.prefill(req.prompt_ids, req.sampling)), req, _seat(table, req.request_id)))
        got = _collect(outputs, 1, timeout_s=30)
        # Index 0 came from prefill; decode emits 1..max_tokens-1, the last one finishing.
        assert got[req.request_id] == [(i, None) for i in range(1, max_tokens - 1)] + [(max_tokens - 1, "length")]
        assert table.used == 0 and table.pending == 0
    finally:
        loop.stop()
    assert loop.error is None


def test_slow_publisher_and_waiting_inserts_no_livelock(engine):
    loop, table, inserts, outputs = _start(engine, outputs_size=1)  # publisher is the bottleneck
    reqs = [_req(f"q{i}", 6 + i) for i in range(6)]
    got: dict[str, list] = {}

    def feeder():
        # More requests than slots: each waits for a free slot, as the I/O side would.
        for r in reqs:
            while table.reserve(1) == 0:
                time.sleep(0.005)
            key = table.claim(r.request_id)
            if int(r.request_id[1:]) % 2:
                inserts.put(LocalPrefill(r, ("s", "g", b"0-1"), key))
            else:
                inserts.put(Insert(engine.export_prefix(engine.prefill(r.prompt_ids, r.sampling)), r, key))

    t = threading.Thread(target=feeder)
    t.start()
    try:
        finished = 0
        deadline = time.monotonic() + 60
        while finished < len(reqs):
            assert time.monotonic() < deadline, f"stalled: {got}"
            try:
                batch = outputs.get(timeout=1)
            except queue.Empty:
                continue
            time.sleep(0.01)  # a slow Redis
            for e in batch:
                got.setdefault(e.request_id, []).append(e.index)
                finished += e.finish is not None
        t.join(10)
    finally:
        loop.stop()
    assert loop.error is None
    for r in reqs:
        first = 0 if int(r.request_id[1:]) % 2 else 1  # local prefills also emit token 0
        assert got[r.request_id] == list(range(first, r.max_tokens)), r.request_id


def test_resumed_request_runs_to_max_tokens_not_to_a_double_counted_context(engine):
    """A request resumed at index 8 (its prompt now holds those 8 tokens) must still emit every
    index up to max_tokens - 1: the context check counts the resumed tokens once (12-token prompt,
    60 tokens in all: position 12 + 51 = 63 is the last of max_len 64)."""
    loop, table, inserts, outputs = _start(engine)
    try:
        base = [256, 70, 71, 72]
        req = GenerationRequest("resumed", base + [65] * 8, 60, SamplingParams(), ignore_eos=True, start_index=8)
        inserts.put(Insert(engine.export_prefix(engine.prefill(req.prompt_ids, req.sampling)), req, _seat(table, "resumed")))
        got = _collect(outputs, 1, timeout_s=30)
        assert [i for i, _f in got["resumed"]] == list(range(9, 60))
        assert got["resumed"][-1][1] == "length"
    finally:
        loop.stop()


def test_local_prefill_of_n_choices_waits_for_slots_and_never_overfills(engine):
    """n=3 on a 2-slot pod: one prefill, three first tokens; the third choice is held until a slot
    frees, claims see no room meanwhile, and every choice finishes with all its tokens. The engine
    thread's steps wait until the test has looked at the table with the third choice held (on a
    loaded machine the test thread read the first tokens only after two choices had finished and
    the third run: make test, 2026-12-07, "a held choice must keep claims out")."""
    looked = threading.Event()
    real = engine.generate

    def held(*args, **kw):
        looked.wait(30)
        return real(*args, **kw)

    engine.generate = held  # an instance attribute over the method: removed below
    loop, table, inserts, outputs = _start(engine)
    try:
        req = GenerationRequest("multi", [256, 70, 71, 72], 5, SamplingParams(temperature=1.0, seed=3), n=3)
        inserts.put(LocalPrefill(req, ("s", "g", b"1-0"), _seat(table, "multi")))
        seen: dict[str, list] = {}
        deadline = time.monotonic() + 30
        while sum(1 for v in seen.values() if v and v[-1][1]) < 3:
            assert time.monotonic() < deadline, seen
            try:
                batch = outputs.get(timeout=1)
            except queue.Empty:
                continue
            for e in batch:
                seen.setdefault(e.request_id, []).append((e.index, e.finish))
            assert table.used <= SLOTS
            if len(seen) == 3 and all(len(v) == 1 for v in seen.values()) and not looked.is_set():
                assert table.reserve(1) == 0, "a held choice must keep claims out"
                looked.set()
        assert sorted(seen) == ["multi~0", "multi~1", "multi~2"]
        for rid, toks in seen.items():
            assert [i for i, _ in toks] == list(range(5)) and toks[-1][1] == "length", (rid, toks)
        assert table.used == 0 and table.pending == 0
        assert looked.is_set(), "the three first tokens were not seen before a step: the test tests nothing"
    finally:
        looked.set()
        loop.stop()
        engine.__dict__.pop("generate", None)
    assert loop.error is None


def test_logprobs_ride_with_their_tokens_and_others_are_untouched(engine):
    """A slot with logprobs and one without in the same steps: the first gets a logprob per token
    (its greedy token is its best alternative), the second gets no logprobs and its plain tokens."""
    alone = _run_one(engine, _req("plain", 6))
    loop, table, inserts, outputs = _start(engine)
    try:
        with_lp = GenerationRequest("lp", [256, 70, 71, 72], 6, SamplingParams(logprobs=2), ignore_eos=True)
        for req in (with_lp, _req("plain", 6)):
            inserts.put(Insert(engine.export_prefix(engine.prefill(req.prompt_ids, req.sampling)), req,
                               _seat(table, req.request_id)))
        got: dict[str, list] = {}
        deadline = time.monotonic() + 30
        while sum(1 for v in got.values() if v[-1].finish) < 2:
            assert time.monotonic() < deadline
            for e in outputs.get(timeout=30):  # the first step compiles the logprobs variant (seconds on a loaded host)
                got.setdefault(e.request_id, []).append(e)
    finally:
        loop.stop()
    assert [e.token for e in got["plain"]] == alone and all(e.logprobs is None for e in got["plain"])
    from tandem_core.types import TokenLogprobs
    for e in got["lp"]:
        lp = TokenLogprobs.decode(e.logprobs)
        assert len(lp.top) == 2 and lp.top[0][0] == e.token and lp.logprob == pytest.approx(lp.top[0][1])


def _run_one(engine, req) -> list[int]:
    loop, table, inserts, outputs = _start(engine)
    try:
        inserts.put(Insert(engine.export_prefix(engine.prefill(req.prompt_ids, req.sampling)), req,
                           _seat(table, req.request_id)))
        toks: list[int] = []
        while True:
            for e in outputs.get(timeout=30):
                toks.append(e.token)
                if e.finish:
                    return toks
    finally:
        loop.stop()


def test_stop_id_and_context_end_are_decided_per_row_in_the_same_steps(engine):
    """The step's finish decisions run over all rows at once (decode_svc/loop.py `_process`): a
    row that samples its own stop id ends there (`stop`), a row whose context runs out ends by
    length at the last position, and neither decision leaks to the other row of the same steps.
    The row with the stop id is told the token it samples at index 4 (learned from a run alone),
    so it stops at the first index where that token comes."""
    alone = _run_one(engine, _req("probe", 12))  # indices 1..11
    stop_tok = alone[3]  # the token at index 4
    want_stop = next(i for i, t in enumerate(alone, start=1) if t == stop_tok)
    stopping = GenerationRequest("stops", [256, 70, 71, 72], 12, SamplingParams(), stop_token_ids=[stop_tok],
                                 ignore_eos=True)
    # 14 prompt positions of 64: the last token is index 50 (position 14 + 50 = 64 is past the end)
    long = GenerationRequest("ctx", [256] + [70] * 13, 100, SamplingParams(), ignore_eos=True)
    loop, table, inserts, outputs = _start(engine)
    try:
        for req in (stopping, long):
            inserts.put(Insert(engine.export_prefix(engine.prefill(req.prompt_ids, req.sampling)), req,
                               _seat(table, req.request_id)))
        got = _collect(outputs, 2, timeout_s=60)
    finally:
        loop.stop()
    assert loop.error is None
    assert got["stops"] == [(i, None) for i in range(1, want_stop)] + [(want_stop, "stop")]
    assert got["ctx"] == [(i, None) for i in range(1, 50)] + [(50, "length")]


# ---------------------------------------------------------------------------------------------
# grammar-constrained slots (the built-in trained model, temperature 1)

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8}, "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}
GRAMMAR = {"kind": "json_schema", "schema": PERSON}
G_SLOTS = 4


@pytest.fixture(scope="module")
def builtin():
    from tandem_core.tokenizer import load_tokenizer
    eng = load_engine("builtin", slots=G_SLOTS, max_len=128, prefill_buckets=(32,))
    return eng, load_tokenizer(eng.info)


def _valid_person(text: str) -> dict:
    obj = json.loads(text)
    assert isinstance(obj, dict) and set(obj) == {"name", "age"}, text
    assert isinstance(obj["name"], str) and len(obj["name"]) <= 8, text
    assert isinstance(obj["age"], int) and not isinstance(obj["age"], bool), text
    return obj


def _greq(tok, rid: str, seed: int, **kw) -> GenerationRequest:
    prompt = [tok.bos_token_id, *tok.encode("def person():\n    return ", add_special_tokens=False)]
    return GenerationRequest(rid, kw.pop("prompt_ids", prompt), 64, SamplingParams(temperature=1.0, seed=seed),
                             stop_token_ids=list(tok.eos_token_ids), grammar=GRAMMAR, **kw)


UNSEATED = 0  # an item's request-table key before `_drive` seats it


def _drive(eng, items, pipelined=True, expect_constrained=True) -> dict[str, list]:
    """Run `items` (Insert / LocalPrefill) through a fresh loop; every request's Emitted, in order."""
    table = RequestTable(G_SLOTS)
    bridge = Bridge(len(items) + G_SLOTS, 256)
    inserts, outputs = bridge.inserts, bridge.outputs
    loop = EngineLoop(eng, table, bridge, pipelined=pipelined)
    loop.start()
    got: dict[str, list] = {}
    try:
        for it in items:
            while table.reserve(1) == 0:
                time.sleep(0.005)
            it.key = table.claim(it.req.request_id)
            inserts.put(it)
        deadline = time.monotonic() + 120
        while sum(1 for v in got.values() if v[-1].finish) < len(items):
            assert time.monotonic() < deadline, {k: [(e.index, e.finish) for e in v] for k, v in got.items()}
            try:
                for e in outputs.get(timeout=1):
                    got.setdefault(e.request_id, []).append(e)
            except queue.Empty:
                continue
    finally:
        loop.stop()
    assert loop.error is None
    assert (loop.stats.constrained_steps > 0) == expect_constrained
    return got


@pytest.mark.slow  # make test-unit leaves it out: ten grammar-constrained generations of the built-in model
def test_builtin_model_under_a_json_schema_is_valid_ten_times_out_of_ten(builtin):
    """Temperature 1, max_tokens 64: half through a pulled KV (prefill masked as the prefill pod
    does), half prefilled by the loop itself; next to an unconstrained slot that keeps its tokens."""
    from tandem_core.grammar import Grammars
    from tandem_core.sampling_args import prefill_args
    eng, tok = builtin
    grammars = Grammars(eng.info)
    items, firsts = [], {}
    for i in range(10):
        req = _greq(tok, f"g{i}", seed=100 + i)
        if i % 2:
            items.append(LocalPrefill(req, ("s", "g", f"0-{i}".encode()), UNSEATED))
        else:  # token 0 is the prefill pod's: it does not come through the loop
            prefix = eng.prefill(req.prompt_ids, req.sampling, **prefill_args(req, grammars))
            firsts[req.request_id] = [prefix.first_token]
            items.append(Insert(eng.export_prefix(prefix), req, UNSEATED))
    items.append(LocalPrefill(GenerationRequest("free", items[1].req.prompt_ids, 12,
                                                SamplingParams(temperature=1.0, seed=5)), ("s", "g", b"9-9"), UNSEATED))
    got = _drive(eng, items)
    for i in range(10):
        ems = got[f"g{i}"]
        assert ems[-1].finish == "stop" and ems[-1].error is None, [(e.token, e.finish, e.error) for e in ems]
        toks = firsts.get(f"g{i}", []) + [e.token for e in ems]
        assert len(toks) <= 64
        _valid_person(tok.decode(toks))
    alone = _drive(eng, [LocalPrefill(items[-1].req, ("s", "g", b"9-9"), UNSEATED)], expect_constrained=False)
    assert [e.token for e in got["free"]] == [e.token for e in alone["free"]]


@pytest.mark.parametrize("via", ["insert", "local"])
def test_resumed_constrained_request_stays_valid(builtin, via):
    """A request resumed after 5 streamed tokens (they are in its prompt, start_index 5): the
    matcher is rebuilt from them (prefill masks token 5 from them too), so what follows completes
    the same JSON."""
    from tandem_core.grammar import Grammars
    from tandem_core.sampling_args import prefill_args
    eng, tok = builtin
    whole = _drive(eng, [LocalPrefill(_greq(tok, "whole", seed=7), ("s", "g", b"0-1"), UNSEATED)])["whole"]
    streamed = [e.token for e in whole[:5]]
    base = _greq(tok, "x", 0).prompt_ids
    items, firsts = [], {}
    for seed in (8, 9):
        req = _greq(tok, f"res{seed}", seed=seed, prompt_ids=base + streamed, start_index=5)
        if via == "local":
            items.append(LocalPrefill(req, ("s", "g", f"1-{seed}".encode()), UNSEATED))
            continue
        prefix = eng.prefill(req.prompt_ids, req.sampling, **prefill_args(req, Grammars(eng.info)))
        firsts[req.request_id] = [prefix.first_token]  # token 5: the prefill pod's, not the loop's
        items.append(Insert(eng.export_prefix(prefix), req, UNSEATED))
    got = _drive(eng, items)
    for rid, ems in got.items():
        assert ems[-1].finish == "stop", [(e.index, e.token, e.finish, e.error) for e in ems]
        assert ems[0].index == (5 if via == "local" else 6)
        _valid_person(tok.decode(streamed + firsts.get(rid, []) + [e.token for e in ems if e.token >= 0]))


def test_bad_resume_fails_that_request_only(builtin):
    """Streamed tokens that no longer match the grammar: that request ends with "error" naming
    the grammar; the loop lives and serves an unconstrained neighbour to its end."""
    eng, tok = builtin
    base = _greq(tok, "x", 0).prompt_ids
    bad = _greq(tok, "bad", seed=1, prompt_ids=base + tok.encode("hello", add_special_tokens=False), start_index=1)
    plain = GenerationRequest("plain", base, 6, SamplingParams(), ignore_eos=True)
    prefix = eng.prefill(bad.prompt_ids, bad.sampling)  # as a pod that did not mask would have
    got = _drive(eng, [Insert(eng.export_prefix(prefix), bad, UNSEATED), LocalPrefill(plain, ("s", "g", b"2-0"), UNSEATED)],
                 expect_constrained=False)
    assert got["bad"][-1].finish == "error" and "grammar" in got["bad"][-1].error
    assert [e.index for e in got["plain"]] == list(range(6)) and got["plain"][-1].finish == "length"


def test_complete_grammar_forces_eos_and_stop_even_with_ignore_eos(engine):
    """The byte-level tiny preset under a one-answer choice: the tokens are forced ("a", "b"), then
    the complete grammar ends the request with EOS, "stop", logprob 0 (certain), without a step."""
    loop, table, inserts, outputs = _start(engine)
    try:
        req = GenerationRequest("forced", [256, 70, 71], 20, SamplingParams(temperature=1.0, seed=2, logprobs=1),
                                ignore_eos=True, grammar={"kind": "choice", "choices": ["ab"]})
        inserts.put(LocalPrefill(req, ("s", "g", b"3-0"), _seat(table, "forced")))
        got: list = []
        deadline = time.monotonic() + 60
        while not (got and got[-1].finish):
            assert time.monotonic() < deadline, got
            try:
                got += outputs.get(timeout=1)
            except queue.Empty:
                continue
    finally:
        loop.stop()
    assert loop.error is None
    assert [(e.index, e.token, e.finish) for e in got] == [(0, 97, None), (1, 98, None), (2, 257, "stop")]
    from tandem_core.types import TokenLogprobs
    assert TokenLogprobs.decode(got[-1].logprobs).logprob == 0.0
    assert all(TokenLogprobs.decode(e.logprobs).logprob == pytest.approx(0.0, abs=1e-4) for e in got)


def test_the_steps_the_warm_up_left_compile_in_idle_time_and_then_serve_without_a_compile(caplog):
    """A decode pod's warm-up leaves the grammar-masked steps out (it reports ready sooner); its
    engine thread compiles them while it has nothing to do (`late_warm`), one per idle turn, and
    counts them (the heartbeat's `late_compiles`). Afterwards a masked step of every batch bucket
    compiles nothing."""
    import jax
    import numpy as np

    eng = load_engine("builtin", slots=4, max_len=64, prefill_buckets=(16,), kv_block_size=16)
    eng.warmup(prefill=False, masks=False)
    late = [v for v in eng.warm_steps(masks=True) if v.masked]
    assert [v.rows for v in late] == list(eng.batch_buckets) and len(late) >= 2
    table = RequestTable(4)
    loop = EngineLoop(eng, table, Bridge(4, 64), late_warm=late)
    loop.start()
    try:
        deadline = time.monotonic() + 120
        while loop.stats.late_compiled < len(late) and time.monotonic() < deadline and loop.error is None:
            time.sleep(0.05)
        assert loop.error is None and (loop.stats.late_compiled, loop.stats.late_compiles) == (len(late), len(late))
    finally:
        loop.stop()
    ones = np.full((max(eng.batch_buckets), (eng.info.vocab_size + 31) // 32), -1, np.int32)
    with jax.log_compiles(True), caplog.at_level("WARNING"):
        state = eng.init_state()
        for v in late:
            state, tokens = eng.generate(state, v.rows, masks=ones[:v.rows])
            np.asarray(tokens)
    compiled = [r.getMessage()[:60] for r in caplog.records if r.getMessage().startswith("Compiling jit(")
                and "_core" in r.getMessage()[:40]]
    assert compiled == []
