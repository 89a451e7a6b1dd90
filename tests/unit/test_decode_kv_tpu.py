"""The slot layout's decode step holds one copy of the KV on a TPU: compiled ahead of time for a
TPU v5e 2x4 (libtpu's compile-only devices, tandem_engine/aot.py; no TPU here) at tp 1, 4 and 8,
one step per call and four (the multi-step scan), the compiler's temporaries stay below 5% of the
KV bytes a chip holds, and the donated cache comes back aliased (updated in place).

Measured (8 KV heads, 16 slots x 2048 positions, 4 layers: 512 MiB of KV at tp 1): 1.5-1.7 MiB of
temporaries at every tp. Broken on purpose: the cache written as `kc.at[i, slot_idx, :, write_pos]`
(windows of [KV, hd]) made the TPU compiler lay the cache out position-major inside the step and
copy it in and out: temporaries 514 MiB at tp 1 (1.00x the KV), 66 MiB at tp 4 (0.51x), 1.5 MiB at
tp 8 (one KV head a chip: both layouts are the same there). The paged layout's step is held to the
same by tests/unit/test_paged_step_tpu.py.

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
def test_the_slot_decode_step_keeps_one_copy_of_the_kv(devices, tp):
    comp = aot.Compiler(LLAMA_KV8, devices, tp=tp, slots=SLOTS, max_len=MAX_LEN, prefill_buckets=(64,),
                        dtype="bfloat16")
    eng = comp.engine
    assert eng.kv_layout == "slots"  # one [L, slots, KV, max_len, hd] array
    state = aot.abstract_state(eng)
    kv = aot.shard_bytes((state.k, state.v))
    assert kv == 2 * 4 * SLOTS * 8 * MAX_LEN * 128 * 2 // tp
    for steps in (1, 4):
        lowered = aot.lower(eng.generate_call(state, SLOTS, steps=steps), eng.layout.replicated())
        mem = lowered.compile().memory_analysis()
        print(f"slot decode x{steps} on v5e tp={tp}: temp {mem.temp_size_in_bytes:,} B against KV {kv:,} B "
              f"({mem.temp_size_in_bytes / kv:.3f})")
        assert mem.temp_size_in_bytes < 0.05 * kv, (steps, mem)
        assert mem.alias_size_in_bytes >= kv, (steps, mem)  # the donated cache is the returned cache
