"""The decode step holds one copy of the KV pool on a TPU slice: compiled ahead of time for a TPU
v5e 2x4 (libtpu's compile-only devices, tandem_engine/aot.py; no TPU here) at tp 1, 4 and 8, one
step per call and four (the multi-step scan), the compiler's temporaries stay below one layer
buffer of the pool a chip holds (a copy of any one of its 2 x L buffers would pass that), and the donated pool comes back aliased (updated in place). A Llama-shaped
model with head_dim 128, so the step runs the Pallas kernel on each layer buffer, per chip on its
heads (tests/unit/test_paged_step_tpu.py holds the kernel's presence and the buffers' layout at one
chip and at tp 2).

The slot layout this test held before issue 43 deleted it: 1.5-1.7 MiB of temporaries at every tp
against 512 MiB of KV; broken on purpose (its cache written in windows of [KV, hd]) 514 MiB at tp 1.

Skips only where libtpu is not importable (`make test` installs it).
"""
from __future__ import annotations

import dataclasses

import pytest

from tandem_engine.aot import libtpu_missing

_why = libtpu_missing()
if _why:
    pytest.skip(_why, allow_module_level=True)

from tandem_core.models import PRESETS
from tandem_engine import aot

pytestmark = pytest.mark.slow  # make test-unit leaves it out (make test runs it): decode steps compiled for TPU slices (libtpu, no chip)

SLOTS, MAX_LEN = 16, 2048
LLAMA_KV8 = dataclasses.replace(PRESETS["tiny"], name="llama-kv8", hidden_size=1024, intermediate_size=2048,
                                num_layers=4, num_heads=16, num_kv_heads=8, head_dim=128,
                                max_position_embeddings=4096)


@pytest.fixture(scope="module")
def devices():
    return aot.topology_devices("v5e", "2x4")


@pytest.mark.parametrize("tp", [1, 4, 8])
def test_the_decode_step_keeps_one_copy_of_the_kv(devices, tp):
    comp = aot.Compiler(LLAMA_KV8, devices, tp=tp, slots=SLOTS, max_len=MAX_LEN, prefill_buckets=(64,),
                        dtype="bfloat16")
    eng = comp.engine
    state = aot.abstract_state(eng)
    kv = aot.shard_bytes((state.k, state.v))
    blocks = SLOTS * MAX_LEN // eng.kv_block_size + 1  # (and the null block)
    assert kv == 2 * 4 * blocks * eng.kv_block_size * 8 * 128 * 2 // tp
    for steps in (1, 4):
        lowered = aot.lower(eng.generate_call(state, SLOTS, steps=steps), eng.layout.replicated())
        mem = lowered.compile().memory_analysis()
        print(f"decode x{steps} on v5e tp={tp}: temp {mem.temp_size_in_bytes:,} B against KV {kv:,} B "
              f"({mem.temp_size_in_bytes / kv:.3f})")
        # below one layer's K buffer (kv / 8 here): a copy of any one pool buffer would pass it
        assert mem.temp_size_in_bytes < kv / (2 * 4), (steps, mem)
        assert mem.alias_size_in_bytes >= kv, (steps, mem)  # the donated pool is the returned pool
