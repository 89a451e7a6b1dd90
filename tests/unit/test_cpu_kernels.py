"""Tandem's CPU paged-attention kernel (tandem_engine/cpu_kernels) against the XLA gather path it
replaces on a CPU (attention.paged_attention): the same outputs for every feature a family asks of the
step's attention (sliding windows, sinks, soft-capping, GQA groups, head dims of 64, 80 and 128 —
the two-pass kernel — and 40 — the one-pass one —,
bfloat16 pools, free rows, rows of different lengths over shuffled blocks), and the engine's
paged step choosing it on a CPU."""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tandem_core.models import resolve_model
from tandem_engine import attention, cpu_kernels
from tandem_engine.arch import ModelConfig, config_from_info

pytestmark = pytest.mark.skipif(cpu_kernels.paged_attention_kernel() is None,
                                reason="no C++ compiler here: the kernel cannot be built (logged)")


def _cfg(heads: int, kv: int, hd: int, softcap: float = 0.0, scale: float = 0.0) -> ModelConfig:
    base = {f: None for f in ModelConfig._fields}
    base.update(num_heads=heads, num_kv_heads=kv, head_dim=hd, attn_softcap=softcap, query_scale=scale)
    return ModelConfig(**base)


def _case(rows: int, heads: int, kv: int, hd: int, bs: int, dtype, seed: int = 0):
    rng = np.random.default_rng(seed)
    nb = 12
    blocks = rows * nb + 1
    k = rng.standard_normal((kv, blocks, bs, hd), np.float32)
    v = rng.standard_normal((kv, blocks, bs, hd), np.float32)
    table = rng.permutation(np.arange(1, blocks)).reshape(rows, nb).astype(np.int32)
    positions = rng.integers(0, nb * bs, rows).astype(np.int32)
    positions[0] = nb * bs - 1  # one row at the table's last position
    lengths = np.minimum(positions + 1, nb * bs)
    lengths[rows // 2] = 0  # a free row: zeros out
    q = rng.standard_normal((rows, 1, heads, hd), np.float32)
    return (jnp.asarray(q, dtype), jnp.asarray(k, dtype), jnp.asarray(v, dtype), jnp.asarray(table),
            jnp.asarray(positions), jnp.asarray(lengths.astype(np.int32)))


@pytest.mark.parametrize("heads,kv,hd,window,sinks,softcap", [
    (4, 2, 64, 0, False, 0.0),     # the built-in model's shape
    (8, 2, 64, 37, False, 0.0),    # a sliding window shorter than most rows, 4 query heads per KV head
    (4, 4, 80, 0, True, 0.0),      # sinks (gpt-oss), a head dim with no unrolled case
    (6, 2, 128, 50, False, 30.0),  # soft-capped (gemma2) and windowed
    (4, 2, 40, 13, True, 0.0),     # a head dim of no whole 8-float vectors: the one-pass kernel
])
def test_kernel_equals_the_gather_path(heads, kv, hd, window, sinks, softcap):
    cfg = _cfg(heads, kv, hd, softcap=softcap, scale=0.0 if heads != 6 else 0.1)
    q, k, v, table, positions, lengths = _case(9, heads, kv, hd, 8, jnp.float32)
    s = jnp.asarray(np.random.default_rng(1).standard_normal(heads).astype(np.float32)) if sinks else None
    want = attention.paged_attention(q, k, v, table, positions, cfg, window=window, sinks=s, lengths=lengths)
    got = cpu_kernels.paged_attention_kernel()(q[:, 0], k, v, table, positions, lengths, s,
                                               scale=cfg.query_scale or 1.0 / math.sqrt(hd), softcap=softcap,
                                               window=window)
    used = np.asarray(lengths) > 0
    want = np.asarray(want).reshape(9, heads, hd)
    np.testing.assert_allclose(np.asarray(got)[used], want[used], atol=2e-5, rtol=2e-5)
    assert not np.asarray(got)[~used].any()


def test_kernel_reads_a_bfloat16_pool():
    cfg = _cfg(4, 2, 64)
    q, k, v, table, positions, lengths = _case(5, 4, 2, 64, 16, jnp.bfloat16, seed=3)
    want = attention.paged_attention(q.astype(jnp.float32), k.astype(jnp.float32), v.astype(jnp.float32), table,
                                 positions, cfg, lengths=lengths)
    kernel = cpu_kernels.paged_attention_kernel()
    for qq in (q, q.astype(jnp.float32)):  # bfloat16 q, and float32 q over a bfloat16 pool
        got = kernel(qq[:, 0], k, v, table, positions, lengths, None, scale=1 / 8, softcap=0.0, window=0)
        used = np.asarray(lengths) > 0
        np.testing.assert_allclose(np.asarray(got)[used], np.asarray(want).reshape(5, 4, 64)[used], atol=2e-2)


def test_the_paged_step_uses_the_kernel_on_a_cpu():
    """A CPU compile of the paged step calls the kernel (an FFI custom call in its HLO) and no
    gather of the pool."""
    cfg = config_from_info(resolve_model("builtin"))  # 4 heads, 2 KV heads, head_dim 64
    q, k, v, table, positions, lengths = _case(4, 4, 2, 64, 8, jnp.float32)
    new = jnp.zeros((4, 2, 64), jnp.float32)
    flat = table[:, 0] * 8

    def layer(q, k_layer, v_layer):
        return attention.ragged_attention(q, new, new, k_layer, v_layer, flat, table, positions, lengths,
                                      jnp.zeros((), jnp.float32), cfg=cfg, window=0,
                                      has_sinks=False)

    text = jax.jit(layer).lower(q, k, v).compile().as_text()
    assert attention.cpu_step_kernel(jnp.float32, jnp.float32) is not None
    assert cpu_kernels.TARGET in text
    assert attention.cpu_step_kernel(jnp.float32, jnp.float8_e4m3fn) is None  # an fp8 pool keeps the gather


def test_a_missing_compiler_is_a_warning_and_no_kernel(monkeypatch, tmp_path, caplog):
    monkeypatch.setattr(cpu_kernels, "_state", {})
    monkeypatch.setenv("TANDEM_KERNEL_CACHE", str(tmp_path))
    monkeypatch.setattr(cpu_kernels, "_compiler", lambda: None)
    with caplog.at_level("WARNING", logger="tandem_engine.cpu_kernels"):
        assert cpu_kernels.paged_attention_kernel() is None
    assert "no C++ compiler found" in caplog.text
    monkeypatch.setattr(cpu_kernels, "_state", {})
    monkeypatch.setenv("TANDEM_CPU_KERNELS", "0")
    assert cpu_kernels.paged_attention_kernel() is None


def test_a_library_built_for_a_named_level_is_not_used_on_a_cpu_without_its_features(monkeypatch, tmp_path):
    """The CPU worker image ships the kernel built for x86-64-v3 (TANDEM_KERNEL_MARCH): on a CPU
    without AVX2 it must not be loaded (it would stop the process with an illegal instruction)."""
    monkeypatch.setenv("TANDEM_KERNEL_CACHE", str(tmp_path))
    monkeypatch.setenv("TANDEM_KERNEL_MARCH", "x86-64-v3")
    named = cpu_kernels.library_path()
    monkeypatch.setattr(cpu_kernels, "_cpu_flags", lambda: "fpu sse sse2")
    assert cpu_kernels.library_path() == named  # the CPU is not part of a named level's key
    with pytest.raises(RuntimeError, match="built for x86-64-v3.*lacks avx2"):
        cpu_kernels.build()
    monkeypatch.delenv("TANDEM_KERNEL_MARCH")
    assert cpu_kernels.library_path() != named  # native: this CPU's flags are in the key


def test_loading_the_kernel_leaves_the_process_floating_point_state_alone():
    """Built with -ffast-math, a library linked with it too carries crtfastmath.o, which turns on
    flush-to-zero and denormals-are-zero for the whole process when it loads: subnormal float32
    values then read as zero everywhere (numpy, XLA, hypothesis refused to run). Run in a child
    process so that this process's state is not the one checked."""
    import subprocess
    import sys

    code = ("import numpy as np; from tandem_engine import cpu_kernels; "
            "assert cpu_kernels.paged_attention_kernel() is not None; "
            "x = np.array([1e-39], np.float32); print(float((x * np.float32(2))[0]))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=600)
    got = float(out.stdout.strip().splitlines()[-1])
    assert 1.9e-39 < got < 2.1e-39  # plain Python floats: a numpy float32 here would be flushed too
