"""`tandem local [--kv-blocks N] [--kv-block-size B] [--kv-dtype fp8] [--no-kv-reuse] [--no-kv-window-group]`: the decode
workers' engine settings carry the KV pool's size (the prefill workers keep no decode KV), the
settings class reads them back and refuses a pool that cannot hold one sequence, and the removed
slot layout's flag is refused."""
from __future__ import annotations

import pytest
from pydantic import ValidationError

from decode_svc.settings import DecodeSettings
from tandem import local
from tandem_core.settings import EngineConfig


def worker_env(argv: list[str], role: str) -> dict[str, str]:
    """The TANDEM_*ENGINE__KV_* variables `tandem local` gives a worker of `role` (spawned nowhere)."""
    c = local.Cluster(local._parse(["--max-len", "256", *argv]))
    seen: list[dict[str, str]] = []
    c._spawn = lambda _name, _module, env: seen.append(env)  # type: ignore[method-assign]
    c.spawn_worker(role)
    return {k: v for k, v in seen[0].items() if "ENGINE__KV_" in k and k.startswith("TANDEM_")}


def decode_env(argv: list[str]) -> dict[str, str]:
    return worker_env(argv, "decode")


def test_pool_flags_reach_the_decode_workers_settings(monkeypatch):
    env = decode_env(["--kv-blocks", "64", "--kv-block-size", "8"])
    assert env == {"TANDEM_DECODE_ENGINE__KV_BLOCKS": "64", "TANDEM_DECODE_ENGINE__KV_BLOCK_SIZE": "8",
                   "TANDEM_DECODE_ENGINE__KV_REUSE": "true", "TANDEM_DECODE_ENGINE__KV_DTYPE": "auto",
                   "TANDEM_DECODE_ENGINE__KV_WINDOW_GROUP": "true"}
    for k, v in {**env, "TANDEM_DECODE_ENGINE__MAX_LEN": "256"}.items():
        monkeypatch.setenv(k, v)
    e = DecodeSettings().engine
    assert (e.kv_blocks, e.kv_block_size, e.kv_reuse) == (64, 8, True)
    assert e.load_kwargs(8, 64)["kv_blocks"] == 64 and e.load_kwargs(8, 64)["kv_block_size"] == 8
    off = decode_env(["--no-kv-reuse"])
    monkeypatch.setenv("TANDEM_DECODE_ENGINE__KV_REUSE", off["TANDEM_DECODE_ENGINE__KV_REUSE"])
    assert DecodeSettings().engine.load_kwargs(8, 64)["kv_reuse"] is False
    assert DecodeSettings().engine.load_kwargs(8, 64)["kv_dtype"] is None
    fp8 = decode_env(["--kv-dtype", "fp8"])
    monkeypatch.setenv("TANDEM_DECODE_ENGINE__KV_DTYPE", fp8["TANDEM_DECODE_ENGINE__KV_DTYPE"])
    assert DecodeSettings().engine.load_kwargs(8, 64)["kv_dtype"] == "fp8"
    assert DecodeSettings().engine.load_kwargs(8, 64)["kv_window_group"] is True
    whole = decode_env(["--no-kv-window-group"])
    monkeypatch.setenv("TANDEM_DECODE_ENGINE__KV_WINDOW_GROUP", whole["TANDEM_DECODE_ENGINE__KV_WINDOW_GROUP"])
    assert DecodeSettings().engine.load_kwargs(8, 64)["kv_window_group"] is False


def test_prefill_workers_get_no_decode_kv_pool(monkeypatch):
    for k in [k for k in __import__("os").environ if "ENGINE__KV_" in k]:
        monkeypatch.delenv(k)
    assert worker_env(["--kv-blocks", "64"], "prefill") == {}


def test_the_default_pool_lets_every_row_reach_max_len():
    kw = EngineConfig().load_kwargs(8, 64)
    assert kw["kv_blocks"] is None and kw["kv_block_size"] == 16  # None: slots x max_len positions
    assert "kv_layout" not in kw


def test_a_pool_smaller_than_one_sequence_is_refused_with_the_size_to_give():
    with pytest.raises(ValidationError, match="set kv_blocks >= 32"):
        EngineConfig(max_len=512, kv_block_size=16, kv_blocks=8)


def test_the_removed_slot_layout_flag_is_refused(capsys):
    with pytest.raises(SystemExit):
        local._parse(["--kv-layout", "slots"])
    assert "--kv-layout" in capsys.readouterr().err
