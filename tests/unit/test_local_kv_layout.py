"""`tandem local [--kv-layout paged|slots] [--kv-blocks N] [--kv-block-size B]`: the decode workers' engine
settings carry the layout (the prefill workers keep no decode KV), the settings class reads them
back and refuses a pool that cannot hold one sequence, and the sizing flags without the layout are
refused with what to add."""
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


def test_paged_flags_reach_the_decode_workers_settings(monkeypatch):
    env = decode_env(["--kv-layout", "paged", "--kv-blocks", "64", "--kv-block-size", "8"])
    assert env == {"TANDEM_DECODE_ENGINE__KV_LAYOUT": "paged", "TANDEM_DECODE_ENGINE__KV_BLOCKS": "64",
                   "TANDEM_DECODE_ENGINE__KV_BLOCK_SIZE": "8", "TANDEM_DECODE_ENGINE__KV_REUSE": "true",
                   "TANDEM_DECODE_ENGINE__KV_DTYPE": "auto"}
    for k, v in {**env, "TANDEM_DECODE_ENGINE__MAX_LEN": "256"}.items():
        monkeypatch.setenv(k, v)
    e = DecodeSettings().engine
    assert (e.kv_layout, e.kv_blocks, e.kv_block_size, e.kv_reuse) == ("paged", 64, 8, True)
    assert e.load_kwargs(8, 64)["kv_layout"] == "paged" and e.load_kwargs(8, 64)["kv_blocks"] == 64
    off = decode_env(["--kv-layout", "paged", "--no-kv-reuse"])
    monkeypatch.setenv("TANDEM_DECODE_ENGINE__KV_REUSE", off["TANDEM_DECODE_ENGINE__KV_REUSE"])
    assert DecodeSettings().engine.load_kwargs(8, 64)["kv_reuse"] is False
    assert DecodeSettings().engine.load_kwargs(8, 64)["kv_dtype"] is None
    fp8 = decode_env(["--kv-layout", "paged", "--kv-dtype", "fp8"])
    monkeypatch.setenv("TANDEM_DECODE_ENGINE__KV_DTYPE", fp8["TANDEM_DECODE_ENGINE__KV_DTYPE"])
    assert DecodeSettings().engine.load_kwargs(8, 64)["kv_dtype"] == "fp8"


def test_fp8_kv_needs_the_paged_layout(monkeypatch):
    with pytest.raises(SystemExit):
        decode_env(["--kv-layout", "slots", "--kv-dtype", "fp8"])
    monkeypatch.setenv("TANDEM_DECODE_ENGINE__KV_LAYOUT", "slots")
    monkeypatch.setenv("TANDEM_DECODE_ENGINE__KV_DTYPE", "fp8")
    with pytest.raises(ValueError, match="paged KV layout"):
        DecodeSettings()


def test_prefill_workers_get_no_decode_kv_layout(monkeypatch):
    for k in [k for k in __import__("os").environ if "ENGINE__KV_" in k]:
        monkeypatch.delenv(k)
    assert worker_env(["--kv-layout", "paged", "--kv-blocks", "64"], "prefill") == {}


def test_the_default_is_the_paged_layout_and_slots_builds_the_engine_as_before():
    """Paged KV is the decode workers' default (issue 43: one pool); the slot layout is still
    there when asked for, its engine built as before."""
    assert decode_env([])["TANDEM_DECODE_ENGINE__KV_LAYOUT"] == "paged"
    assert DecodeSettings().engine.kv_layout == "paged"
    kw = EngineConfig().load_kwargs(8, 64)
    assert kw["kv_layout"] == "paged" and kw["kv_blocks"] is None  # 0: the slot layout's memory
    assert decode_env(["--kv-layout", "slots"])["TANDEM_DECODE_ENGINE__KV_LAYOUT"] == "slots"
    slots = EngineConfig(kv_layout="slots").load_kwargs(8, 64)
    assert not {"kv_layout", "kv_blocks", "kv_block_size"} & set(slots)


def test_a_pool_smaller_than_one_sequence_is_refused_with_the_size_to_give():
    with pytest.raises(ValidationError, match="set kv_blocks >= 32"):
        EngineConfig(kv_layout="paged", max_len=512, kv_block_size=16, kv_blocks=8)
    with pytest.raises(ValidationError, match="kv_layout"):
        EngineConfig(kv_layout="pages")


@pytest.mark.parametrize("argv", [["--kv-blocks", "16"], ["--kv-block-size", "32"]])
def test_sizing_flags_with_the_slot_layout_are_refused(argv, capsys):
    local._parse(argv)  # the default layout is paged: they size its pool
    with pytest.raises(SystemExit):
        local._parse(["--kv-layout", "slots", *argv])
    assert "drop --kv-layout slots" in capsys.readouterr().err
