"""Engine benchmark: decode and prefill throughput beside Hugging Face `generate` and the machine's
own limits, all measured in one run (`python bench/engine.py [--quick] [--models a,b]`).

Per model: decode tokens/s at batch 1, 8, 32 (every slot active, the step pipelined as the decode
pod runs it); prefill tokens/s at 128, 512, 2048 prompt tokens (lengths past the model's context
are skipped); HF `generate` (PyTorch CPU, greedy, KV cache) on the same weights, decode only; and
the host gap per decode step with and without pipelining (device time of back-to-back steps vs the
loop's wall time). Limits from the same run: memory bandwidth (large array copy) and matmul FLOP/s
(large jnp.dot). Roofline: decode step = (weights + KV in use) bytes / bandwidth; prefill = matmul
FLOPs / peak. Writes its section of bench/RESULTS.md and merges its keys into
bench/out/summary.json. Timings are reported, never asserted.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.common import machine_info, machine_line, markdown_table, merge_summary, write_section
from tandem_core.models import ModelInfo

SECTION = "engine"
DECODE_BATCHES = (1, 8, 32)
PREFILL_LENGTHS = (128, 512, 2048)
PROMPT_LEN = 64  # decode slots start from a prompt of this many tokens


# roofline arithmetic (pure; unit-tested)


def layer_matmul_params(info: ModelInfo) -> int:
    """Weights of the attention and MLP projections, all layers."""
    d, f, hd = info.hidden_size, info.intermediate_size, info.head_dim
    per_layer = d * hd * (2 * info.num_heads + 2 * info.num_kv_heads) + 3 * d * f
    return info.num_layers * per_layer


def decode_weight_bytes(info: ModelInfo, dtype_bytes: int = 4) -> int:
    """Bytes of weights one decode step reads: everything but the embedding table, of which a
    step reads one row per slot (tied embeddings are read whole, as the LM head)."""
    d, v = info.hidden_size, info.vocab_size
    norms = (2 * info.num_layers + 1) * d
    head = v * d
    return (layer_matmul_params(info) + norms + head) * dtype_bytes


def kv_bytes(info: ModelInfo, batch: int, context: int, dtype_bytes: int = 4) -> int:
    """K and V of `batch` slots holding `context` positions each."""
    return 2 * info.num_layers * batch * context * info.num_kv_heads * info.head_dim * dtype_bytes


def decode_roofline_s(info: ModelInfo, batch: int, context: int, bandwidth: float,
                      dtype_bytes: int = 4) -> float:
    """The least time a decode step can take when it must read every weight and the KV in use."""
    return (decode_weight_bytes(info, dtype_bytes) + kv_bytes(info, batch, context, dtype_bytes)) / bandwidth


def prefill_flops(info: ModelInfo, tokens: int) -> float:
    """Matmul FLOPs of one causal prefill: projections 2*N*T, attention scores and values
    2 * 2 * T^2 * hd per head halved by the causal mask, LM head on the last position."""
    attn = 2.0 * info.num_layers * info.num_heads * info.head_dim * tokens * tokens
    head = 2.0 * info.hidden_size * info.vocab_size
    return 2.0 * layer_matmul_params(info) * tokens + attn + head


def prefill_roofline_s(info: ModelInfo, tokens: int, flops_per_s: float) -> float:
    return prefill_flops(info, tokens) / flops_per_s


def idle_fraction(wall_per_step: float, device_per_step: float) -> float:
    """Share of the loop's wall time the device has no step to run (0 when it is never starved)."""
    if wall_per_step <= 0:
        return 0.0
    return max(0.0, wall_per_step - device_per_step) / wall_per_step


# the machine's limits


def best_time(fn, reps: int) -> float:
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def measure_bandwidth(nbytes: int = 256 << 20, reps: int = 5) -> dict:
    """Copy bandwidth (bytes read + written per second): numpy and a jitted XLA elementwise op."""
    import jax
    import jax.numpy as jnp

    src = np.ones(nbytes // 4, np.float32)
    dst = np.empty_like(src)
    t_np = best_time(lambda: np.copyto(dst, src), reps)
    box = [jnp.asarray(src)]
    scale = jax.jit(lambda a: a * 1.0001, donate_argnums=0)  # in place: no page faults timed

    def xla_copy():
        box[0] = scale(box[0])
        box[0].block_until_ready()

    xla_copy()
    t_jx = best_time(xla_copy, reps)
    return {"numpy_copy": 2 * nbytes / t_np, "xla_copy": 2 * nbytes / t_jx}


def measure_matmul(n: int = 2048, reps: int = 5) -> float:
    """float32 FLOP/s of an n x n jnp.dot."""
    import jax
    import jax.numpy as jnp

    a = jnp.asarray(np.random.default_rng(0).standard_normal((n, n), np.float32))
    dot = jax.jit(jnp.dot)
    dot(a, a).block_until_ready()
    return 2.0 * n**3 / best_time(lambda: dot(a, a).block_until_ready(), reps)


# engine decode, with and without pipelining


@dataclass
class DecodeResult:
    batch: int
    device_s: float  # per step, steps dispatched back to back
    wall_serial_s: float  # per step, copy + bookkeeping before the next dispatch
    wall_pipelined_s: float  # per step, next step dispatched first
    context: int  # mean positions per slot during the pipelined run
    sampling_ms: float | None = None  # the sampler alone at this batch

    @property
    def tokens_per_s(self) -> float:
        return self.batch / self.wall_pipelined_s


def filled_state(engine, rng: np.random.Generator):
    """A DecodeState with every slot holding the same PROMPT_LEN-token prompt."""
    from tandem_core.types import SamplingParams

    ids = rng.integers(3, engine.info.vocab_size, PROMPT_LEN)
    prefix = engine.prefill(ids.tolist(), SamplingParams())
    state = engine.init_state()
    for slot in range(engine.slots):
        state = engine.insert(prefix, state, slot, SamplingParams())
    return state


def bookkeeping(host_tokens: np.ndarray, emitted: list) -> None:
    """What the decode loop does per step on the host: one Python decision per slot."""
    stop = {-1}
    for slot, tok in enumerate(host_tokens.tolist()):
        emitted.append((slot, tok, tok in stop))


MODES = ("device", "serial", "pipelined")


def run_steps(engine, state, steps: int, mode: str):
    """Run `steps` decode steps; returns (state, seconds per step). mode: "device" (dispatch all,
    block once), "serial" (copy and book-keep each step before the next dispatch) or
    "pipelined" (dispatch step n+1, then copy and book-keep step n)."""
    import jax

    emitted: list = []
    pending = None
    t0 = time.perf_counter()
    for _ in range(steps):
        state, toks = engine.generate(state)
        if mode == "serial":
            bookkeeping(np.asarray(toks), emitted)
        elif mode == "pipelined":
            if pending is not None:
                bookkeeping(np.asarray(pending), emitted)
            pending = toks
    if mode == "pipelined" and pending is not None:
        bookkeeping(np.asarray(pending), emitted)
    jax.block_until_ready(state)
    return state, (time.perf_counter() - t0) / steps


def bench_decode(base, batch: int, plan: "Plan", max_len: int) -> DecodeResult:
    """Alternate the three modes for `plan.decode_rounds` rounds and keep each mode's best round
    (the machine is shared: the best round is the least disturbed one)."""
    from tandem_engine import Engine

    engine = Engine(base.info, base.params, slots=batch, max_len=max_len, prefill_buckets=(PROMPT_LEN,))
    state = filled_state(engine, np.random.default_rng(batch))
    for mode in MODES:  # compile and warm every path
        state, _ = run_steps(engine, state, 2, mode)
    best = {mode: float("inf") for mode in MODES}
    contexts = []
    for _ in range(plan.decode_rounds):
        for mode in MODES:
            contexts.append(int(np.asarray(state.positions)[0]) + plan.decode_steps // 2)
            state, per_step = run_steps(engine, state, plan.decode_steps, mode)
            best[mode] = min(best[mode], per_step)
    del state
    return DecodeResult(batch, best["device"], best["serial"], best["pipelined"],
                        context=int(np.mean(contexts)),
                        sampling_ms=sampling_ms(engine.info.vocab_size, batch))


def decode_max_len(plan: "Plan") -> int:
    """Cache rows for warm-up plus every round of every mode, rounded up to 64."""
    used = PROMPT_LEN + 2 * len(MODES) + plan.decode_rounds * len(MODES) * plan.decode_steps + 1
    return -(-used // 64) * 64


def bench_prefill(base, length: int, reps: int) -> float:
    """Median seconds of one prefill of `length` tokens (after a compiling run)."""
    from tandem_core.types import SamplingParams

    ids = np.random.default_rng(length).integers(3, base.info.vocab_size, length).tolist()
    base.prefill(ids, SamplingParams())
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        base.prefill(ids, SamplingParams())  # blocks on the first token
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def sampling_ms(vocab: int, batch: int, reps: int = 3) -> float | None:
    """Milliseconds of the engine's jitted sampling alone on [batch, vocab] greedy logits: the part
    of a decode step that reads no weights (None if the engine's sampler has moved)."""
    try:
        import jax
        import jax.numpy as jnp

        from tandem_engine.sampling import sample, token_keys
    except ImportError:
        return None
    logits = jnp.asarray(np.random.default_rng(0).standard_normal((batch, vocab), np.float32))
    keys = token_keys(jnp.zeros((batch, 2), jnp.uint32), jnp.zeros((batch,), jnp.int32))
    args = (logits, jnp.zeros((batch,)), jnp.zeros((batch,), jnp.int32), jnp.ones((batch,)), keys)
    fn = jax.jit(sample)
    fn(*args).block_until_ready()
    return 1e3 * best_time(lambda: fn(*args).block_until_ready(), reps)


# Hugging Face generate on the same weights


def hf_model(base, tmp: str):
    import torch
    from transformers import LlamaForCausalLM

    from tandem_engine import save_hf_checkpoint

    path = base.info.path or str(save_hf_checkpoint(base.params, base.info, Path(tmp) / "hf"))
    torch.set_num_threads(os.cpu_count() or 1)
    return LlamaForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def hf_decode_tokens_per_s(model, batch: int, new_tokens: int, vocab: int) -> float:
    """Greedy decode tokens/s of `generate` at `batch`: a (new_tokens + 1)-token run minus a
    1-token run, so the prompt's prefill is left out as it is for the engine."""
    import torch

    ids = torch.as_tensor(np.random.default_rng(batch).integers(3, vocab, (batch, PROMPT_LEN)))

    def gen(n: int) -> float:
        t0 = time.perf_counter()
        with torch.inference_mode():
            model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                           max_new_tokens=n, min_new_tokens=n, pad_token_id=0)
        return time.perf_counter() - t0

    gen(2)  # warm
    t_one, t_all = gen(1), gen(new_tokens + 1)
    return batch * new_tokens / max(t_all - t_one, 1e-9)


# one model, then the report


@dataclass
class Plan:
    decode_steps: int
    decode_rounds: int
    prefill_reps: int
    hf_batches: tuple[int, ...]
    hf_new_tokens: int
    skip_prefill: tuple[tuple[str, int], ...] = ()  # (model, prompt tokens) not measured


# --quick fits `make bench QUICK=1` (~3 min on 2 cores): the 100m model's 2048-token prefill alone
# took over a minute (a compiling run and a timed one), so it is left to full runs
QUICK = Plan(decode_steps=8, decode_rounds=2, prefill_reps=1, hf_batches=(8,), hf_new_tokens=8,
             skip_prefill=(("small-100m", 2048),))
FULL = Plan(decode_steps=32, decode_rounds=5, prefill_reps=3, hf_batches=(1, 8), hf_new_tokens=32)


def bench_model(name: str, plan: Plan) -> dict:
    import gc

    from tandem_core.models import resolve_model
    from tandem_engine import load_engine

    info = resolve_model(name)
    lengths = [n for n in PREFILL_LENGTHS if n <= info.max_position_embeddings]
    base = load_engine(name, slots=1, max_len=max(lengths), prefill_buckets=tuple(lengths))
    out = {"name": name, "info": base.info, "decode": [], "prefill": [], "hf": {},
           "skipped": [n for n in PREFILL_LENGTHS if n not in lengths],
           "quick_skipped": [n for n in lengths if (name, n) in plan.skip_prefill]}
    for n in lengths:
        if n in out["quick_skipped"]:
            continue
        out["prefill"].append((n, bench_prefill(base, n, plan.prefill_reps)))
        print(f"  {name} prefill {n}: {out['prefill'][-1][1] * 1e3:.1f} ms", flush=True)
    decode_len = min(decode_max_len(plan), info.max_position_embeddings)
    for b in DECODE_BATCHES:
        r = bench_decode(base, b, plan, decode_len)
        out["decode"].append(r)
        print(f"  {name} decode b{b}: {r.tokens_per_s:.1f} tok/s", flush=True)
        gc.collect()
    with tempfile.TemporaryDirectory() as tmp:
        model = hf_model(base, tmp)
        for b in plan.hf_batches:
            out["hf"][b] = hf_decode_tokens_per_s(model, b, plan.hf_new_tokens, base.info.vocab_size)
            print(f"  {name} HF generate b{b}: {out['hf'][b]:.1f} tok/s", flush=True)
        del model
    del base
    gc.collect()
    return out


def decode_rows(res: dict, bandwidth: float) -> list[list]:
    rows = []
    for r in res["decode"]:
        roof = decode_roofline_s(res["info"], r.batch, r.context, bandwidth)
        hf = res["hf"].get(r.batch)
        rows.append([res["name"], r.batch, r.tokens_per_s, r.wall_pipelined_s * 1e3, r.sampling_ms,
                     roof * 1e3, r.wall_pipelined_s / roof, hf, (r.tokens_per_s / hf) if hf else None])
    return rows


def prefill_rows(res: dict, flops: float) -> list[list]:
    rows = [[res["name"], n, n / s, s * 1e3, prefill_roofline_s(res["info"], n, flops) * 1e3,
             s / prefill_roofline_s(res["info"], n, flops)] for n, s in res["prefill"]]
    rows += [[res["name"], n, "skipped: past the model's context", None, None, None]
             for n in res["skipped"]]
    rows += [[res["name"], n, "skipped in --quick (see a full run)", None, None, None]
             for n in res.get("quick_skipped", ())]
    return rows


def pipeline_rows(res: dict) -> list[list]:
    rows = []
    for r in res["decode"]:
        gap_s = max(0.0, r.wall_serial_s - r.device_s)
        gap_p = max(0.0, r.wall_pipelined_s - r.device_s)
        rows.append([res["name"], r.batch, r.device_s * 1e3, r.wall_serial_s * 1e3, gap_s * 1e3,
                     f"{100 * idle_fraction(r.wall_serial_s, r.device_s):.0f}%",
                     r.wall_pipelined_s * 1e3, gap_p * 1e3,
                     f"{100 * idle_fraction(r.wall_pipelined_s, r.device_s):.0f}%"])
    return rows


DECODE_HEAD = ["model", "batch", "engine tok/s", "step ms", "of which sampling ms", "mem roofline ms",
               "step / roofline",
               "HF generate tok/s", "engine / HF"]
PREFILL_HEAD = ["model", "prompt tokens", "engine tok/s", "ms", "matmul roofline ms", "time / roofline"]
PIPE_HEAD = ["model", "batch", "device ms/step", "serial ms/step", "serial host gap ms",
             "serial idle", "pipelined ms/step", "pipelined host gap ms", "pipelined idle"]


def summary_keys(results: list[dict], bandwidth: float, flops: float) -> dict:
    """The ratios other tools read from bench/out/summary.json."""
    keys = {}
    for res in results:
        tag = "100m" if res["name"] == "small-100m" else res["name"]
        by_batch = {r.batch: r for r in res["decode"]}
        if 8 in by_batch and res["hf"].get(8):
            ratio = by_batch[8].tokens_per_s / res["hf"][8]
            keys[f"engine_decode_b8_vs_hf_generate_{tag}"] = round(ratio, 3)
            if tag == "100m":
                keys["engine_decode_b8_vs_hf_generate"] = round(ratio, 3)
        if 32 in by_batch:
            r = by_batch[32]
            roof = decode_roofline_s(res["info"], 32, r.context, bandwidth)
            keys[f"engine_decode_b32_over_mem_roofline_{tag}"] = round(r.wall_pipelined_s / roof, 3)
        for n, s in res["prefill"]:
            if n == 2048:
                roof = prefill_roofline_s(res["info"], n, flops)
                keys[f"engine_prefill_2048_over_matmul_roofline_{tag}"] = round(s / roof, 3)
        if 2048 in res.get("quick_skipped", ()):  # no stale number from an earlier run
            keys[f"engine_prefill_2048_over_matmul_roofline_{tag}"] = None
            keys[f"engine_prefill_2048_over_matmul_roofline_{tag}_reason"] = "skipped in --quick"
        if 8 in by_batch:
            r = by_batch[8]
            keys[f"engine_idle_fraction_b8_serial_{tag}"] = round(idle_fraction(r.wall_serial_s, r.device_s), 3)
            keys[f"engine_idle_fraction_b8_pipelined_{tag}"] = round(
                idle_fraction(r.wall_pipelined_s, r.device_s), 3)
    return keys


def report(results: list[dict], limits: dict, command: str, plan: Plan) -> str:
    bw, flops = limits["bandwidth"], limits["matmul_flops"]
    models = "; ".join(f"{r['name']}: {r['info'].num_params / 1e6:.1f}M params, "
                       f"{r['info'].num_layers} layers, d={r['info'].hidden_size}, vocab "
                       f"{r['info'].vocab_size}" for r in results)
    return "\n\n".join([
        "## Engine: decode and prefill vs Hugging Face generate and the roofline",
        f"Command: `{command}`  \nMachine: {machine_line(limits['machine'])}  \nModels: {models}, "
        f"float32.",
        f"Limits measured in this run: memory bandwidth {bw / 1e9:.1f} GB/s (best of numpy copy "
        f"{limits['numpy_copy'] / 1e9:.1f}, XLA copy {limits['xla_copy'] / 1e9:.1f}; read + "
        f"written bytes), matmul {flops / 1e9:.1f} GFLOP/s (float32 2048^3 jnp.dot).",
        "### Decode (every slot active, pipelined loop; roofline = weights + KV in use / bandwidth)",
        markdown_table(DECODE_HEAD, [r for res in results for r in decode_rows(res, bw)]),
        f"HF generate: PyTorch CPU, greedy with KV cache, {plan.hf_new_tokens} new tokens after a "
        f"{PROMPT_LEN}-token prompt, minus a 1-token run. Engine: best of {plan.decode_rounds} "
        f"rounds of {plan.decode_steps} steps, {PROMPT_LEN}-token prompts. Sampling ms: the "
        f"engine's jitted sampler alone on greedy [batch, vocab] logits (it sorts the whole "
        f"vocabulary for top-k/top-p even when every slot is greedy).",
        "### Prefill (one prompt; roofline = matmul FLOPs / peak)",
        markdown_table(PREFILL_HEAD, [r for res in results for r in prefill_rows(res, flops)]),
        "### Pipelined decode step: host gap per step",
        "Device ms/step: steps dispatched back to back, one sync at the end. Serial: copy the "
        "step's tokens to the host and book-keep before dispatching the next. Pipelined: dispatch "
        "step n+1 first. Host gap = wall - device; idle = gap / wall. (On a CPU the host and the "
        "\"device\" share cores, so the gap is an estimate.)",
        markdown_table(PIPE_HEAD, [r for res in results for r in pipeline_rows(res)]),
        "Targets (reported, not asserted): decode b8 >= 2x HF generate; decode step within 3x of "
        "the memory roofline at b32 for small-100m; prefill within 3x of the matmul roofline at "
        "2048 tokens.",
    ])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="Engine decode/prefill vs HF generate and the roofline.")
    p.add_argument("--quick", action="store_true", help="fewer steps and rounds, HF at batch 8 only, no 2048-token prefill of small-100m")
    p.add_argument("--models", default="builtin,small-100m", help="comma-separated models")
    p.add_argument("--no-write", action="store_true", help="print only; leave RESULTS.md and summary.json")
    args = p.parse_args(argv)
    plan = QUICK if args.quick else FULL
    command = "python bench/engine.py" + (" --quick" if args.quick else "")
    if args.models != "builtin,small-100m":
        command += f" --models {args.models}"
    limits = measure_bandwidth()
    limits.update(bandwidth=max(limits["numpy_copy"], limits["xla_copy"]),
                  matmul_flops=measure_matmul(), machine=machine_info())
    print(f"bandwidth {limits['bandwidth'] / 1e9:.1f} GB/s, matmul "
          f"{limits['matmul_flops'] / 1e9:.1f} GFLOP/s", flush=True)
    results = [bench_model(name, plan) for name in args.models.split(",") if name]
    text = report(results, limits, command, plan)
    print("\n" + text)
    keys = summary_keys(results, limits["bandwidth"], limits["matmul_flops"])
    print("\nsummary:", keys)
    if not args.no_write:
        write_section(SECTION, text)
        merge_summary(keys)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
