"""What both sides of the Engine share: the model, its weights on the chips, and the shapes every
compiled core is keyed by (prefill length buckets, decode batch buckets, max_len).

engine_prefill.py and engine_decode.py build on this; engine.py puts them together. Kept apart so
each side reads on its own and the compiled shapes are decided in one place.
No I/O, no tokenizer, no settings here.
"""
from __future__ import annotations

import threading
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from tandem_core.errors import InvalidRequest, PromptTooLong
from tandem_core.models import ModelInfo
from tandem_core.types import KVPayload
from tandem_engine.model import config_from_info, split_layers
from tandem_engine.block_cache import BlockCache, CachingAllocator
from tandem_engine.paged import WindowGroup, window_blocks_per_row
from tandem_engine.quantize import check_quantize, is_quantized, quantize_params
from tandem_engine.sharding import make_layout
from tandem_engine.weights import resolve_dtype

DEFAULT_BUCKETS = (16, 32, 64, 128, 256, 512)
DEFAULT_STEPS_PER_DISPATCH = 4  # bench/engine_thread.py --steps-per-dispatch; EngineConfig mirrors it
# Positions per KV block (the unit services count KV capacity in).
# 16: a sequence wastes at most 15 positions in its last block (< 5% of a chat turn of a few
# hundred), and it is vLLM's default and a page size the TPU paged-attention kernel takes in
# bfloat16 (a multiple of its 16-row sublane tile); larger blocks waste more, smaller ones make
# longer tables (more gather indices per step).
DEFAULT_KV_BLOCK_SIZE = 16


class EngineBase:
    """The model, its placed weights and its compiled shapes. Not an engine by itself: see
    engine.Engine."""

    def __init__(self, info: ModelInfo, params: dict, *, slots: int = 4, max_len: int = 512,
                 prefill_buckets: Sequence[int] = DEFAULT_BUCKETS, dtype: str = "float32",
                 tp: int = 1, mesh: Mesh | None = None, prefix_chunk: int = 64,
                 expert_parallel: bool = False, steps_per_dispatch: int = DEFAULT_STEPS_PER_DISPATCH,
                 kv_block_size: int = DEFAULT_KV_BLOCK_SIZE,
                 kv_blocks: int | None = None, quantize: str | None = None, kv_reuse: bool = True,
                 kv_dtype: str | None = None, platform: str | None = None, window_group: bool = True):
        if slots < 1 or max_len < 1:
            raise ValueError(f"slots ({slots}) and max_len ({max_len}) must be positive")
        if max_len > info.max_position_embeddings:
            raise ValueError(
                f"max_len {max_len} exceeds the model's max_position_embeddings "
                f"{info.max_position_embeddings}"
            )
        self.info = info
        self.cfg = config_from_info(info)
        self.layout = make_layout(info, tp, mesh, expert_parallel)  # None: one device, unsharded
        # the platform the steps compile for: `platform` when given (aot.py compiles for TPU chips
        # from a CPU host), else that of the layout's devices or of JAX's default device
        if platform is None:
            devices = self.layout.mesh.devices.flat if self.layout is not None else jax.devices()[:1]
            platform = next(iter(devices)).platform
        self.platform = platform
        if self.cfg.moe:  # grouped matmuls where the platform has them (TPU, GPU); dense on a CPU
            self.cfg = self.cfg._replace(moe_impl="dense" if platform == "cpu" else "ragged")
        # the Pallas kernel's branch of the paged step only where it can run (paged.py: tracing it
        # costs ~0.5 s a layer call on every start, which the compilation cache does not save)
        self.cfg = self.cfg._replace(paged_kernel=platform == "tpu")
        # int8 weights (quantize.py): the layer matrices quantized here, before they are placed,
        # so each chip receives its shard of the int8 arrays and of their scales
        self.quantize = check_quantize(quantize) or ("int8" if is_quantized(params) else None)
        params = quantize_params(params, self.quantize)
        self.params = params if self.layout is None else self.layout.place_params(params)
        self._step_params: dict | None = None  # step_params, made on first use
        self.slots = int(slots)
        if steps_per_dispatch < 1:
            raise ValueError(f"steps_per_dispatch must be >= 1 (got {steps_per_dispatch})")
        # multi-step decode: the decode steps one dispatched call may run (engine_decode.generate's
        # `steps`); a decode pod runs this many when nothing needs a single step (decode_svc/loop.py)
        self.steps_per_dispatch = int(steps_per_dispatch)
        self.max_len = int(max_len)
        self._one_cpu = platform == "cpu"
        self.buckets = tuple(sorted({int(b) for b in prefill_buckets if 0 < b <= max_len})) or (
            self.max_len,
        )
        # a prompt over a cached prefix runs in chunks of this many tokens (one compiled shape)
        self.prefix_chunk = max(1, min(int(prefix_chunk), self.buckets[-1]))
        self.dtype = dtype
        self._jdtype = resolve_dtype(dtype)
        # Decode steps compile once per batch bucket: 2, 4, 8, ... below slots, and slots itself.
        # No bucket of 1 below slots: XLA CPU turns a one-row cache write into a select plus two
        # copies of the whole cache (seen in the compiled HLO: 12 ms a step instead of 2 at 32 slots).
        self.batch_buckets = tuple(sorted({1 << i for i in range(1, self.slots.bit_length()) if 1 << i < self.slots}
                                          | {self.slots}))
        # The KV: one pool of kv_block_size-position blocks shared by `slots` sequence rows, each
        # row reading its blocks through its block table (paged.py); with tp > 1 the pool is split
        # by KV head (sharding.Layout.kv_pool). `kv_blocks` sizes the pool (default: every row can
        # reach max_len at once).
        if kv_block_size < 1:
            raise ValueError(f"kv_block_size must be >= 1 (got {kv_block_size})")
        self.kv_block_size = int(kv_block_size)
        self.max_blocks_per_seq = -(-self.max_len // self.kv_block_size)
        total = self.slots * self.max_blocks_per_seq if kv_blocks is None else int(kv_blocks)
        if total < 1:
            raise ValueError(f"kv_blocks must be >= 1 (got {kv_blocks})")
        self.kv_blocks_total = total
        # the pool's element type: the compute dtype, or "fp8" (float8_e4m3fn: half of bfloat16's
        # bytes, a quarter of float32's; K and V cast to it when written and back when read; its
        # error against the dtype: bench/quantize_quality.py --kv)
        self.kv_dtype, self._kv_jdtype = _kv_dtype(kv_dtype, dtype, self._jdtype)
        # every layer windowed (mistral; qwen2 with windows on all layers): a row's blocks wholly
        # before the widest window its next step reaches go back to the pool (`reserve`); 0: some
        # layer attends to every position, so every block stays
        windows = [self.cfg.window(i) for i in range(self.cfg.num_layers)]
        self.window_frees = max(windows) if windows and min(windows) > 0 else 0
        # windowed layers beside global ones (gemma2, gemma3, gpt-oss): the windowed layers keep
        # their blocks in a group of their own (paged.WindowGroup: `window_span` blocks a row at
        # most), so their KV follows the window, not max_len; the global layers keep every block
        # in the pool of kv_blocks_total. Only where it saves blocks (a window shorter than max_len).
        # With reuse, a finished row's windowed blocks of its last window stay as a tail of its
        # kept chain (a later sequence can start on the chain only where it ends: a next turn).
        self.windowed = tuple(w > 0 for w in windows) if windows and 0 < max(windows) and min(windows) == 0 else ()
        # keep finished rows' full blocks for later sequences with the same leading tokens
        # (block_cache.py: a decode pod pulls only the rows it does not hold)
        self.kv_reuse = bool(kv_reuse)
        span = max(self.steps_per_dispatch, self.prefix_chunk)  # the most positions one call writes to a row
        # the blocks a row's windowed table holds at most (paged.WindowGroup.per_row)
        self.window_span = window_blocks_per_row(max(windows), self.kv_block_size, span, self.kv_reuse) if self.windowed else 0
        if not window_group or self.window_span >= self.max_blocks_per_seq:
            self.windowed, self.window_span = (), 0
        self._blocks_lock = threading.RLock()  # the block host state: engine thread and event loop
        self._reset_kv_host()

    def _reset_kv_host(self) -> None:
        """The host's view of the KV (what init_state starts from): which slots hold a sequence,
        the block allocator, each row's block table and blocks held, each row's next position
        (what generate advances) and insertion order (reserve serves the oldest first)."""
        self._occupied = np.zeros(self.slots, bool)
        self._pending: dict = {}  # slot -> engine_decode.PendingPrompt: prompts seated, not yet prefilled
        self._order = np.zeros(self.slots, np.int64)
        self._inserted = 0
        self._alloc = CachingAllocator(self.kv_blocks_total)
        self._reuse: BlockCache | None = BlockCache(self._alloc, self.kv_block_size) if self.kv_reuse else None
        self._table = np.zeros((self.slots, self.max_blocks_per_seq), np.int32)
        self._window: WindowGroup | None = None
        if self.windowed:
            self._window = WindowGroup(self.slots, self.max_blocks_per_seq, self.kv_block_size,
                                       max(self.cfg.window(i) for i in range(self.cfg.num_layers)),
                                       max(self.steps_per_dispatch, self.prefix_chunk), reuse=self.kv_reuse)
        self._held = np.zeros(self.slots, np.int64)  # blocks in each row's table
        self._pos = np.zeros(self.slots, np.int64)  # each row's next write position

    def kv_blocks_for(self, length: int) -> int:
        """Blocks `length` positions of KV take: ceil(length / kv_block_size)."""
        return -(-int(length) // self.kv_block_size)

    def kv_blocks_free(self) -> int:
        """Blocks free now: the pool's free list and the cached blocks no row holds (free for
        the taking)."""
        return self._alloc.free_count() + self._alloc.cached_only

    @property
    def step_params(self) -> dict:
        """The params a decode step reads: `params` itself, or on one CPU device (the step's
        layers run unrolled) the same params with the layer weights also held one
        layer apiece (model.split_layers: XLA CPU copies a stacked weight's layer slice before
        every dot). That copy of the layer weights is made once, on first use, and kept: there
        the layer weights sit in memory twice (prefill scans the stacked ones)."""
        if not (self.layout is None and self._one_cpu):
            return self.params
        if self._step_params is None:
            self._step_params = split_layers(self.params)
        return self._step_params

    @property
    def tp(self) -> int:
        return 1 if self.layout is None else self.layout.tp

    @property
    def mesh(self) -> Mesh | None:
        return None if self.layout is None else self.layout.mesh

    def max_prompt_len(self) -> int:
        return self.buckets[-1]

    def bucket_for(self, length: int) -> int:
        """The smallest bucket >= length (PromptTooLong when there is none)."""
        for b in self.buckets:
            if b >= length:
                return b
        raise PromptTooLong(
            f"prompt has {length} tokens but this engine accepts at most {self.max_prompt_len()}",
            param="prompt",
        )

    def rows_for(self, rows: int | None) -> int:
        """The batch bucket a step over slots [0, rows) computes (powers of two, then `slots`)."""
        if rows is None or rows >= self.slots:
            return self.slots
        return next(b for b in self.batch_buckets if b >= max(1, rows))

    def check_payload(self, payload: KVPayload) -> None:
        """InvalidRequest / PromptTooLong unless the payload's KV fits this model and max_len
        (any length bucket, any dtype): what import_prefix checks before placing it."""
        want = (self.cfg.num_layers, self.cfg.num_kv_heads, self.cfg.head_dim)
        for name, arr in (("k", payload.k), ("v", payload.v)):
            shape = tuple(arr.shape)
            if len(shape) != 4 or (shape[0], shape[2], shape[3]) != want:
                raise InvalidRequest(
                    f"KV payload {name} has shape {shape}; this model needs "
                    f"[{want[0]}, length, {want[1]}, {want[2]}]"
                )
        length = payload.k.shape[1]
        start = int(payload.start)
        if payload.v.shape[1] != length or start < 0 or not 0 < payload.true_length - start <= length:
            raise InvalidRequest(
                f"KV payload lengths disagree: k {length}, v {payload.v.shape[1]}, "
                f"true_length {payload.true_length}, start {start}"
            )
        if start + length > self.max_len:
            raise PromptTooLong(f"KV payload has {start + length} positions; this engine's max_len is {self.max_len}")

    def _place_kv(self, kv) -> jax.Array:
        """A prefix array (host or device, any sharding) on this engine's chips, in its dtype."""
        if self.layout is None:
            return jnp.asarray(kv, dtype=self._jdtype)
        if isinstance(kv, np.ndarray):
            kv = np.asarray(kv, dtype=self._jdtype)  # convert on the host, then one transfer
        return jax.device_put(kv, self.layout.kv_prefix()).astype(self._jdtype)


KV_DTYPES = ("auto", "fp8")


def _kv_dtype(kv_dtype: str | None, dtype: str, jdtype):
    """(name, element type) of the KV pool: `dtype`'s for None / "auto"."""
    if kv_dtype in (None, "", "auto"):
        return dtype, jdtype
    if kv_dtype != "fp8":
        raise ValueError(f"kv_dtype must be one of {KV_DTYPES} (got {kv_dtype!r})")
    return "fp8", jnp.float8_e4m3fn
