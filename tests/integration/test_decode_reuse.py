"""Decode-side reuse (tandem_engine/block_cache.py): a paged decode pod keeps a finished
conversation turn's KV blocks and pulls only the positions after them for the next turn. Real
Redis, real gRPC KV server (the prefill pod's servicer, `from_position`), real engines: the
built-in model (its attention tells KV positions apart; a random tiny model's barely does).

1. Turn 2 (turn 1's prompt + its output + a new message) moves only what turn 1's kept blocks do
   not cover, its tokens are the whole-prompt run's, and no block stays pinned.
2. A pull that fails after its prompt matched (the prefill pod lost the KV) hands the request back
   and lets the match go: every block of the pool is free again.
"""
from __future__ import annotations

import asyncio
import contextlib

import pytest

from decode_svc.settings import DecodeSettings
from prefill_svc.kv_store import KVStore
from tandem_core import keys
from tandem_core.bus import groups, ready
from tandem_core.settings import EngineConfig, RedisConfig
from tandem_core.types import GenerationRequest, SamplingParams
from tandem_engine import load_engine
from tests.integration.test_decode_blocks import KS, _greedy, _kv_server, _Pod, _tokens

MAX_LEN = 128
BLOCK = 8
BUCKETS = (32, 64, 128)


@pytest.fixture(scope="module")
def prefill_engine():
    """The prefill pod's engine and the reference run (slot layout)."""
    return load_engine("builtin", slots=1, max_len=MAX_LEN, prefill_buckets=BUCKETS)


def _decode_engine():
    return load_engine("builtin", slots=4, max_len=MAX_LEN, prefill_buckets=BUCKETS,
                       kv_block_size=BLOCK, kv_blocks=48)


async def _offer(r, pool, store, address, engine, req: GenerationRequest, hold: bool = True):
    """Prefill `req` as a prefill pod does, hold its KV (unless not `hold`: a pod that lost it)
    and write its ready notice."""
    payload = engine.export_prefix(engine.prefill(req.prompt_ids, req.sampling))
    held = store.put(req.request_id, payload)
    if not hold:
        store.release(req.request_id)
    pipe = r.pipeline(transaction=False)
    ready.add_ready(pipe, KS, pool, ready.ReadyNotice(req, address, held.capability, payload.nbytes, "p0",
                                                      payload.first_token), 1000)
    groups.ring(pipe, KS, pool, keys.DECODE_GROUP)
    await pipe.execute()
    return payload


async def _finished(r, rid: str, tries: int = 1500) -> list[int]:
    for _ in range(tries):
        got, done = await _tokens(r, rid)
        if done:
            return [t for _i, t in got]
        await asyncio.sleep(0.02)
    raise AssertionError(f"{rid} did not finish")


def _settings(redis_url, pool):
    return DecodeSettings(redis=RedisConfig(url=redis_url), engine=EngineConfig(model="builtin", max_len=MAX_LEN),
                          pool=pool, slots=4, claim_block_ms=50)


@contextlib.asynccontextmanager
async def _serving(redis_url, r, pool: str, engine):
    """A decode pod of `engine` on `pool` beside a prefill pod's KV server: (pod, store, address)."""
    await groups.ensure_groups(r, KS, pool)
    store = KVStore(1 << 30, 60)
    server, address = await _kv_server(store)
    try:
        async with _Pod(_settings(redis_url, pool), r, engine) as pod:
            yield pod, store, address
    finally:
        await server.stop(None)


async def test_a_second_turn_pulls_only_what_the_first_turn_did_not_leave(redis_url, redis_client, prefill_engine):
    engine = _decode_engine()
    r, pool = redis_client, "reuse-turns"
    per_token = engine.cfg.num_layers * 2 * engine.cfg.num_kv_heads * engine.cfg.head_dim * 4  # float32
    turn1 = [256] + list(range(300, 320))  # 21 tokens
    async with _serving(redis_url, r, pool, engine) as (pod, store, address):
        req1 = GenerationRequest("turn-1", turn1, 12, SamplingParams(), ignore_eos=True)
        await _offer(r, pool, store, address, prefill_engine, req1)
        out1 = await _finished(r, "turn-1")
        assert len(out1) == 11  # indices 1-11 (token 0 is the prefill pod's to write)
        before = pod.io.claims.pulled_kv_bytes
        # the KV the row held: turn1, token 0, then 10 of the 11 it emitted: 32 positions, 4 blocks
        token0 = _greedy(prefill_engine, turn1, 1)[0]
        turn2 = turn1 + [token0] + out1 + [256, 400, 401, 402, 403, 404, 405]
        req2 = GenerationRequest("turn-2", turn2, 8, SamplingParams(), ignore_eos=True)
        await _offer(r, pool, store, address, prefill_engine, req2)
        out2 = await _finished(r, "turn-2")
        moved = pod.io.claims.pulled_kv_bytes - before
        kept = (len(turn1) + 11) // BLOCK * BLOCK  # positions of full blocks the first row left
        assert pod.io.claims.reused_tokens == kept
        assert moved == (len(turn2) - kept) * per_token, (moved, len(turn2), kept)
        summary = engine.kv_reuse_summary()
        assert summary["hits"] == kept and summary["kept"] >= kept // BLOCK
        for _ in range(100):  # the engine thread frees turn-2's row just after its last token
            if engine.kv_blocks_free() == engine.kv_blocks_total:
                break
            await asyncio.sleep(0.02)
        assert engine.kv_blocks_free() == engine.kv_blocks_total  # nothing left pinned
    assert out2 == _greedy(prefill_engine, turn2, 8)[1:]  # the whole prompt's run, token for token


async def test_a_failed_pull_after_a_match_lets_the_match_go(redis_url, redis_client, prefill_engine, caplog):
    engine = _decode_engine()
    r, pool = redis_client, "reuse-lost"
    prompt = [256] + list(range(500, 530))
    caplog.set_level("WARNING", logger="decode_svc.claims")
    async with _serving(redis_url, r, pool, engine) as (pod, store, address):
        await _offer(r, pool, store, address, prefill_engine,
                     GenerationRequest("first", prompt, 4, SamplingParams(), ignore_eos=True))
        await _finished(r, "first")
        # the same prompt again, its KV gone from the prefill pod: the pull fails after the match
        await _offer(r, pool, store, address, prefill_engine,
                     GenerationRequest("again", prompt + [7], 4, SamplingParams(), ignore_eos=True), hold=False)
        for _ in range(500):
            if pod.io.handback.handed_back:
                break
            await asyncio.sleep(0.02)
        assert pod.io.handback.handed_back == 1
        assert engine.kv_reuse_summary()["hits"] > 0, "the prompt did not match: the test tests nothing"
        assert engine.kv_blocks_free() == engine.kv_blocks_total  # the match's pins were let go
    assert any("KV pull failed" in rec.getMessage() for rec in caplog.records)


async def test_a_request_whose_match_holds_part_of_a_small_pool_still_goes_in(redis_url, redis_client,
                                                                               prefill_engine):
    """16 blocks (one max_len sequence). Turn 1 leaves 4 blocks kept; turn 2 (100 tokens: 13
    blocks) matches them, so it holds 4 pinned and needs 9 more of the 12 free: it fits. Counted
    at its whole 13 blocks against the 12 free it would wait in the held queue for ever (its own
    pins are what is missing)."""
    engine = load_engine("builtin", slots=4, max_len=MAX_LEN, prefill_buckets=BUCKETS,
                         kv_block_size=BLOCK, kv_blocks=16)
    r, pool = redis_client, "reuse-small"
    turn1 = [256] + list(range(300, 320))
    async with _serving(redis_url, r, pool, engine) as (pod, store, address):
        await _offer(r, pool, store, address, prefill_engine,
                     GenerationRequest("small-1", turn1, 12, SamplingParams(), ignore_eos=True))
        out1 = await _finished(r, "small-1")
        token0 = _greedy(prefill_engine, turn1, 1)[0]
        turn2 = (turn1 + [token0] + out1 + list(range(600, 700)))[:100]
        await _offer(r, pool, store, address, prefill_engine,
                     GenerationRequest("small-2", turn2, 8, SamplingParams(), ignore_eos=True))
        out2 = await _finished(r, "small-2", tries=750)
        assert pod.io.claims.reused_tokens == 32
    assert out2 == _greedy(prefill_engine, turn2, 8)[1:]


@pytest.fixture(scope="module")
def gemma2_dir(tmp_path_factory):
    """A gemma2 checkpoint written by transformers (tests/families.py: windows of 8 on alternate
    layers, random weights, vocabulary 320)."""
    pytest.importorskip("transformers")
    from tests.families import build_family

    path = tmp_path_factory.mktemp("gemma2")
    build_family("gemma2", path, seed=4)
    return str(path)


async def _two_turns(redis_url, r, pool: str, engine, prefill) -> dict:
    """Turn 1 (21 tokens, 12 out) and turn 2 (its 33 positions and one more token: the first step's
    window reaches back into what turn 1 left) through a decode pod, as the first test runs them."""
    turn1 = [2] + list(range(100, 120))
    async with _serving(redis_url, r, pool, engine) as (pod, store, address):
        await _offer(r, pool, store, address, prefill,
                     GenerationRequest(f"{pool}-1", turn1, 12, SamplingParams(), ignore_eos=True))
        out1 = await _finished(r, f"{pool}-1")
        before = pod.io.claims.pulled_kv_bytes
        turn2 = turn1 + [_greedy(prefill, turn1, 1)[0]] + out1 + [7]  # 34 tokens
        await _offer(r, pool, store, address, prefill,
                     GenerationRequest(f"{pool}-2", turn2, 8, SamplingParams(), ignore_eos=True))
        out2 = await _finished(r, f"{pool}-2")
        return {"out2": out2, "moved": pod.io.claims.pulled_kv_bytes - before,
                "reused": pod.io.claims.reused_tokens, "window": engine.window_group_summary()}


async def test_a_family_with_windowed_and_global_layers_reuses_a_turn_as_one_that_keeps_every_block(
        redis_url, redis_client, gemma2_dir):
    """gemma2 (windows of 8 beside global layers) on a decode pod whose windowed layers keep only
    their window's blocks (paged.WindowGroup) and whose block cache keeps a finished turn's chain
    with its windowed tail: turn 2 pulls only what turn 1 did not leave (32 positions reused), and
    decodes the tokens a pod keeping every block of every layer decodes (`kv_window_group=False`)."""
    prefill = load_engine(gemma2_dir, slots=1, max_len=MAX_LEN, prefill_buckets=BUCKETS)

    def decode_engine(group: bool):
        return load_engine(gemma2_dir, slots=4, max_len=MAX_LEN, prefill_buckets=BUCKETS, prefix_chunk=16,
                           kv_block_size=BLOCK, kv_blocks=48, kv_window_group=group)

    grouped, whole = decode_engine(True), decode_engine(False)
    assert grouped.windowed and grouped.kv_reuse and not whole.windowed
    got = await _two_turns(redis_url, redis_client, "reuse-window", grouped, prefill)
    base = await _two_turns(redis_url, redis_client, "reuse-whole", whole, prefill)
    assert got["reused"] == base["reused"] == 32 and got["moved"] == base["moved"]
    # turn 1's tail was kept (and turn 2's on its finish), and turn 2's row started on it
    assert got["window"]["tails"] >= 1 and got["window"]["tails_taken"] == 1
    assert got["out2"] == base["out2"] and len(got["out2"]) == 7
