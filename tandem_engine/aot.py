"""Ahead-of-time compilation of the Engine's serving steps for a TPU slice that is not here.

With `libtpu` installed (the `tpu` extra), JAX describes a TPU topology ("v5e:2x4") as
compile-only devices, and `jit(f).lower(<ShapeDtypeStructs with NamedShardings over them>)
.compile()` runs the real TPU compiler on this machine: no TPU, no weights. This module builds an
Engine over abstract weights (`jax.eval_shape` of `init_params`, placed with the engine's own
`Layout`), asks it for the call each serving step makes (`prefill_call`, `prefill_batch_call`,
`insert_call`, `generate_call`: the jitted core and the arguments its own host code builds, a
`cores.CoreCall`) and lowers that core with those arguments as shapes with shardings (`lower`)
instead of running it. So what compiles here is what a pod runs: the same cores, buckets, shapes
and shardings, and a change in any of them flows through.

Per compiled step it keeps the compiler's memory analysis (per chip: arguments, outputs, aliased
donations, temporaries) and cost analysis (flops, bytes accessed). The compiler's cost of a `lax.scan` over
the layers is the body's once, whatever the trip count (measured: the built-in model's 4-layer
prefill counts the flops of its 1-layer compile, and a 2-layer compile counts them once too), so
`Compiler.count_layers` takes the cost from a 1-layer and a 2-layer compile of the same step
traced with its layer loop unrolled (`ModelConfig.unroll_layers`): one layer costs c2 - c1, the rest
2 c1 - c2, and the whole step (2 c1 - c2) + L (c2 - c1). (The full model's scanned compile is no
substitute for c1: what it does outside the body scales with L.) The decode step's attention reads
a context only known at run time: on a TPU the Pallas kernel, which the compiler's cost analysis
does not count, or the gather path's loop over pieces of the pool, whose body it counts once per
layer. So the cost compiles run over a pool of one block per row (the compiler counts a write into
a pool buffer as bytes of the whole buffer), and tandem/fit.py adds the KV a step at a given
context reads and the attention's flops over it.

No I/O beyond the compiler, no settings; tandem/fit.py turns these numbers into a sizing report.
"""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field

import jax
import numpy as np
from jax.sharding import Mesh

from tandem_core.models import ModelInfo
from tandem_core.types import SamplingParams
from tandem_engine.api import PrefillCall
from tandem_engine.cores import CoreCall
from tandem_engine.engine import Engine, Prefix
from tandem_engine.quantize import quantize_params
from tandem_engine.sharding import AXIS, Layout, make_layout
from tandem_engine.weights import init_params


class TPUUnavailable(RuntimeError):
    """libtpu is not installed, so no TPU topology can be described."""


def libtpu_missing() -> str | None:
    """None when TPU topologies can be described here; otherwise why not and what to do."""
    try:
        import libtpu  # noqa: F401
    except ImportError as e:
        return (f"libtpu is not importable ({e}); install the tpu extra: pip install -e '.[tpu]' "
                f"(libtpu matching this jax {jax.__version__})")
    return None


def topology_devices(tpu: str, topology: str) -> list:
    """The compile-only devices of a TPU slice, e.g. ("v5e", "2x4"): 8 chips. Needs libtpu."""
    why = libtpu_missing()
    if why:
        raise TPUUnavailable(why)
    import os
    from jax.experimental import topologies

    # libtpu looks for a TPU VM's metadata and warns loudly when there is none; compiling does
    # not need it, so give it what it asks for (only for this process, only where unset). Any
    # other JAX process on this machine (a CPU pod, a test) may hold libtpu's lockfile, which only
    # guards a real chip: compile-only devices share nothing.
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    os.environ.setdefault("TPU_ACCELERATOR_TYPE", f"{tpu}-{int(np.prod([int(x) for x in topology.split('x')]))}")
    os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
    os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
    desc = topologies.get_topology_desc(platform="tpu", topology_name=f"{tpu}:{topology}")
    return list(desc.devices)


# ---------------------------------------------------------------------------------------------
# an Engine over abstract weights


class _AbstractEngine(Engine):
    """An Engine whose params and states are ShapeDtypeStructs carrying NamedShardings. Only the
    host-side placement differs (a struct is "placed" by giving it the sharding); the cores are
    lowered, never run (see `Compiler`)."""

    def _place_kv(self, kv):
        return jax.ShapeDtypeStruct(tuple(kv.shape), self._jdtype, sharding=self.layout.kv_prefix())

    def _table_array(self, table=None):
        """The paged block tables as a replicated struct (compile-only chips take no transfer)."""
        if self.layout is None:
            return super()._table_array(table)
        table = self._table if table is None else table
        return jax.ShapeDtypeStruct(table.shape, table.dtype, sharding=self.layout.replicated())


def abstract_params(info: ModelInfo, dtype: str, layout: Layout, quantize: str | None = None) -> dict:
    """The params pytree as ShapeDtypeStructs sharded as the engine places them (no weights);
    `quantize="int8"`: the int8 layer matrices and their scales (quantize.py)."""
    shapes = jax.eval_shape(lambda: quantize_params(init_params(info, dtype), quantize))
    shardings = layout.param_shardings(shapes)
    return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), shapes, shardings)


def build_engine(info: ModelInfo, devices: list, *, tp: int, slots: int, max_len: int,
                 prefill_buckets, dtype: str, expert_parallel: bool = False, quantize: str | None = None,
                 unroll_layers: bool = False, kv_blocks: int | None = None) -> Engine:
    """An Engine for `tp` of `devices` (the first tp) with abstract weights; raises ValueError
    for what a real Engine refuses (tp not dividing the heads, max_len past the model's).
    `expert_parallel`: a mixture of experts splits whole experts across the chips (the layout's
    option where the engine has it). `unroll_layers`: its steps trace the layer loop unrolled
    (the cost-accounting compiles). `kv_blocks`: the KV pool's size (default: every row can reach
    max_len)."""
    if tp > len(devices):
        raise ValueError(f"tp={tp} needs {tp} chips; the topology has {len(devices)}")
    ep = {"expert_parallel": True} if expert_parallel else {}
    layout = make_layout(info, tp, Mesh(np.asarray(devices[:tp]), (AXIS,)), **ep)
    params = abstract_params(info, dtype, layout, quantize)
    # tp=1 and no mesh here: the base class keeps `params` as given (no device_put of structs);
    # the layout over the TPU chips is set right after. What depends on the platform (the experts'
    # grouped matmuls) follows the chips compiled for, not this host's CPU.
    eng = _AbstractEngine(info, params, slots=slots, max_len=max_len, prefill_buckets=prefill_buckets,
                          dtype=dtype, tp=1, platform=devices[0].platform, kv_blocks=kv_blocks)
    eng.layout = layout
    if unroll_layers:
        eng.cfg = eng.cfg._replace(unroll_layers=True)
    return eng


def abstract_state(eng: Engine):
    """The engine's own `init_state`, as shapes, with the shardings it allocates them with: the
    KV pool's layer buffers (k, v) on `layout.kv_pool()`, everything else replicated."""
    shapes = jax.eval_shape(eng.init_state)
    pool, rep = eng.layout.kv_pool(), eng.layout.replicated()

    def place(path, s):
        name = getattr(path[0], "name", None) if path else None
        return jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=pool if name in ("k", "v") else rep)

    return jax.tree_util.tree_map_with_path(place, shapes)


# ---------------------------------------------------------------------------------------------
# lowering what the engine calls


def _abstract_args(args, replicated):
    """numpy / scalar leaves -> replicated ShapeDtypeStructs; structs stay as they are."""
    def one(x):
        if isinstance(x, jax.ShapeDtypeStruct):
            return x
        a = np.asarray(x)
        return jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=replicated)
    return jax.tree.map(one, args)


def lower(call: CoreCall, replicated):
    """`call`'s jitted core lowered with its own arguments as shapes: the structs (abstract weights,
    state, KV) as they are, sharded as the engine places them; host arrays and scalars as
    replicated structs."""
    return call.core.lower(*_abstract_args(call.args, replicated), **call.static)


@dataclass
class Step:
    """One compiled step on one chip: the compiler's memory and cost figures."""

    name: str
    compile_s: float
    argument_bytes: int
    output_bytes: int
    alias_bytes: int
    temp_bytes: int
    code_bytes: int
    flops: float  # as the compiler counts them: a scanned body once
    bytes_accessed: float
    layer_flops: float = 0.0  # one layer's share (c2 - c1), 0 when not measured
    layer_bytes: float = 0.0
    num_layers: int = 0  # how many times layer_* count in total_*
    extra: dict = field(default_factory=dict)

    @property
    def peak_bytes(self) -> int:
        """What the step needs live at once: its inputs, its outputs not aliased to a donated
        input, its temporaries and its code."""
        return self.argument_bytes + self.output_bytes - self.alias_bytes + self.temp_bytes + self.code_bytes

    @property
    def total_flops(self) -> float:
        """Flops with the layer loop counted num_layers times."""
        return self.flops + self.num_layers * self.layer_flops

    @property
    def total_bytes(self) -> float:
        return self.bytes_accessed + self.num_layers * self.layer_bytes


class DoesNotFit(RuntimeError):
    """The TPU compiler found no way to fit a step in the chip's HBM (its RESOURCE_EXHAUSTED)."""

    def __init__(self, step: str, message: str):
        super().__init__(f"{step}: {message}")
        self.step, self.message = step, message


def _step(name: str, lowered, t0: float) -> Step:
    try:
        compiled = lowered.compile()
    except Exception as e:  # jax's XlaRuntimeError; only an out-of-memory verdict is an answer
        if "RESOURCE_EXHAUSTED" not in str(e):
            raise
        raise DoesNotFit(name, str(e).split("\n")[0]) from e
    secs = time.perf_counter() - t0
    mem = compiled.memory_analysis()
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    return Step(name=name, compile_s=secs, argument_bytes=int(mem.argument_size_in_bytes),
                output_bytes=int(mem.output_size_in_bytes), alias_bytes=int(mem.alias_size_in_bytes),
                temp_bytes=int(mem.temp_size_in_bytes), code_bytes=int(mem.generated_code_size_in_bytes),
                flops=float(cost.get("flops", 0.0)), bytes_accessed=float(cost.get("bytes accessed", 0.0)))


class Compiler:
    """Compiles one engine configuration's steps for a TPU slice.

    `Compiler(info, devices, tp=..., slots=..., max_len=..., prefill_buckets=..., dtype=...)`;
    `prefill(bucket)`, `insert(bucket)`, `generate(rows)` each return a `Step` for the full model
    with its layer loop accounted (`layers=False` skips the unrolled 1- and 2-layer compiles)."""

    def __init__(self, info: ModelInfo, devices: list, *, tp: int, slots: int, max_len: int,
                 prefill_buckets, dtype: str, expert_parallel: bool = False, quantize: str | None = None):
        self.info, self.devices = info, devices
        self.kw = dict(tp=tp, slots=slots, max_len=max_len, prefill_buckets=tuple(prefill_buckets), dtype=dtype,
                       expert_parallel=expert_parallel, quantize=quantize)
        self.engine = build_engine(info, devices, **self.kw)
        self._small: dict[int, Engine] = {}

    def _engine(self, layers: int | None) -> Engine:
        if layers is None:
            return self.engine
        if layers not in self._small:
            small = _first_layers(self.info, layers)
            # a pool of one block per row: the compiler counts a write into a pool buffer as bytes of
            # the whole buffer, so the cost compiles hold the least pool a step can run over, and
            # tandem/fit.py adds the KV a step at a given context reads (`attention_reads`)
            self._small[layers] = build_engine(small, self.devices, **self.kw, unroll_layers=True,
                                               kv_blocks=self.kw["slots"])
        return self._small[layers]

    def _one(self, kind: str, arg: int, layers: int | None, **opts) -> Step:
        eng = self._engine(layers)
        rep = eng.layout.replicated()
        t0 = time.perf_counter()
        if kind == "prefill":
            call = eng.prefill_call([0] * arg, SamplingParams())
        elif kind == "prefill_batch":  # `rows` prompts of bucket `arg` in one pass (a prefill pod's batch)
            call = eng.prefill_batch_call([PrefillCall([0] * arg, SamplingParams())] * int(opts.get("rows", 2)))
        elif kind == "insert":
            c = eng.cfg
            kv = jax.ShapeDtypeStruct((c.num_layers, arg, c.num_kv_heads, c.head_dim), eng._jdtype,
                                      sharding=eng.layout.kv_prefix())
            call = eng.insert_call(Prefix(kv, kv, 1, 0), abstract_state(eng), 0, SamplingParams())
        elif kind == "generate":
            call = eng.generate_call(abstract_state(eng), arg, logprobs=opts.get("logprobs", False))
        else:
            raise ValueError(kind)
        return _step(f"{kind}[{arg}]", lower(call, rep), t0)

    def step(self, kind: str, arg: int, *, layers: bool = True, **opts) -> Step:
        full = self._one(kind, arg, None, **opts)
        if layers:
            self.count_layers(full, kind, arg, **opts)
        return full

    def count_layers(self, full: Step, kind: str, arg: int, **opts) -> Step:
        """Correct `full` (this engine's compile of `kind`) for the layer loop, in place."""
        one, two = self._one(kind, arg, 1, **opts), self._one(kind, arg, 2, **opts)  # layers unrolled
        if two.flops <= one.flops:
            raise RuntimeError(f"{full.name}: an unrolled 2-layer compile counted no more flops than a 1-layer "
                               f"one ({two.flops:.3g} <= {one.flops:.3g}): the layer loop was not unrolled, so "
                               f"its cost cannot be told apart")
        # the full compile counts the layer body once: keep its figures aside and count
        # (2 c1 - c2) + L (c2 - c1) instead
        full.extra["scanned_flops"], full.extra["scanned_bytes"] = full.flops, full.bytes_accessed
        full.layer_flops = two.flops - one.flops
        full.layer_bytes = max(0.0, two.bytes_accessed - one.bytes_accessed)
        full.flops = max(0.0, one.flops - full.layer_flops)
        full.bytes_accessed = max(0.0, one.bytes_accessed - full.layer_bytes)
        full.num_layers = self.info.num_layers
        full.extra["layer_compile_s"] = one.compile_s + two.compile_s
        return full

    def sampling(self, rows: int) -> Step:
        """The sampler alone (tandem_engine.sampling.sample over [rows, vocab] float32 logits, as
        the decode step calls it): the compiler counts its sort-based branch, which a step runs
        only when a slot samples at temperature > 0, so this part of a step's cost is what an
        all-greedy batch saves."""
        from tandem_engine.sampling import sample, token_keys

        rep = self.engine.layout.replicated()
        v = self.engine.cfg.vocab_size

        def s(shape, dtype):
            return jax.ShapeDtypeStruct(shape, dtype, sharding=rep)

        def run(logits, temperature, top_k, top_p, seeds, step):
            return sample(logits, temperature, top_k, top_p, token_keys(seeds, step))

        t0 = time.perf_counter()
        lowered = jax.jit(run).lower(s((rows, v), np.float32), s((rows,), np.float32), s((rows,), np.int32),
                                     s((rows,), np.float32), s((rows, 2), np.uint32), s((rows,), np.int32))
        return _step(f"sample[{rows}]", lowered, t0)

    def prefill(self, bucket: int, **kw) -> Step:
        return self.step("prefill", bucket, **kw)

    def prefill_batch(self, bucket: int, rows: int, **kw) -> Step:
        """`rows` prompts of one bucket in one batched prefill (a power of two, as prefill_batch runs)."""
        return self.step("prefill_batch", bucket, rows=rows, **kw)

    def insert(self, bucket: int, **kw) -> Step:
        return self.step("insert", bucket, layers=False, **kw)

    def generate(self, rows: int, **kw) -> Step:
        return self.step("generate", rows, **kw)


def shard_bytes(tree) -> int:
    """Bytes one chip holds of a pytree of sharded ShapeDtypeStructs (the largest shard: what
    Tandem's layout puts on each chip)."""
    total = 0
    for s in jax.tree.leaves(tree):
        shape = s.sharding.shard_shape(s.shape) if getattr(s, "sharding", None) is not None else s.shape
        total += int(np.prod(shape, dtype=np.int64)) * np.dtype(s.dtype).itemsize
    return total


def _first_layers(info, layers: int):
    """`info` cut to its first `layers` layers (the cost-accounting compiles), per-layer types
    (windows) included. A model whose layers differ (Gemma 3's 5 local : 1 global) is costed from
    its first layers' kind."""
    extra = dict(info.extra or {})
    hf = extra.get("hf_config")
    if hf:
        hf = {**hf, "num_hidden_layers": layers}
        if hf.get("layer_types"):
            hf["layer_types"] = list(hf["layer_types"])[:layers]
        extra["hf_config"] = hf
    return dataclasses.replace(info, num_layers=layers, extra=extra)
