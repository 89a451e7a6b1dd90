"""The engine's paged decode step, compiled ahead of time for a TPU v5e chip (libtpu's compile-only
devices, as tests/unit/test_tpu_compile.py; no TPU here), runs Tandem's Pallas decode kernel
(pallas_decode.py) over each layer's pool buffer in place.

What is compiled is what a decode pod on a TPU runs: an Engine with  over
abstract bf16 weights of a small Llama-shaped model (head_dim 128, GQA 4:2, so the kernel can
serve it; and a gpt-oss-like one: a sliding window on one layer of two, sinks, experts; both also at
tp=4), its own `init_state` (the pool: one buffer per layer, paged.py) and its own generate
call (its generate_call: cores.generate_core with table_blocks set), one step per call and four
(the multi-step scan). Held:
- the Mosaic kernel is in the compiled program, once per layer (paged.decode_forward_paged picks
  it for the platform it is compiled for; a CPU compile of the same step holds the gather path);
- the compiler's temporaries are small (measured: 2.4 MB one step, 2.5 MB four, against a layer's
  K buffer of 268 MB): no layer's pool is copied. Broken on purpose, each fails here: a pool
  stacked [L, ...] and sliced per layer (temporaries 1.08 GB: every layer's K and V copied), the
  new K/V scattered at [:, block, offset] (four steps: 1.08 GB, XLA's TPU layout for the scatter
  differs from the kernel's, so each layer's buffer is copied back for each call), the kernel
  chosen by JAX's default backend at trace time instead of by the compile's platform (no Mosaic
  call; the gather path compiled for the TPU: 815 MB of temporaries);
- the donated pool comes back aliased (updated in place), and the insert writes a prompt's blocks
  in place too.

Skips only where libtpu is not importable (`make test` installs it).
"""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from tandem_engine.aot import libtpu_missing

_why = libtpu_missing()
if _why:
    pytest.skip(_why, allow_module_level=True)

import jax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from tandem_core.models import PRESETS
from tandem_core.types import SamplingParams
from tandem_engine import aot
from tandem_engine.engine_prefill import Prefix
from tandem_engine.sharding import make_layout
from tandem_engine.weights import init_params

pytestmark = pytest.mark.slow  # make test-unit leaves it out (make test runs it): paged steps compiled for a TPU chip (libtpu, no chip)

LAYERS, KV_HEADS, HEAD_DIM, BLOCK, BLOCKS, ROWS, MAX_LEN = 2, 2, 128, 16, 32768, 8, 2048
# one layer's K buffer: [KV, BLOCKS + 1 (the null block), BLOCK, HEAD_DIM] bf16 (268 MB)
LAYER_BYTES = KV_HEADS * (BLOCKS + 1) * BLOCK * HEAD_DIM * 2
POOL_BYTES = 2 * LAYERS * LAYER_BYTES
LLAMA_HD128 = dataclasses.replace(PRESETS["tiny"], name="llama-hd128", hidden_size=512, intermediate_size=1024,
                                  num_layers=LAYERS, num_heads=4, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM,
                                  max_position_embeddings=4096)


@pytest.fixture(scope="module")
def chip():
    return NamedSharding(Mesh(np.asarray(aot.topology_devices("v5e", "2x2")[:1]), ("tp",)), P())


def paged_engine(info, chip):
    """A paged Engine over abstract bf16 weights placed on one v5e chip, and its init_state as
    structs on that chip."""
    def place(s):
        return jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=chip)

    params = jax.tree.map(place, jax.eval_shape(lambda: init_params(info, "bfloat16")))
    eng = aot._AbstractEngine(info, params, slots=ROWS, max_len=MAX_LEN, prefill_buckets=(16,), dtype="bfloat16",
                              kv_block_size=BLOCK, kv_blocks=BLOCKS)
    eng._one_cpu = False  # as on a TPU host: the step reads the stacked params (no CPU split_layers copy)
    return eng, jax.tree.map(place, jax.eval_shape(eng.init_state))


def kernel_calls(compiled) -> int:
    return compiled.as_text().count('custom_call_target="tpu_custom_call"')


@pytest.mark.parametrize("steps", [1, 4])
def test_the_paged_step_runs_the_kernel_on_each_layer_buffer_in_place(chip, steps):
    eng, state = paged_engine(LLAMA_HD128, chip)
    assert isinstance(state.k, tuple) and len(state.k) == LAYERS
    assert state.k[0].shape == (KV_HEADS, BLOCKS + 1, BLOCK, HEAD_DIM)
    widest = eng.max_blocks_per_seq  # every row reads its whole table (128 blocks, 2048 positions)
    compiled = aot.lower(eng.generate_call(state, ROWS, steps=steps, table_blocks=widest), chip).compile()
    mem = compiled.memory_analysis()
    print(f"paged step x{steps} on v5e: temp {mem.temp_size_in_bytes:,} B, aliased {mem.alias_size_in_bytes:,} B, "
          f"one layer's K buffer {LAYER_BYTES:,} B")
    assert kernel_calls(compiled) == LAYERS  # the Mosaic kernel, one call per layer (a scan's body: once)
    assert mem.temp_size_in_bytes < LAYER_BYTES // 32, mem  # no layer's pool copied (measured: 2.4-2.5 MB)
    assert mem.alias_size_in_bytes >= POOL_BYTES, mem  # the donated pool is the returned pool


GPT_OSS_HD128 = dataclasses.replace(LLAMA_HD128, name="gpt-oss-hd128", intermediate_size=256, extra={
    "family": "gpt_oss", "hf_config": dict(sliding_window=128, layer_types=["sliding_attention", "full_attention"],
                                           num_local_experts=4, num_experts_per_tok=2, attention_bias=True)})


def test_a_windowed_family_with_sinks_runs_the_kernel_on_each_layer_buffer_in_place(chip):
    """gpt-oss's attention traits at head_dim 128 (a window of 128 on layer 0, sinks on both): the
    kernel on both layers (the windowed one and the global one), the pool read in place."""
    from tandem_engine.model import config_from_info

    cfg = config_from_info(GPT_OSS_HD128)
    assert cfg.windows == (128, 0) and cfg.sinks
    eng, state = paged_engine(GPT_OSS_HD128, chip)
    compiled = aot.lower(eng.generate_call(state, ROWS, table_blocks=eng.max_blocks_per_seq), chip).compile()
    mem = compiled.memory_analysis()
    print(f"gpt-oss-like paged step on v5e: temp {mem.temp_size_in_bytes:,} B")
    assert kernel_calls(compiled) == LAYERS
    assert mem.temp_size_in_bytes < LAYER_BYTES // 32, mem  # no layer's pool copied
    assert mem.alias_size_in_bytes >= POOL_BYTES, mem


def test_the_insert_writes_a_prompt_into_the_layer_buffers_in_place(chip):
    eng, state = paged_engine(LLAMA_HD128, chip)
    kv = jax.ShapeDtypeStruct((LAYERS, 16, KV_HEADS, HEAD_DIM), jax.numpy.bfloat16, sharding=chip)
    compiled = aot.lower(eng.insert_call(Prefix(kv, kv, 13, 0), state, 0, SamplingParams()), chip).compile()
    mem = compiled.memory_analysis()
    print(f"paged insert on v5e: temp {mem.temp_size_in_bytes:,} B")
    assert mem.temp_size_in_bytes < LAYER_BYTES // 32 and mem.alias_size_in_bytes >= POOL_BYTES, mem


def test_a_family_the_kernel_cannot_serve_compiles_the_gather_path(chip):
    """head_dim 16 (the "tiny" preset): not a multiple of 128, so the pool's TPU layout is not the
    kernel's (paged_attention.kernel_gaps; test_pallas_decode.py shows the copy it would cost), and
    the TPU compile of the same step holds no Mosaic call."""
    eng, state = paged_engine(dataclasses.replace(PRESETS["tiny"], max_position_embeddings=4096), chip)
    compiled = aot.lower(eng.generate_call(state, ROWS, table_blocks=8), chip).compile()
    assert kernel_calls(compiled) == 0


# tensor parallelism: 4 KV heads (8 query heads) over the 4 chips of a v5e 2x2, one KV head a chip
TP = 4
LLAMA_TP = dataclasses.replace(LLAMA_HD128, name="llama-hd128-kv4", num_heads=8, num_kv_heads=TP)
TP_LAYER_BYTES = (BLOCKS + 1) * BLOCK * HEAD_DIM * 2  # one chip's slice of one layer's K buffer (one head)


def sharded_paged_engine(info):
    """A paged Engine at tp=TP over abstract bf16 weights split as the layout splits them, and its
    init_state as structs: the pool's layer buffers on Layout.kv_pool (by KV head), the rest
    replicated."""
    layout = make_layout(info, TP, Mesh(np.asarray(aot.topology_devices("v5e", "2x2")[:TP]), ("tp",)))
    params = aot.abstract_params(info, "bfloat16", layout)
    eng = aot._AbstractEngine(info, params, slots=ROWS, max_len=MAX_LEN, prefill_buckets=(16,), dtype="bfloat16",
                              kv_block_size=BLOCK, kv_blocks=BLOCKS)
    eng.layout, eng._one_cpu = layout, False  # (set after: the base class would device_put the structs)
    shapes = jax.eval_shape(eng.init_state)

    def place(path, s):
        pool = getattr(path[0], "name", None) in ("k", "v")
        return jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=layout.kv_pool() if pool else layout.replicated())

    return eng, jax.tree_util.tree_map_with_path(place, shapes)


def test_the_sharded_paged_step_runs_the_kernel_per_chip_on_its_heads_in_place():
    """tp=4: each chip holds one KV head's slice of every block; the step (one and four per call)
    runs the Mosaic kernel once per layer inside the sharded program (a shard_map per layer: a
    Mosaic call is not split by XLA's partitioner), copies no pool and returns it aliased; the
    insert writes each chip's heads of a prompt's blocks in place."""
    eng, state = sharded_paged_engine(LLAMA_TP)
    assert state.k[0].shape == (TP, BLOCKS + 1, BLOCK, HEAD_DIM)
    assert state.k[0].sharding.spec == P("tp", None, None, None)
    for steps in (1, 4):
        compiled = aot.lower(eng.generate_call(state, ROWS, steps=steps, table_blocks=eng.max_blocks_per_seq),
                             state.positions.sharding).compile()
        mem = compiled.memory_analysis()
        print(f"paged step x{steps} on v5e tp={TP}: temp {mem.temp_size_in_bytes:,} B, aliased "
              f"{mem.alias_size_in_bytes:,} B, one chip's layer K buffer {TP_LAYER_BYTES:,} B")
        assert kernel_calls(compiled) == LAYERS  # per layer, in the per-chip program
        assert mem.temp_size_in_bytes < TP_LAYER_BYTES // 32, mem  # no layer's pool copied or gathered
        assert mem.alias_size_in_bytes >= 2 * LAYERS * TP_LAYER_BYTES, mem  # this chip's pool, in place
    kv = jax.ShapeDtypeStruct((LAYERS, 16, TP, HEAD_DIM), jax.numpy.bfloat16, sharding=eng.layout.kv_prefix())
    compiled = aot.lower(eng.insert_call(Prefix(kv, kv, 13, 0), state, 0, SamplingParams()),
                         state.positions.sharding).compile()
    mem = compiled.memory_analysis()
    print(f"paged insert on v5e tp={TP}: temp {mem.temp_size_in_bytes:,} B")
    assert mem.temp_size_in_bytes < TP_LAYER_BYTES // 32 and mem.alias_size_in_bytes >= 2 * LAYERS * TP_LAYER_BYTES


def test_the_sharded_step_of_a_windowed_family_with_sinks_runs_the_kernel_per_chip():
    """gpt-oss-like (a window on layer 0, sinks) at tp=4, one KV head a chip: each chip's kernel
    gets its heads' sinks, and no pool is copied."""
    eng, state = sharded_paged_engine(dataclasses.replace(GPT_OSS_HD128, num_heads=8, num_kv_heads=TP))
    compiled = aot.lower(eng.generate_call(state, ROWS, table_blocks=eng.max_blocks_per_seq),
                         state.positions.sharding).compile()
    mem = compiled.memory_analysis()
    print(f"gpt-oss-like paged step on v5e tp={TP}: temp {mem.temp_size_in_bytes:,} B")
    assert kernel_calls(compiled) == LAYERS
    assert mem.temp_size_in_bytes < TP_LAYER_BYTES // 32, mem
