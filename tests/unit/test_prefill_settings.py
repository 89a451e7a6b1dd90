"""The worker settings block (tandem_core.settings.WorkerSettings) that the prefill and decode
settings inherit: each keeps its env prefix and its own defaults where the two differ, a shared
field arrives from either prefix, and the engine is built from one mapping that
`tandem_engine.load_engine` accepts."""
from __future__ import annotations

import inspect
import os

import pytest

from decode_svc.settings import DecodeSettings
from prefill_svc.settings import PrefillSettings
from tandem_core.settings import EngineConfig, PrefixCacheConfig, WorkerSettings
from tandem_engine import load_engine


@pytest.fixture(autouse=True)
def _no_tandem_env(monkeypatch):
    for k in [k for k in os.environ if k.startswith("TANDEM_")]:
        monkeypatch.delenv(k)


def test_each_service_keeps_its_own_defaults():
    p, d = PrefillSettings(), DecodeSettings()
    assert (p.grpc.port, p.claim_block_ms, p.stale_pending_s) == (50061, 500, 30.0)
    assert (d.grpc.port, d.claim_block_ms, d.stale_pending_s) == (50062, 20, 60.0)
    for s in (p, d):
        assert isinstance(s, WorkerSettings)
        assert (s.token_ttl_s, s.token_finished_ttl_s, s.token_maxlen) == (600, 60, 8192)
        assert (s.reclaim_batch, s.reclaim_min_idle_ms, s.drain_timeout_s) == (100, 1000, 30.0)
    assert p.abandoned_after_s == 60.0


@pytest.mark.parametrize("cls,prefix", [(PrefillSettings, "TANDEM_PREFILL_"), (DecodeSettings, "TANDEM_DECODE_")])
def test_shared_fields_come_from_the_service_prefix_only(cls, prefix, monkeypatch):
    other = "TANDEM_DECODE_" if prefix == "TANDEM_PREFILL_" else "TANDEM_PREFILL_"
    monkeypatch.setenv(prefix + "TOKEN_TTL_S", "7")
    monkeypatch.setenv(prefix + "CLAIM_BLOCK_MS", "9")
    monkeypatch.setenv(prefix + "GRPC__PORT", "1234")
    monkeypatch.setenv(prefix + "RECLAIM_BATCH", "5")
    monkeypatch.setenv(other + "POOL", "not-mine")
    s = cls()
    assert (s.token_ttl_s, s.claim_block_ms, s.grpc.port, s.reclaim_batch, s.pool) == (7, 9, 1234, 5, "default")


def test_engine_kwargs_are_what_load_engine_takes():
    s = PrefillSettings(engine=EngineConfig(model="tiny", max_len=64, prefill_buckets=[16, 64], tp=2),
                        prefix_cache=PrefixCacheConfig(chunk_tokens=32))
    kw = s.engine_kwargs(slots=3)
    inspect.signature(load_engine).bind(**kw)  # every key is a parameter of load_engine
    assert kw["model"] == "tiny" and kw["slots"] == 3 and kw["max_len"] == 64 and kw["tp"] == 2
    assert kw["prefill_buckets"] == (16, 64) and kw["prefix_chunk"] == 32
    assert DecodeSettings().engine_kwargs(8)["slots"] == 8
