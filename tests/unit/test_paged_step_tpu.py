"""The engine's paged decode step, compiled ahead of time for a TPU v5e chip (libtpu's compile-only
devices, as tests/unit/test_tpu_compile.py; no TPU here), runs Tandem's Pallas decode kernel
(pallas_decode.py) over each layer's pool buffer in place.

What is compiled is what a decode pod on a TPU runs: an Engine over abstract bf16 weights of a
small Llama-shaped model (head_dim 128, GQA 4:2; and a gpt-oss-like one: a sliding window on one
layer of two, sinks, experts; both also at tp=4; and both again at head_dim 64, gpt-oss's and the
built-in model's, whose pool is stored lane-folded [KV, blocks, 8, 128]: pool_layout.py), its own
`init_state` (the pool: one buffer per layer, paged.py) and its own generate
call (its generate_call: cores.generate_core with table_blocks set), one step per call and four
(the multi-step scan). Held:
- the Mosaic kernel is in the compiled program, once per layer (paged.decode_forward_paged picks
  it for the platform it is compiled for; a CPU compile of the same step holds the gather path);
- the compiler's temporaries are small (measured: 1.6 MB one step, 1.7 MB four, against a layer's
  K buffer of 268 MB; at head_dim 64 1.7-1.9 MB against 134 MB, at tp 4 1.5-1.9 MB against a chip's
  67 MB): no layer's pool is copied. Broken on purpose, each fails here: a head_dim-64 pool stored
  unfolded [KV, blocks, 16, 64] (temporaries 1.88 GB, at tp 4 405 MB: the layout the TPU gives it
  is not the kernel's, so each call copies the pool), a pool
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
                              kv_block_size=BLOCK, kv_blocks=BLOCKS, platform="tpu")
    eng._one_cpu = False  # as on a TPU host: the step reads the stacked params (no CPU split_layers copy)
    return eng, jax.tree.map(place, jax.eval_shape(eng.init_state))


def kernel_calls(compiled) -> int:
    """The paged attention's Mosaic calls (the experts' grouped matmuls, also Mosaic calls on a
    TPU, are not counted)."""
    return sum(1 for line in compiled.as_text().splitlines()
               if 'custom_call_target="tpu_custom_call"' in line and "tandem_paged_decode" in line)


LLAMA_HD64 = dataclasses.replace(LLAMA_HD128, name="llama-hd64", num_heads=8, head_dim=64)  # the built-in model's head_dim


def layer_bytes(info, tp: int = 1) -> int:
    """One layer's K buffer on one chip: [KV / tp, BLOCKS + 1 (the null block), BLOCK * hd] bf16."""
    return info.num_kv_heads // tp * (BLOCKS + 1) * BLOCK * info.head_dim * 2


def assert_pool_stored(state, info, tp: int = 1, eng=None) -> None:
    """The pool's layer buffers as pool_layout.py stores them: head_dim 64 lane-folded, 128 not;
    with `eng`, a windowed layer beside global ones holds its group's blocks (paged.WindowGroup)."""
    rows, lanes = (BLOCK // 2, 128) if info.head_dim == 64 else (BLOCK, info.head_dim)
    assert isinstance(state.k, tuple) and len(state.k) == LAYERS
    for i, layer in enumerate(state.k):
        blocks = BLOCKS if eng is None else layer_blocks(eng, i)
        assert layer.shape == (info.num_kv_heads, blocks + 1, rows, lanes)


def layer_blocks(eng, i: int) -> int:
    """Layer i's blocks: the windowed group's (slots x window_span) or the pool's."""
    return eng._window.total if eng.windowed and eng.windowed[i] else BLOCKS


def pool_bytes(eng, info, tp: int = 1) -> int:
    """K and V of every layer on one chip, each layer at its own block count."""
    return sum(2 * layer_bytes(info, tp) * (layer_blocks(eng, i) + 1) // (BLOCKS + 1) for i in range(LAYERS))


@pytest.mark.parametrize("info", [LLAMA_HD128, LLAMA_HD64], ids=lambda i: i.name)
@pytest.mark.parametrize("steps", [1, 4])
def test_the_paged_step_runs_the_kernel_on_each_layer_buffer_in_place(chip, steps, info):
    eng, state = paged_engine(info, chip)
    assert_pool_stored(state, info)
    layer, pool = layer_bytes(info), 2 * LAYERS * layer_bytes(info)
    widest = eng.max_blocks_per_seq  # every row reads its whole table (128 blocks, 2048 positions)
    compiled = aot.lower(eng.generate_call(state, ROWS, steps=steps, table_blocks=widest), chip).compile()
    mem = compiled.memory_analysis()
    print(f"{info.name} paged step x{steps} on v5e: temp {mem.temp_size_in_bytes:,} B, aliased "
          f"{mem.alias_size_in_bytes:,} B, one layer's K buffer {layer:,} B")
    assert kernel_calls(compiled) == LAYERS  # the Mosaic kernel, one call per layer (a scan's body: once)
    assert mem.temp_size_in_bytes < layer // 32, mem  # no layer's pool copied (measured: 1.6-1.7 MB)
    assert pool <= mem.alias_size_in_bytes, mem  # the donated pool is the returned pool
    # ...taking its own bytes: a head_dim-64 pool stored [.., 16, 64] took 1.5x (its block axis laid
    # out minor, padded to 128s); lane-folded it is laid out row-major (pool_layout.py)
    assert mem.alias_size_in_bytes < pool * 1.01 + (1 << 20), mem
    assert compiled.input_formats[0][1].k[0].layout.major_to_minor == (0, 1, 2, 3)


GPT_OSS_HD128 = dataclasses.replace(LLAMA_HD128, name="gpt-oss-hd128", intermediate_size=256, extra={
    "family": "gpt_oss", "hf_config": dict(sliding_window=128, layer_types=["sliding_attention", "full_attention"],
                                           num_local_experts=4, num_experts_per_tok=2, attention_bias=True)})
GPT_OSS_HD64 = dataclasses.replace(GPT_OSS_HD128, name="gpt-oss-hd64", num_heads=8, head_dim=64)  # gpt-oss's head_dim


@pytest.mark.parametrize("info", [GPT_OSS_HD128, GPT_OSS_HD64], ids=lambda i: i.name)
def test_a_windowed_family_with_sinks_runs_the_kernel_on_each_layer_buffer_in_place(chip, info):
    """gpt-oss's attention traits (a window of 128 on layer 0, sinks on both) at head_dim 128 and at
    gpt-oss's own 64 (the pool lane-folded): the kernel on both layers (the windowed one and the
    global one), the pool read in place."""
    from tandem_engine.model import config_from_info

    cfg = config_from_info(info)
    assert cfg.windows == (128, 0) and cfg.sinks
    eng, state = paged_engine(info, chip)
    # the windowed layer keeps its blocks apart: 8 rows x its window's blocks, not the pool's BLOCKS
    assert eng.windowed == (True, False) and layer_blocks(eng, 0) == eng._window.total < BLOCKS // 10
    assert_pool_stored(state, info, eng=eng)
    compiled = aot.lower(eng.generate_call(state, ROWS, table_blocks=eng.max_blocks_per_seq), chip).compile()
    mem = compiled.memory_analysis()
    print(f"{info.name} paged step on v5e: temp {mem.temp_size_in_bytes:,} B, one layer's K buffer "
          f"{layer_bytes(info):,} B")
    assert kernel_calls(compiled) == LAYERS  # the windowed layer's through its own table
    assert mem.temp_size_in_bytes < layer_bytes(info) // 32, mem  # no layer's pool copied
    assert mem.alias_size_in_bytes >= pool_bytes(eng, info), mem


@pytest.mark.parametrize("info", [LLAMA_HD128, LLAMA_HD64], ids=lambda i: i.name)
def test_the_insert_writes_a_prompt_into_the_layer_buffers_in_place(chip, info):
    eng, state = paged_engine(info, chip)
    kv = jax.ShapeDtypeStruct((LAYERS, 16, KV_HEADS, info.head_dim), jax.numpy.bfloat16, sharding=chip)
    compiled = aot.lower(eng.insert_call(Prefix(kv, kv, 13, 0), state, 0, SamplingParams()), chip).compile()
    mem = compiled.memory_analysis()
    print(f"{info.name} paged insert on v5e: temp {mem.temp_size_in_bytes:,} B")
    assert mem.temp_size_in_bytes < layer_bytes(info) // 32, mem
    assert mem.alias_size_in_bytes >= 2 * LAYERS * layer_bytes(info), mem


def test_a_family_the_kernel_cannot_serve_compiles_the_gather_path(chip):
    """head_dim 96: it neither divides 128 nor is a multiple of it, so the pool is not lane-folded
    (pool_layout.py), its TPU layout is not the kernel's (paged_attention.kernel_gaps;
    test_pallas_decode.py shows the copy it would cost), and the TPU compile of the same step holds
    no Mosaic call."""
    eng, state = paged_engine(dataclasses.replace(PRESETS["tiny"], head_dim=96, max_position_embeddings=4096), chip)
    assert state.k[0].shape[2:] == (BLOCK, 96)
    compiled = aot.lower(eng.generate_call(state, ROWS, table_blocks=8), chip).compile()
    assert kernel_calls(compiled) == 0


# tensor parallelism: 4 KV heads (8 query heads) over the 4 chips of a v5e 2x2, one KV head a chip
TP = 4
LLAMA_TP = dataclasses.replace(LLAMA_HD128, name="llama-hd128-kv4", num_heads=8, num_kv_heads=TP)
LLAMA_TP_HD64 = dataclasses.replace(LLAMA_TP, name="llama-hd64-kv4", head_dim=64)


def sharded_paged_engine(info):
    """A paged Engine at tp=TP over abstract bf16 weights split as the layout splits them, and its
    init_state as structs: the pool's layer buffers on Layout.kv_pool (by KV head), the rest
    replicated."""
    layout = make_layout(info, TP, Mesh(np.asarray(aot.topology_devices("v5e", "2x2")[:TP]), ("tp",)))
    params = aot.abstract_params(info, "bfloat16", layout)
    eng = aot._AbstractEngine(info, params, slots=ROWS, max_len=MAX_LEN, prefill_buckets=(16,), dtype="bfloat16",
                              kv_block_size=BLOCK, kv_blocks=BLOCKS, platform="tpu")
    eng.layout, eng._one_cpu = layout, False  # (set after: the base class would device_put the structs)
    shapes = jax.eval_shape(eng.init_state)

    def place(path, s):
        pool = getattr(path[0], "name", None) in ("k", "v")
        return jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=layout.kv_pool() if pool else layout.replicated())

    return eng, jax.tree_util.tree_map_with_path(place, shapes)


@pytest.mark.parametrize("info", [LLAMA_TP, LLAMA_TP_HD64], ids=lambda i: i.name)
def test_the_sharded_paged_step_runs_the_kernel_per_chip_on_its_heads_in_place(info):
    """tp=4: each chip holds one KV head's slice of every block; the step (one and four per call)
    runs the Mosaic kernel once per layer inside the sharded program (a shard_map per layer: a
    Mosaic call is not split by XLA's partitioner), copies no pool and returns it aliased; the
    insert writes each chip's heads of a prompt's blocks in place. At head_dim 128 and 64 (folded)."""
    eng, state = sharded_paged_engine(info)
    assert_pool_stored(state, info)
    assert state.k[0].sharding.spec == P("tp", None, None, None)
    chip_layer = layer_bytes(info, TP)  # one chip's slice of one layer's K buffer (one head)
    for steps in (1, 4):
        compiled = aot.lower(eng.generate_call(state, ROWS, steps=steps, table_blocks=eng.max_blocks_per_seq),
                             state.positions.sharding).compile()
        mem = compiled.memory_analysis()
        print(f"{info.name} paged step x{steps} on v5e tp={TP}: temp {mem.temp_size_in_bytes:,} B, aliased "
              f"{mem.alias_size_in_bytes:,} B, one chip's layer K buffer {chip_layer:,} B")
        assert kernel_calls(compiled) == LAYERS  # per layer, in the per-chip program
        assert mem.temp_size_in_bytes < chip_layer // 32, mem  # no layer's pool copied or gathered
        assert 2 * LAYERS * chip_layer <= mem.alias_size_in_bytes, mem  # this chip's pool, in place
        assert mem.alias_size_in_bytes < 2 * LAYERS * chip_layer * 1.01 + (1 << 20), mem  # at its own bytes
    kv = jax.ShapeDtypeStruct((LAYERS, 16, TP, info.head_dim), jax.numpy.bfloat16, sharding=eng.layout.kv_prefix())
    compiled = aot.lower(eng.insert_call(Prefix(kv, kv, 13, 0), state, 0, SamplingParams()),
                         state.positions.sharding).compile()
    mem = compiled.memory_analysis()
    print(f"{info.name} paged insert on v5e tp={TP}: temp {mem.temp_size_in_bytes:,} B")
    assert mem.temp_size_in_bytes < chip_layer // 32 and mem.alias_size_in_bytes >= 2 * LAYERS * chip_layer


@pytest.mark.parametrize("info", [GPT_OSS_HD128, GPT_OSS_HD64], ids=lambda i: i.name)
def test_the_sharded_step_of_a_windowed_family_with_sinks_runs_the_kernel_per_chip(info):
    """gpt-oss-like (a window on layer 0, sinks) at tp=4, one KV head a chip, at head_dim 128 and
    64 (folded): each chip's kernel gets its heads' sinks, and no pool is copied."""
    info = dataclasses.replace(info, num_heads=8, num_kv_heads=TP)
    eng, state = sharded_paged_engine(info)
    assert_pool_stored(state, info, eng=eng)
    compiled = aot.lower(eng.generate_call(state, ROWS, table_blocks=eng.max_blocks_per_seq),
                         state.positions.sharding).compile()
    mem = compiled.memory_analysis()
    print(f"{info.name} paged step on v5e tp={TP}: temp {mem.temp_size_in_bytes:,} B")
    assert kernel_calls(compiled) == LAYERS
    # no layer's pool copied (67 MB a chip): 2.2 MB with the experts' grouped matmuls a TPU runs
    assert mem.temp_size_in_bytes < layer_bytes(info, TP) // 16, mem
