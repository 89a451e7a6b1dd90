"""A prefill pod's engine thread runs the queued prompts' calls back to back (prefill_svc/prefill.py
`_run_calls`): the next call starts on the engine thread as the last one ends, not after a hop
through the event loop, which in a burst is busy with the previous prompts' commits and KV pulls.
Each prompt still gets the first token its prefill alone gives; and a pod that stops fails the
prompts still queued with a clear error instead of leaving them waiting. Real tiny model, no Redis
(the Prefiller does no I/O)."""
from __future__ import annotations

import asyncio
import threading

import numpy as np
import pytest

from prefill_svc.kv_store import KVStore
from prefill_svc.prefill import Prefiller
from prefill_svc.settings import PrefillSettings
from tandem_core import keys
from tandem_core.settings import EngineConfig
from tandem_core.types import GenerationRequest, SamplingParams
from tandem_engine import load_engine

KS = keys.KeySpace(1)
WAIT_S = 120.0  # a deadline for a thing that should happen at once, not a timing under test


@pytest.fixture(scope="module")
def engine():
    return load_engine("tiny", slots=1, max_len=64, prefill_buckets=(16, 64))


def prefiller(engine, hold: threading.Event | None = None) -> tuple[Prefiller, threading.Semaphore]:
    """A Prefiller whose 64-token prompts each take their own engine call (a 16-token budget), and
    a semaphore released as each call ends (on the engine thread). `hold`: each call, once it has
    released the semaphore, waits for this event before it returns (the engine thread held there)."""
    s = PrefillSettings(engine=EngineConfig(model="tiny", max_len=64), prefill_batch_tokens=16)
    p = Prefiller(s, engine, KS, KVStore(1 << 30, 60), "127.0.0.1:1", "prefill-t")
    ended = threading.Semaphore(0)
    run = p.prefill_batch_sync

    def counted(reqs):
        try:
            return run(reqs)
        finally:
            ended.release()
            if hold is not None:
                hold.wait(WAIT_S)

    p.prefill_batch_sync = counted
    return p, ended


def requests(engine, count: int, seed: int) -> list[GenerationRequest]:
    rng = np.random.default_rng(seed)
    return [GenerationRequest(f"q{seed}-{i}", rng.integers(0, engine.info.vocab_size, 40).tolist(), 8)
            for i in range(count)]


async def test_queued_calls_run_back_to_back_while_the_loop_is_busy(engine):
    p, ended = prefiller(engine)
    reqs = requests(engine, 3, seed=1)
    tasks = [asyncio.create_task(p.prefill(r)) for r in reqs]
    for _ in range(3):  # the tasks queue their prompts, and the first call is handed to the engine thread
        await asyncio.sleep(0)
    # The loop is now busy (blocked right here) until all three calls have ended: the engine thread
    # must go from one to the next by itself.
    for i in range(3):
        assert ended.acquire(timeout=WAIT_S), (
            f"engine call {i + 1} of 3 did not run while the event loop was busy: the engine thread waits for the "
            "loop between calls")
    assert p.engine_calls == 3
    outs = await asyncio.wait_for(asyncio.gather(*tasks), WAIT_S)
    for req, (writes, held) in zip(reqs, outs):
        assert held == [req.request_id] and p.store.get(req.request_id) is not None
        alone = engine.prefill(req.prompt_ids, SamplingParams()).first_token
        assert p.store.get(req.request_id).payload.first_token == alone
    assert p.prefilled == 3
    p.close()


async def test_stopping_fails_the_prompts_still_queued(engine):
    release = threading.Event()
    p, ended = prefiller(engine, hold=release)
    reqs = requests(engine, 4, seed=2)
    tasks = [asyncio.create_task(p.prefill(r)) for r in reqs]
    for _ in range(3):
        await asyncio.sleep(0)
    # the first call ran, and the engine thread is held before it can take the next: the pod stops
    # there (unheld, the thread ran the other three before close() on a loaded machine: make test,
    # 2026-12-07, "every queued prompt ran after close()")
    assert ended.acquire(timeout=WAIT_S)
    p.close()
    release.set()
    done, pending = await asyncio.wait(tasks, timeout=WAIT_S)
    assert not pending, "prompts still queued when the pod stopped were left waiting"
    failed = [t.exception() for t in done if t.exception() is not None]
    assert failed, "every queued prompt ran after close()"
    for e in failed:
        assert isinstance(e, RuntimeError) and "shut down" in str(e), e
    assert len(failed) + p.prefilled == len(reqs)
