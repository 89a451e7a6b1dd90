"""The KV pool: greedy tokens equal to the reference forward's for every served family, and the
block accounting a decode pod relies on (insert takes blocks or raises OutOfKVBlocks,
reserve grants the oldest rows first and names the rest, free gives the blocks back, recycled
blocks carry no old KV into a new sequence).

Blocks of 4 positions here, so prompts of 13 and 40 tokens span 4 and 10 blocks, decode crosses
a block boundary every 4 steps; the step's table is every row's whole table (one compiled width),
read up to the longest row's blocks.
"""
from __future__ import annotations

import numpy as np
import pytest

from tandem_core.errors import AdmissionRejected, OutOfKVBlocks
from tandem_core.types import SamplingParams
from tandem_engine import load_engine, reference_greedy
from tandem_engine.logits import unpack_tokens
from tandem_engine.paged import NULL_BLOCK, BlockAllocator

GREEDY = SamplingParams()
BLOCK = 4
MAX_LEN = 128


def engine_of(path: str, **kw):
    return load_engine(path, slots=4, max_len=MAX_LEN, prefill_buckets=(16, 64), prefix_chunk=16,
                       kv_block_size=BLOCK, **kw)


def alone(engine, prompts: dict[int, list[int]], steps: int) -> dict[int, list[int]]:
    """Each prompt's greedy tokens by the reference forward (a full recompute per token, no KV)."""
    return {slot: reference_greedy(engine.params, engine.cfg, ids, steps + 1, pad_to=MAX_LEN)
            for slot, ids in prompts.items()}


def decode(engine, prompts: dict[int, list[int]], steps: int, per_call: int = 1, payload: bool = False):
    """Greedy tokens per slot: each prompt prefilled and inserted, then `steps` calls of
    `per_call` steps (reserve first)."""
    state = engine.init_state()
    out = {}
    for slot, ids in prompts.items():
        prefix = engine.prefill(ids, GREEDY)
        if payload:  # what a decode pod does with a pulled KV
            state = engine.insert_payload(engine.export_prefix(prefix), state, slot, GREEDY)
        else:
            state = engine.insert(prefix, state, slot, GREEDY)
        out[slot] = [prefix.first_token]
    for _ in range(steps):
        state, short = engine.reserve(state, per_call)
        assert short == []
        state, tokens = engine.generate(state, steps=per_call)
        host = np.asarray(tokens).reshape(per_call, -1)
        for slot in out:
            out[slot] += host[:, slot].tolist()
    return out, state


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from tests.families import FAMILIES, build_family

    out = {}
    for i, name in enumerate(FAMILIES):
        path = tmp_path_factory.mktemp(name)
        build_family(name, path, seed=i)
        out[name] = str(path)
    return out


@pytest.mark.slow  # make test-unit leaves it out: two engines for each of 9 families
@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "mistral", "gemma2", "gemma3", "mixtral",
                                    "qwen3_moe", "gpt_oss"])
def test_greedy_tokens_match_the_reference(family, family_dirs):
    """Every family (sliding windows of 8 < the prompts, softcaps, sinks, MoE): the reference
    forward's greedy tokens, one step per call and 3 per call, through insert and insert_payload,
    the ragged call and speculative verify calls; the 40-token prompt decodes past 64 positions
    (more read pieces)."""
    paged = engine_of(family_dirs[family])
    rng = np.random.default_rng(len(family))
    prompts = {0: rng.integers(0, 256, 13).tolist(), 2: rng.integers(0, 256, 40).tolist()}
    want = alone(paged, prompts, 30)
    got, state = decode(paged, prompts, 30)
    assert got == want
    got3, _ = decode(paged, prompts, 10, per_call=3, payload=True)  # multi-step: the same tokens as one-step
    assert got3 == {slot: tokens[:31] for slot, tokens in want.items()}
    if paged.window_frees:  # every layer windowed (mistral): the blocks the window passed went back
        assert paged.kv_blocks_of(2) <= -(-paged.window_frees // BLOCK) + 2
    else:
        assert paged.kv_blocks_of(2) == paged.kv_blocks_for(40 + 30)
    if family in ("qwen2", "gemma2", "gemma3", "gpt_oss"):  # windowed beside global layers: their own blocks
        _check_window_group(paged, state, rows=(0, 2))
    # the ragged call: prompt 2 in chunks of 16 (windows of 8 within a chunk and across two)
    # beside row 0 decoding, then both decode on: the reference's tokens
    state = paged.init_state()
    prefix = paged.prefill(prompts[0], GREEDY)
    state = paged.insert(prefix, state, 0, GREEDY)
    got = {0: [prefix.first_token]}
    state = paged.begin_prompt(state, 2, prompts[2], GREEDY)
    for _ in range(3 + 6):  # 40 tokens: 3 chunks
        state, out = paged.generate_ragged(state, None)
        for slot in got:
            got[slot].append(int(np.asarray(out.tokens)[slot]))
        if out.slot is not None:
            got[2] = [int(unpack_tokens(np.asarray(out.first)[None])[0])]
    assert got == {0: want[0][:10], 2: want[2][:7]}
    # speculative verify calls (tandem_engine/speculative.py): one row proposes its true continuation
    # (every token kept, 4 positions a call: windows and blocks crossed inside a call), the other
    # noise (every token rejected, its blocks handed back), then the other way round: the same tokens
    for truth in (0, 2):
        assert _speculate(paged, prompts, want, truth) == {slot: tokens[:31] for slot, tokens in want.items()}


def _speculate(engine, prompts, want, truth: int, steps: int = 30):
    state = engine.init_state()
    out = {}
    for slot, ids in prompts.items():
        prefix = engine.prefill(ids, GREEDY)
        state = engine.insert(prefix, state, slot, GREEDY)
        out[slot] = [prefix.first_token]
    while min(len(o) for o in out.values()) < steps + 1:
        props = {s: want[s][len(o):len(o) + 3] if s == truth else [1, 2, 3] for s, o in out.items()}
        state, spec = engine.verify(state, props, 3, engine.slots)
        for s in out:
            out[s] += spec.tokens[s, :spec.counts[s]].tolist()
    return {s: o[:steps + 1] for s, o in out.items()}


def _check_window_group(paged, state, rows):
    """A family with windowed and global layers (paged.WindowGroup): the windowed layers' buffers
    hold `window_span` blocks a row (and, with reuse, a kept tail's a row), not max_len's, and each
    running row holds at most that many of them, its first ones given back,
    none wholly before its window and the positions it keeps behind it for its tail."""
    span = paged.window_span
    assert paged.windowed and 0 < span < paged.max_blocks_per_seq
    group = paged._window
    assert group.total == paged.slots * span
    for i, w in enumerate(paged.windowed):
        assert state.k[i].shape[1] == 1 + (group.total if w else paged.kv_blocks_total)
    table = np.asarray(state.window_table)
    for slot in rows:
        pos = int(paged._pos[slot])
        held = np.flatnonzero(table[slot])
        assert 0 < len(held) <= span, (slot, held)
        assert held[0] > 0, (slot, held)  # its first windowed blocks went back
        assert held[0] >= (pos - 1 - max(paged.cfg.windows) + 1 - group.behind) // BLOCK  # nothing older
    # the heartbeat's count (decode_svc/blocks.py): the blocks the rows' windowed tables hold
    from decode_svc.blocks import BlockBudget

    group = BlockBudget(paged, reserve_steps=4).summary()["window_group"]
    assert group["blocks_used"] + group["blocks_kept"] == int(np.count_nonzero(paged._window.table)) > 0
    assert (group["blocks_per_row"], group["blocks_total"]) == (span, paged._window.total)


@pytest.fixture(scope="module")
def tiny():
    return engine_of("tiny")


def test_freed_rows_recycle_blocks_without_old_kv(tiny):
    """A row freed mid-decode gives its blocks back; a new prompt in another row (the same
    blocks, recycled) decodes as it would alone while the freed row, still inside the step's
    batch, keeps stepping (its writes go to the null block), and the row beside it is
    undisturbed."""
    paged = tiny
    rng = np.random.default_rng(1)
    a, b, c = (rng.integers(0, 200, n).tolist() for n in (30, 9, 21))
    alone_b, _ = decode(paged, {1: b}, 24)
    alone_c, _ = decode(paged, {0: c}, 12)
    state = paged.init_state()
    total = paged.kv_blocks_total
    for slot, ids in ((0, a), (1, b)):
        state = paged.insert(paged.prefill(ids, GREEDY), state, slot, GREEDY)
    out_b = [paged.prefill(b, GREEDY).first_token]
    for _ in range(12):
        state, short = paged.reserve(state, 1)
        assert short == []
        state, tokens = paged.generate(state)
        out_b.append(int(np.asarray(tokens)[1]))
    held_a = paged.kv_blocks_of(0)
    assert held_a == paged.kv_blocks_for(30 + 12)
    free_before = paged.kv_blocks_free()
    state = paged.free(state, 0)
    assert paged.kv_blocks_free() == free_before + held_a and paged.kv_blocks_of(0) == 0
    assert not np.asarray(state.block_table)[0].any()  # the free row now writes the null block
    state = paged.insert(paged.prefill(c, GREEDY), state, 2, GREEDY)
    out_c = [paged.prefill(c, GREEDY).first_token]
    for _ in range(12):
        state, short = paged.reserve(state, 1)
        assert short == []
        state, tokens = paged.generate(state)
        out_b.append(int(np.asarray(tokens)[1]))
        out_c.append(int(np.asarray(tokens)[2]))
    assert out_c == alone_c[0] and out_b == alone_b[1]
    state = paged.free(paged.free(state, 2), 1)
    assert paged.kv_blocks_free() == total


def test_a_pool_too_small_raises_and_reserve_names_the_newest():
    """Insert raises OutOfKVBlocks (retryable, state untouched) when the prompt's blocks are not
    free; reserve grants the oldest rows first and returns the rest; after the caller frees
    those, reserve succeeds and the oldest row's tokens are what they would have been."""
    paged = load_engine("tiny", slots=4, max_len=MAX_LEN, prefill_buckets=(16, 64),
                        kv_block_size=BLOCK, kv_blocks=9)
    assert paged.kv_blocks_total == 9 and paged.kv_blocks_free() == 9
    rng = np.random.default_rng(2)
    a, b = rng.integers(0, 200, 16).tolist(), rng.integers(0, 200, 12).tolist()  # 4 and 3 blocks
    state = paged.init_state()
    state = paged.insert(paged.prefill(a, GREEDY), state, 0, GREEDY)
    state = paged.insert(paged.prefill(b, GREEDY), state, 1, GREEDY)
    assert paged.kv_blocks_free() == 2
    with pytest.raises(OutOfKVBlocks, match="free a sequence") as err:
        paged.insert(paged.prefill(a, GREEDY), state, 2, GREEDY)
    assert isinstance(err.value, AdmissionRejected) and err.value.retryable
    assert paged.kv_blocks_free() == 2  # nothing taken; the state was not donated
    state, short = paged.reserve(state, 8)  # a: 16 + 8 -> 6 blocks (+2), b: 12 + 8 -> 5 (+2): only a fits
    assert short == [1] and paged.kv_blocks_of(0) == 6 and paged.kv_blocks_of(1) == 3
    with pytest.raises(RuntimeError, match="free some slots"):  # generate cannot reserve b's either
        paged.generate(state, steps=8)
    assert paged.kv_blocks_of(1) == 3  # nothing granted; the state was not donated
    state = paged.free(state, 1)  # the pod hands the newest back
    state, short = paged.reserve(state, 8)
    assert short == []
    out = [paged.prefill(a, GREEDY).first_token]
    for _ in range(2):
        state, tokens = paged.generate(state, steps=4)
        out += np.asarray(tokens)[:, 0].tolist()
    assert out == alone(paged, {0: a}, 8)[0]


def test_bad_options_are_refused():
    with pytest.raises(ValueError, match="kv_block_size"):
        load_engine("tiny", slots=2, max_len=64, prefill_buckets=(16,), kv_block_size=0)
    with pytest.raises(ValueError, match="kv_blocks"):
        load_engine("tiny", slots=2, max_len=64, prefill_buckets=(16,), kv_blocks=0)


def test_allocator_refcounts():
    pool = BlockAllocator(4)
    ids = pool.alloc(3)
    assert ids == [1, 2, 3] and NULL_BLOCK not in ids and pool.free_count() == 1
    assert pool.alloc(2) is None and pool.free_count() == 1
    pool.share(ids[:2])  # a second sequence holds the first two (a shared prefix)
    assert pool.shared(1) and not pool.shared(3) and pool.exclusive(ids) == 1
    pool.release(ids)
    assert pool.free_count() == 2 and pool.shared(1) is False
    pool.release(ids[:2])
    assert pool.free_count() == 4
    with pytest.raises(ValueError, match="released twice"):
        pool.release([1])


def test_warmup_compiles_the_paged_steps_and_leaves_every_block_free():
    engine = load_engine("tiny", slots=2, max_len=64, prefill_buckets=(16,), kv_block_size=8,
                         steps_per_dispatch=2)
    engine.warmup(prefill=False, logprobs=False)
    assert engine.kv_blocks_free() == engine.kv_blocks_total == 2 * 8


@pytest.mark.slow  # make test-unit leaves it out: compiles every step variant of a paged pod
def test_warmup_compiles_every_step_variant_a_decode_then_runs():
    """What a paged decode pod warms (no prefill; logprobs and grammar-masked variants too) is every
    step it runs later: a row growing from 4 blocks to 10 of the table's 16 (one table width: the
    step reads the blocks in use through a loop with traced bounds, attention.paged_attention), one step
    and steps_per_dispatch of them, with logprobs and masked, compiles no new step (generate_core's
    compiled variants stay as many), and the pod compiles one width per variant, not one per width."""
    from tandem_engine.cores import generate_core

    engine = load_engine("tiny", slots=2, max_len=256, prefill_buckets=(64,), kv_block_size=16,
                         steps_per_dispatch=2)
    assert {w for _, w, *_ in engine.warm_steps(True, True)} == {engine.max_blocks_per_seq} == {16}
    done = []
    n = engine.warmup(prefill=False, logprobs=True, masks=True, progress=lambda *a: done.append(a))
    assert n == len(engine.batch_buckets) * 3 == len(done) and done[-1][:2] == (n, n)  # logprobs: no variant
    compiled = generate_core._cache_size()
    state = engine.init_state()
    prompt = list(range(3, 60))  # 57 positions: 4 blocks, the narrowest width
    state = engine.insert(engine.prefill(prompt, GREEDY), state, 0, GREEDY)
    ones = np.full((1, (engine.info.vocab_size + 31) // 32), -1, np.int32)  # a mask allowing every token
    pos = len(prompt)
    while pos < 160:  # past 64 and 128 positions: more pieces of the step's read loop
        for kw in ({"steps": 2}, {"steps": 2, "logprobs": True}, {}, {"logprobs": True}, {"masks": ones}):
            state, short = engine.reserve(state, kw.get("steps", 1))
            assert short == []
            state, tokens = engine.generate(state, **kw)
            pos += kw.get("steps", 1)
        assert generate_core._cache_size() == compiled, f"a step at position {pos} compiled after warm-up"
    np.asarray(tokens)


def test_a_reserve_that_rebuilds_the_block_table_compiles_no_new_step():
    """A row crossing a block boundary mid-decode gets a new block, so `reserve` rebuilds the
    device table: it must be the same kind of array as the step's own outputs (committed), or the
    step compiles again in the middle of serving (seen: a second and a third compile of the same
    step, 2 s each on 2 cores, at the first boundary crossed). The built-in model: its weights are
    read from a checkpoint onto the device (committed), so the step's outputs are committed too."""
    from tandem_engine.cores import generate_core

    engine = load_engine("builtin", slots=2, max_len=64, prefill_buckets=(16,), kv_block_size=4)
    state = engine.init_state()
    for slot in (0, 1):  # 8 positions each: 2 full blocks
        state = engine.insert(engine.prefill(list(range(3 + slot, 11 + slot)), GREEDY), state, slot, GREEDY)

    def step(state):
        state, short = engine.reserve(state, 1)
        assert short == []
        state, tokens = engine.generate(state)
        np.asarray(tokens)
        return state

    before = generate_core._cache_size()
    for _ in range(12):  # positions 8-19: blocks 3, 4 and 5 taken at 8, 12 and 16, the table rebuilt there
        state = step(state)
    # one variant for every step: the state the first step gets (inserts' outputs and a rebuilt
    # table), the steps' own outputs, and a rebuilt table beside them are one cache key
    assert generate_core._cache_size() - before <= 1


def test_a_windowed_family_gives_back_the_blocks_its_window_passed(tmp_path):
    """Every layer windowed (mistral, window 8 here): `reserve` gives a row's blocks wholly
    before its next step's window back to the pool, the row decodes the reference's tokens all the
    same, and a family with a global layer keeps every block (gemma2: windows on alternate layers)."""
    pytest.importorskip("transformers")
    from tests.families import WINDOW, build_family

    build_family("mistral", tmp_path / "mistral", seed=3)
    paged = engine_of(str(tmp_path / "mistral"))
    assert paged.window_frees == WINDOW
    prompt = np.random.default_rng(5).integers(0, 256, 40).tolist()  # 10 blocks of 4
    want = alone(paged, {0: prompt}, 30)[0]
    state = paged.init_state()
    prefix = paged.prefill(prompt, GREEDY)
    state = paged.insert(prefix, state, 0, GREEDY)
    got = [prefix.first_token]
    held = []
    for _ in range(30):
        state, short = paged.reserve(state, 1)
        assert short == []
        held.append(paged.kv_blocks_of(0))
        state, tokens = paged.generate(state)
        got.append(int(np.asarray(tokens)[0]))
    assert got == want
    # positions [p - 7, p] and the block of the next write: never more than 4 blocks of 4, where
    # the whole row would hold 10 to 18
    assert max(held) <= -(-WINDOW // BLOCK) + 2, held
    assert paged.kv_blocks_free() == paged.kv_blocks_total - held[-1]
    state = paged.free(state, 0, tokens=prompt + got[:-1])  # nothing kept: its first blocks are gone
    assert paged.kv_blocks_free() == paged.kv_blocks_total
    assert paged.match_prefix(prompt) is None
    build_family("gemma2", tmp_path / "gemma2", seed=4)
    assert engine_of(str(tmp_path / "gemma2")).window_frees == 0


def _next_turn(paged) -> dict[str, list[int]]:
    """A 30-token first turn decoded 20 tokens and freed with its tokens (kept for reuse); the
    next turn (51 tokens) matched to the first turn's 48 positions, then decoded 12 tokens over the
    match twice: its rest's KV inserted (a pulled part) and its rest prefilled by the ragged call."""
    from tandem_core.types import KVPayload

    rng = np.random.default_rng(7)
    turn1 = rng.integers(0, 256, 30).tolist()
    state = paged.init_state()
    prefix = paged.prefill(turn1, GREEDY)
    state = paged.insert(prefix, state, 0, GREEDY)
    out = [prefix.first_token]
    for _ in range(20):  # past the window (8) and the row's windowed blocks: the early ones went back
        state, short = paged.reserve(state, 1)
        assert short == []
        state, tokens = paged.generate(state)
        out.append(int(np.asarray(tokens)[0]))
    fed = turn1 + out[:-1]  # 49 positions: a chain of 12 full blocks (48)
    if paged.windowed:
        assert not paged._window.table[0, 0]  # the window gave the row's first windowed block back
    state = paged.free(state, 0, tokens=fed)
    # 51 tokens: the first step's window (8, from position 44) reaches into the match
    turn2 = fed + [out[-1]] + rng.integers(0, 256, 2).tolist()
    match = paged.match_prefix(turn2)
    assert match is not None and match.length == 48
    if paged.windowed:  # the windowed blocks of the window before position 48
        assert match.window_from == (48 - 8 + 1) // BLOCK and len(match.window_blocks) == 48 // BLOCK - 10
    whole = paged.export_prefix(paged.prefill(turn2, GREEDY))
    rest = KVPayload(k=whole.k[:, 48:51].copy(), v=whole.v[:, 48:51].copy(), true_length=51,
                     first_token=whole.first_token, start=48)
    state = paged.insert_payload(rest, state, 1, GREEDY, cached=match)
    inserted = [whole.first_token]
    for _ in range(12):
        state, short = paged.reserve(state, 1)
        assert short == []
        state, tokens = paged.generate(state)
        inserted.append(int(np.asarray(tokens)[1]))
    again = paged.match_prefix(turn2)  # kept still (the tail too): the ragged call over the match
    assert again is not None and again.length == 48
    state = paged.begin_prompt(state, 2, turn2, GREEDY, cached=again)
    seated: list[int] = []
    for _ in range(8):  # 3 tokens in one chunk of 16: the first token in the first call
        state, res = paged.generate_ragged(state, None)
        if seated:
            seated.append(int(np.asarray(res.tokens)[2]))
        if res.slot is not None:
            seated.append(int(unpack_tokens(np.asarray(res.first)[None])[0]))
    state = paged.free(state, 1)
    state = paged.free(state, 2)
    return {"inserted": inserted, "seated": seated, "want": alone(paged, {1: turn2}, 12)[1]}


def test_a_next_turn_starts_on_the_kept_chain_and_its_windowed_tail(tmp_path):
    """Windowed layers beside global ones (gemma2: windows of 8 on alternate layers) with reuse:
    a finished row leaves its global blocks as a chain and the windowed blocks of the window before
    the chain's end as its tail (paged.WindowGroup.keep_tail); the next turn matches the chain to
    its end, takes the tail, and decodes the tokens the same engine keeping every block decodes
    (`kv_window_group=False`: the reuse of before), through both ways in. Not the reference's own
    token for token: the first turn's output KV was computed by decode steps, and this random
    model's near ties flip tokens on both engines alike (docs/limits.md, decode-side reuse)."""
    pytest.importorskip("transformers")
    from tests.families import build_family

    build_family("gemma2", tmp_path / "gemma2", seed=4)
    grouped = engine_of(str(tmp_path / "gemma2"))
    assert grouped.windowed and grouped.kv_reuse
    got = _next_turn(grouped)
    # every row freed: only the kept tails hold windowed blocks, one reference each (no pin leaked)
    tails = sum(len(b) for _, b in grouped._window._tails.values())
    summary = grouped.window_group_summary()
    assert summary["blocks_used"] == 0 and summary["blocks_kept"] == tails > 0 and summary["tails"] == 1
    assert int(grouped._window.alloc.refcount.sum()) == tails
    whole = engine_of(str(tmp_path / "gemma2"), kv_window_group=False)
    assert not whole.windowed
    base = _next_turn(whole)
    assert got["inserted"] == base["inserted"] and got["seated"] == base["seated"][:len(got["seated"])]
    assert len(got["seated"]) == 8


@pytest.mark.parametrize("block", [4, pytest.param(16, marks=pytest.mark.slow)])  # slow: 17 s
def test_the_lane_folded_pool_decodes_the_reference_tokens(block):
    """The built-in model (head_dim 64, whose attention tells KV positions apart: a random tiny
    model's barely does) over its lane-folded pool (pool_layout.py: two positions a 128-lane row;
    at blocks of 4 two rows a block, at 16 eight): the reference forward's greedy tokens through
    insert, insert_payload and multi-step calls, and for a prompt prefilled in chunks beside the
    decode rows (the chunk's neighbouring positions written into the two halves of one row in one
    call). Prompts of odd lengths, so a row's last block is part-full at every parity."""
    from tandem_engine.logits import unpack_tokens
    from tandem_engine.pool_layout import block_shape

    paged = load_engine("builtin", slots=3, max_len=MAX_LEN, prefill_buckets=(16, 64), prefix_chunk=16,
                        kv_block_size=block)
    assert paged.init_state().k[0].shape[2:] == block_shape(block, 64) == (block // 2, 128)
    rng = np.random.default_rng(block)
    prompts = {0: rng.integers(0, 250, 13).tolist(), 2: rng.integers(0, 250, 26).tolist()}
    want = alone(paged, prompts, 12)
    got, _ = decode(paged, prompts, 12)
    assert got == want
    got3, _ = decode(paged, prompts, 4, per_call=3, payload=True)
    assert got3 == {slot: tokens[:13] for slot, tokens in want.items()}
    p = rng.integers(0, 250, 37).tolist()  # chunks of 16, 16 and 5
    state = paged.init_state()
    state = paged.insert(paged.prefill(prompts[0], GREEDY), state, 0, GREEDY)
    state = paged.begin_prompt(state, 1, p, GREEDY)
    first = None
    while first is None:
        state, out = paged.generate_ragged(state, 1)
        if out.slot is not None:
            first = int(unpack_tokens(np.asarray(out.first)[None])[0])
    mine = [first]
    for _ in range(6):
        state, out = paged.generate_ragged(state, 2)
        mine.append(int(np.asarray(out.tokens)[1]))
    assert mine == reference_greedy(paged.params, paged.cfg, p, 7, pad_to=MAX_LEN)
