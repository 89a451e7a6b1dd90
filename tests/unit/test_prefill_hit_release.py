"""A prefill pod's device prefix cache (tandem_engine/prefix_pool.py) pins a hit's blocks at the
lookup: a request that fails before its prefill runs (a grammar that cannot be compiled, a bad
token) must let them go, or the pool's blocks stay pinned for ever and the cache shrinks by each
such request. Real built-in model, no Redis (the Prefiller does no I/O)."""
from __future__ import annotations

import pytest

from prefill_svc.kv_store import KVStore
from prefill_svc.prefill import Prefiller
from prefill_svc.settings import PrefillSettings
from tandem_core import keys
from tandem_core.errors import InvalidRequest
from tandem_core.settings import EngineConfig
from tandem_core.types import GenerationRequest, SamplingParams
from tandem_engine import load_engine
from tandem_engine.prefix_pool import device_cache_for

KS = keys.KeySpace(1)


def test_a_request_that_fails_before_its_prefill_lets_its_hit_go():
    engine = load_engine("builtin", slots=1, max_len=128, prefill_buckets=(32, 128), prefix_chunk=32)
    cache = device_cache_for(engine, 16, 20 * device_cache_for(engine, 16, 1).block_bytes)
    s = PrefillSettings(engine=EngineConfig(model="builtin", max_len=128))
    p = Prefiller(s, engine, KS, KVStore(1 << 30, 60), "127.0.0.1:1", "prefill-t", cache)
    prompt = list(range(300, 350))
    p.prefill_sync(GenerationRequest("warm", prompt, 4, SamplingParams()))  # its 3 full blocks cached
    free = cache._alloc.free_count() + cache._alloc.cached_only
    assert len(cache) == 3 and free == 20
    bad = GenerationRequest("bad", prompt + [1], 4, SamplingParams(), grammar={"kind": "bogus"})
    with pytest.raises(InvalidRequest, match="bogus"):
        p.prefill_sync(bad)  # the grammar fails before the engine is called
    assert cache.stats.hits > 0, "the request did not hit: the test tests nothing"
    assert cache._alloc.free_count() + cache._alloc.cached_only == 20  # no block left pinned
    p.device.shutdown(wait=False)
