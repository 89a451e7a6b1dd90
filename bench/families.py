"""Per-family decode benchmark: every served family at one bench size, decode tokens/s at batch 8
and 32 and the step against its memory roofline; each mixture of experts beside a dense model of
the same active parameters (`python bench/families.py [--quick] [--families a,b]`).

Checkpoints are written by transformers' own classes (tests/families.py shapes scaled up: d=512,
8 layers, vocab 32000, random weights), loaded through the engine as a user's checkpoint is. The
step runs as the decode pod runs it (every slot active, steps dispatched back to back, tokens
copied each step). Roofline: (weights a step reads + KV in use) / the copy bandwidth measured in
the same run. For a mixture of experts "weights a step reads" counts the experts the batch can
reach: min(E, batch * k) experts a layer. Timings are reported, never asserted.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.common import machine_line, markdown_table, write_section
from bench.engine import measure_bandwidth

SECTION = "families"
BATCHES = (8, 32)
PROMPT = 64
SIZE = dict(vocab_size=32000, hidden_size=512, num_hidden_layers=8, num_attention_heads=8,
            num_key_value_heads=4, head_dim=64, max_position_embeddings=1024)
# per family: intermediate size (per expert for a mixture) and experts (E, k)
FFN = {"llama": 1536, "qwen2": 1536, "qwen3": 1536, "mistral": 1536, "gemma2": 1536, "gemma3": 1536,
       "mixtral": 768, "qwen3_moe": 384, "gpt_oss": 384}
EXPERTS = {"mixtral": (8, 2), "qwen3_moe": (16, 4), "gpt_oss": (16, 4)}


def build(family: str, path: Path) -> None:
    """A bench-size checkpoint of `family` (float32, random)."""
    import torch
    import transformers

    from tests.families import WINDOW, _configs

    cfg_cls, model_cls, extra = _configs(transformers)[family]
    extra = {k: v for k, v in extra.items() if k not in ("intermediate_size", "moe_intermediate_size")}
    kw = {**extra, **SIZE, "intermediate_size": FFN[family]}
    if family in EXPERTS:
        e, k = EXPERTS[family]
        kw.update(num_experts_per_tok=k, **({"num_experts": e, "moe_intermediate_size": FFN[family]}
                                            if family == "qwen3_moe" else {"num_local_experts": e}))
    if "layer_types" in kw:  # keep the family's pattern over 8 layers
        pattern = kw["layer_types"]
        kw["layer_types"] = [pattern[i % len(pattern)] for i in range(SIZE["num_hidden_layers"])]
    if kw.get("sliding_window") == WINDOW:
        kw["sliding_window"] = 128  # a window a bench context crosses
    torch.manual_seed(0)
    model = model_cls(cfg_cls(**kw))
    model.save_pretrained(path, safe_serialization=True)


def step_bytes(engine, batch: int, context: int) -> int:
    """Bytes one decode step must read: weights (the experts a batch can reach) and KV in use."""
    import jax

    cfg, p = engine.cfg, engine.params
    total = 0
    for name, w in jax.tree_util.tree_flatten_with_path(p)[0]:
        key = "/".join(str(getattr(k, "key", k)) for k in name)
        n = w.size * w.dtype.itemsize
        if key == "embed" and "lm_head" in p:
            n = batch * w.shape[1] * w.dtype.itemsize  # one row per slot
        elif key.startswith("layers/we_") or key.startswith("layers/be_"):
            n = n * min(cfg.num_experts, batch * cfg.experts_per_tok) // cfg.num_experts
        total += n
    windows = [cfg.window(i) or context for i in range(cfg.num_layers)]
    kv_row = 2 * cfg.num_kv_heads * cfg.head_dim * 4
    return total + batch * kv_row * sum(min(w, context) for w in windows)


def active_params(engine) -> int:
    cfg, p = engine.cfg, engine.params
    n = 0
    for key, w in p["layers"].items():
        n += w.size // (cfg.num_experts // cfg.experts_per_tok) if key.startswith(("we_", "be_")) else w.size
    return n


def bench_family(path: str, batch: int, steps: int) -> dict:
    import jax

    from tandem_core.types import SamplingParams
    from tandem_engine import load_engine

    engine = load_engine(path, slots=batch, max_len=512, prefill_buckets=(PROMPT,), cpu_threads=0)
    rng = np.random.default_rng(0)
    prefix = engine.prefill(rng.integers(3, 30000, PROMPT).tolist(), SamplingParams())
    state = engine.init_state()
    for slot in range(batch):
        state = engine.insert(prefix, state, slot, SamplingParams())
    for _ in range(3):  # compile and warm
        state, toks = engine.generate(state)
        np.asarray(toks)
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(steps):
            state, toks = engine.generate(state)
            np.asarray(toks)
        best = min(best, (time.perf_counter() - t0) / steps)
    jax.block_until_ready(state)
    context = PROMPT + 3 + 3 * steps
    kv = sum(x.size * x.dtype.itemsize for x in (*state.k, *state.v))  # the pool as allocated
    return {"step_s": best, "tok_s": batch / best, "bytes": step_bytes(engine, batch, context), "kv": kv,
            "active": active_params(engine), "experts": engine.cfg.num_experts}


def dense_twin(family: str) -> str | None:
    """A Llama of the same active parameters as a mixture: FFN = k * the expert's size."""
    if family not in EXPERTS:
        return None
    return f"dense-{EXPERTS[family][1] * FFN[family]}"


def main(argv=None) -> int:
    from tests.families import FAMILIES

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="fewer steps")
    p.add_argument("--families", default=",".join(FAMILIES))
    p.add_argument("--no-write", action="store_true")
    a = p.parse_args(argv)
    fams = [f for f in a.families.split(",") if f]
    steps = 5 if a.quick else 20
    bw = measure_bandwidth()["xla_copy"] / 2  # bytes read per second (copy counts read + write)
    rows, results = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        twins = {}
        for fam in fams:
            build(fam, Path(tmp) / fam)
            twin = dense_twin(fam)
            if twin and twin not in twins:
                FFN[twin] = int(twin.split("-")[1])
                build_dense(Path(tmp) / twin, FFN[twin])
                twins[twin] = True
        for name in fams + list(twins):
            for b in BATCHES:
                r = bench_family(str(Path(tmp) / name), b, steps)
                results[(name, b)] = r
                roof = r["bytes"] / bw
                rows.append([name, b, r["active"] / 1e6, r["step_s"] * 1e3, r["tok_s"], roof * 1e3,
                             r["step_s"] / roof, r["kv"] / 2**20, dense_twin(name) or ""])
                print(rows[-1], flush=True)
    body = "\n".join([
        "## Model families: decode per family against the roofline, each MoE beside its dense twin",
        "",
        f"Command: `python bench/families.py{' --quick' if a.quick else ''}`. Machine: {machine_line()}.",
        f"Read bandwidth (XLA copy / 2): {bw / 1e9:.1f} GB/s. float32, cpu_threads one per core, prompt {PROMPT}.",
        "",
        markdown_table(["model", "batch", "active params (M, layers)", "step ms", "decode tok/s",
                        "roofline ms", "x roofline", "KV pool MiB (max_len 512)", "dense twin"], rows),
        "",
        "A mixture's dense twin is a Llama whose MLP has k x the expert's hidden units (same active "
        "parameters per token). KV pool: the decode state's K and V buffers as allocated, every row able to "
        "reach max_len 512; windowed layers beside global ones (gemma2, gemma3, gpt-oss; window 128) keep "
        "only their window's blocks (tandem_engine/paged.py WindowGroup).",
    ])
    print(body)
    if not a.no_write:
        write_section(SECTION, body)
    return 0


def build_dense(path: Path, ffn: int) -> None:
    import torch
    import transformers

    torch.manual_seed(0)
    transformers.LlamaForCausalLM(transformers.LlamaConfig(**SIZE, intermediate_size=ffn)).save_pretrained(
        path, safe_serialization=True)


if __name__ == "__main__":
    sys.exit(main())
