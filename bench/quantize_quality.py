"""int8 weights against the unquantized weights in the same dtype: greedy agreement, logit error,
weight bytes (`python bench/quantize_quality.py [--quick] [--models a,b] [--dtypes ...] [--kv] [--write]`);
with --kv, fp8 decode KV against the dtype's KV by the same measures (decode steps teacher-forced).

For each model — the built-in trained checkpoint ("builtin", the headline: its logits mean
something), the random-weight preset "tiny", and a small random checkpoint of every served family
(tests/families.py, written by transformers' own classes) — two engines are loaded in each dtype:
the weights as they are, and the same weights with `quantize="int8"` (tandem_engine/quantize.py).
Over a fixed prompt set (Python snippets through the built-in model's tokenizer; fixed random ids
for the random-weight models):
  - greedy agreement: both engines decode N tokens from each prompt (prefill, then decode steps,
    as the pods run them); the fraction of token positions equal, the prompts whose N tokens are
    all equal, and the first position where a prompt's tokens differ (the earliest over prompts);
  - logit error: the logits at every position of prompt + the unquantized engine's greedy tokens
    (one teacher-forced prefill each, the same tokens for both): the largest |int8 - float|, the
    largest such error over one position's logit range (max - min over the vocabulary), and how
    often the two argmaxes agree;
  - weight bytes: every array of the params pytree, before and after (int8 plus float32 scales;
    the embedding and LM head stay in the dtype: quantize.py says why).
With bfloat16 and float32 both run, a yardstick table puts bfloat16 against float32 (no int8) by
the same measures: the error a dtype choice already accepts.

Random-weight checkpoints have flat logits (near-ties between the top tokens everywhere), so a tiny
logit error flips their argmax and the decode then follows another path: their greedy agreement is
a pessimistic measure; the logit error is the comparable number across models.
Only `--write` writes the "quantize" section of bench/RESULTS.md.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.common import machine_line, markdown_table, write_section

SECTION = "quantize"
TEXTS = [  # the built-in model was trained on the Python standard library
    "import os\nimport sys\n\n\ndef main(argv):\n    ",
    "class Queue:\n    \"\"\"A first-in, first-out queue.\"\"\"\n\n    def __init__(self, maxsize=0):\n        ",
    "def read_lines(path):\n    with open(path) as f:\n        for line in f:\n            ",
    "    def __repr__(self):\n        return ",
    "try:\n    import threading\nexcept ImportError:\n    ",
    "def _check_arg(name, value):\n    if not isinstance(value, int):\n        raise TypeError(",
    "    for i, item in enumerate(items):\n        if item is None:\n            ",
    "\"\"\"Utilities for parsing configuration files.\n\nThis module ",
]
PROMPT_LENGTHS = (7, 12, 19, 26, 33, 40, 47, 54)  # random-id prompts (every family's vocab holds 256)


def prompt_set(model: str, info, count: int) -> list[list[int]]:
    """The fixed prompts for `model`: tokenized snippets for the built-in model, else seeded ids."""
    if model == "builtin":
        from tandem_core.tokenizer import load_tokenizer

        tok = load_tokenizer(info)
        return [tok.encode(t) for t in TEXTS[:count]]
    rng = np.random.default_rng(1234)
    return [rng.integers(3, min(256, info.vocab_size), n).tolist() for n in PROMPT_LENGTHS[:count]]


def greedy(engine, prompts: list[list[int]], n: int) -> list[list[int]]:
    """n greedy tokens for each prompt, all prompts decoded side by side (one slot each)."""
    from tandem_core.types import SamplingParams

    g = SamplingParams()
    state = engine.init_state()
    out = []
    for slot, ids in enumerate(prompts):
        prefix = engine.prefill(ids, g)
        state = engine.insert(prefix, state, slot, g)
        out.append([prefix.first_token])
    for _ in range(n - 1):
        state, _short = engine.reserve(state, 1)  # (paged: the blocks of the next position; slots: nothing)
        state, tokens = engine.generate(state)
        host = np.asarray(tokens)
        for slot in range(len(prompts)):
            out[slot].append(int(host[slot]))
    return out


def all_logits(engine, ids: list[int], pad: int) -> np.ndarray:
    """float32 logits [len(ids), vocab] at every position (one prefill, as the engine runs it)."""
    import jax

    from tandem_engine.model import prefill_logits_all

    fn = _JIT.setdefault("logits", jax.jit(prefill_logits_all, static_argnames=("cfg",)))
    padded = np.zeros(pad, np.int32)
    padded[: len(ids)] = ids
    return np.asarray(fn(engine.params, padded, cfg=engine.cfg))[: len(ids)]


_JIT: dict = {}


def decode_logits(engine, prompt: list[int], cont: list[int]) -> np.ndarray:
    """float32 logits [len(cont) - 1, vocab] of the decode steps fed cont[:-1] after `prompt`
    (teacher-forced, one row, over the engine's paged pool as the pods run it): where a KV element
    type shows, since the prefill's own attention never reads the pool."""
    import jax
    import jax.numpy as jnp

    from tandem_core.types import SamplingParams
    from tandem_engine.paged import decode_forward_paged

    g = SamplingParams()
    state = engine.insert(engine.prefill(prompt, g), engine.init_state(), 0, g)
    state, _short = engine.reserve(state, len(cont) + 1)
    fn = _JIT.setdefault("step", jax.jit(decode_forward_paged, static_argnames=("cfg", "max_len")))
    k, v, table = state.k, state.v, state.block_table[:1]
    out = []
    for j, t in enumerate(cont[:-1]):
        logits, k, v = fn(engine.step_params, jnp.asarray([t], jnp.int32), jnp.asarray([len(prompt) + j], jnp.int32),
                          k, v, table, cfg=engine.cfg, max_len=engine.max_len)
        out.append(np.asarray(logits[0], np.float32))
    return np.stack(out)


def kv_quality(model: str, dtype: str, prompts: list[list[int]], tokens: int, kw: dict) -> dict:
    """fp8 decode KV against the dtype's (both paged): greedy agreement, and the logit error of the
    decode steps teacher-forced on the dtype-KV engine's tokens; plus KV bytes per position."""
    from tandem_engine import load_engine

    # every block kept (no window group): decode_logits feeds the step the block table alone, with
    # every position's block reserved up front (a windowed group holds only a window's worth a row)
    kw = {**kw, "kv_window_group": False}
    base = load_engine(model, dtype=dtype, **kw)
    fp8 = load_engine(model, dtype=dtype, kv_dtype="fp8", **kw)
    a_tok, b_tok = greedy(base, prompts, tokens), greedy(fp8, prompts, tokens)
    a_log = [decode_logits(base, p, t) for p, t in zip(prompts, a_tok)]
    b_log = [decode_logits(fp8, p, t) for p, t in zip(prompts, a_tok)]
    per_pos = [2 * sum(int(x.nbytes) for x in e.init_state().k) // (e.kv_blocks_total + 1) // e.kv_block_size
               for e in (base, fp8)]  # K and V, every layer
    return {**compare(a_tok, b_tok, a_log, b_log), "kv_bytes": per_pos}


def compare(a_tokens, b_tokens, a_logits, b_logits) -> dict:
    """Greedy agreement of two token lists per prompt and the logit error of b against a."""
    n = len(a_tokens[0])
    equal = [sum(x == y for x, y in zip(a, b)) for a, b in zip(a_tokens, b_tokens)]
    first = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None) for a, b in zip(a_tokens, b_tokens)]
    diverged = [f for f in first if f is not None]
    err = rel = 0.0
    top = total = 0
    for la, lb in zip(a_logits, b_logits):
        d = np.abs(lb.astype(np.float64) - la.astype(np.float64)).max(axis=-1)  # [positions]
        span = la.max(axis=-1).astype(np.float64) - la.min(axis=-1)
        err, rel = max(err, float(d.max())), max(rel, float((d / np.maximum(span, 1e-9)).max()))
        top += int((la.argmax(-1) == lb.argmax(-1)).sum())
        total += la.shape[0]
    return {"agree": sum(equal) / (n * len(a_tokens)), "identical": sum(f is None for f in first),
            "prompts": len(first), "first_div": min(diverged) if diverged else None,
            "max_err": err, "rel_err": rel, "top1": top / total}


def run_model(model: str, dtypes: list[str], prompts_n: int, tokens: int, kv: bool = False) -> list[dict]:
    """Per dtype: the float and int8 engines of `model` compared (and, in `float`, each dtype's
    greedy tokens and logits for the yardstick)."""
    from tandem_core.models import resolve_model
    from tandem_engine import load_engine
    from tandem_engine.quantize import weight_bytes

    info = resolve_model(model)
    prompts = prompt_set(model, info, prompts_n)
    longest = max(len(p) for p in prompts) + tokens
    bucket = 1 << (longest - 1).bit_length()
    kw = dict(slots=len(prompts), max_len=bucket, prefill_buckets=(bucket,), steps_per_dispatch=1)
    out = []
    ref = None  # float32's (tokens, sequences, logits): the yardstick's reference
    for dtype in sorted(dtypes, key=lambda d: d != "float32"):
        base = load_engine(model, dtype=dtype, **kw)
        quant = load_engine(model, dtype=dtype, quantize="int8", **kw)
        a_tok, b_tok = greedy(base, prompts, tokens), greedy(quant, prompts, tokens)
        seqs = [p + t for p, t in zip(prompts, a_tok)]  # teacher-forced on the float engine's tokens
        a_log = [all_logits(base, s, bucket) for s in seqs]
        b_log = [all_logits(quant, s, bucket) for s in seqs]
        yard = None
        if ref is not None:  # this dtype's logits on float32's sequences: the same tokens fed to both
            yard = compare(ref[0], a_tok, ref[2], [all_logits(base, s, bucket) for s in ref[1]])
        elif dtype == "float32":
            ref = (a_tok, seqs, a_log)
        layers = sum(int(w.size) * w.dtype.itemsize for w in base.params["layers"].values())
        out.append({"model": model, "dtype": dtype, "bytes": weight_bytes(base.params),
                    "bytes_int8": weight_bytes(quant.params), "layer_share": layers / weight_bytes(base.params),
                    **compare(a_tok, b_tok, a_log, b_log), "yardstick": yard, "tokens": tokens,
                    "kv": kv_quality(model, dtype, prompts, tokens, kw) if kv else None})
        del base, quant
    return out


def build_families(tmp: Path, fams: list[str]) -> dict[str, str]:
    from tests.families import FAMILIES, build_family

    paths = {}
    for fam in fams:
        build_family(fam, tmp / fam, seed=FAMILIES.index(fam))
        paths[fam] = str(tmp / fam)
    return paths


def report(results: list[dict], command: str) -> str:
    rows = []
    for r in results:
        rows.append([r["model"], r["dtype"], f"{r['bytes'] / 1e6:.2f} -> {r['bytes_int8'] / 1e6:.2f}",
                     f"{r['bytes_int8'] / r['bytes']:.2f}", f"{100 * r['layer_share']:.0f}%",
                     f"{100 * r['agree']:.1f}%", f"{r['identical']}/{r['prompts']}",
                     "-" if r["first_div"] is None else r["first_div"], f"{r['max_err']:.3g}",
                     f"{100 * r['rel_err']:.2f}%", f"{100 * r['top1']:.1f}%"])
    lines = [
        "## int8 weights: quality against the unquantized weights in the same dtype",
        "",
        f"Command: `{command}`. Machine: {machine_line()}.",
        f"{results[0]['tokens'] if results else 0} greedy tokens per prompt. builtin: the shipped trained checkpoint "
        "(Python snippets as prompts): the headline. tiny and the families: random weights (flat logits: near-ties "
        "everywhere, so their greedy agreement is pessimistic; compare their logit error).",
        "",
        markdown_table(["model", "dtype", "weights MB (float -> int8)", "ratio", "layer share", "greedy agree",
                        "prompts identical", "first divergence", "max abs dlogit", "max abs dlogit / range",
                        "top-1 agree (forced)"], rows),
        "",
        "ratio: int8 params bytes / unquantized (the embedding and LM head stay in the dtype; layer share: the "
        "bytes the quantized layers held before). first divergence: the earliest token index where any prompt's "
        "int8 tokens differ. top-1 agree (forced): argmax equal at every position of prompt + the float engine's "
        "tokens, both engines fed the same tokens.",
    ]
    yard = []
    for r in results:
        c = r["yardstick"]
        if c is not None:
            yard.append([r["model"], r["dtype"], f"{100 * c['agree']:.1f}%", f"{c['identical']}/{c['prompts']}",
                         "-" if c["first_div"] is None else c["first_div"], f"{c['max_err']:.3g}",
                         f"{100 * c['rel_err']:.2f}%", f"{100 * c['top1']:.1f}%"])
    kv = [[r["model"], r["dtype"], f"{r['kv']['kv_bytes'][0]} -> {r['kv']['kv_bytes'][1]}",
           f"{100 * r['kv']['agree']:.1f}%", f"{r['kv']['identical']}/{r['kv']['prompts']}",
           "-" if r["kv"]["first_div"] is None else r["kv"]["first_div"], f"{r['kv']['max_err']:.3g}",
           f"{100 * r['kv']['rel_err']:.2f}%", f"{100 * r['kv']['top1']:.1f}%"] for r in results if r.get("kv")]
    if kv:
        lines += ["", "fp8 decode KV (`kv_dtype=\"fp8\"`, float8_e4m3fn, paged) against the dtype's KV, weights "
                  "unquantized: greedy agreement of the decode, and the logits of the decode steps teacher-forced "
                  "on the dtype-KV engine's tokens (the prefill's attention never reads the pool):", "",
                  markdown_table(["model", "dtype", "KV bytes/position", "greedy agree", "prompts identical",
                                  "first divergence", "max abs dlogit", "max abs dlogit / range",
                                  "top-1 agree (forced)"], kv)]
    if yard:
        lines += ["", "Yardstick: the dtype against float32, no int8 (the same measures; the logits of both on "
                  "float32's tokens):", "",
                  markdown_table(["model", "dtype", "greedy agree", "prompts identical", "first divergence", "max abs dlogit",
                                  "max abs dlogit / range", "top-1 agree (forced)"], yard)]
    return "\n".join(lines)


def main(argv=None) -> int:
    from tests.families import FAMILIES

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="4 prompts, 16 tokens, bfloat16 only")
    p.add_argument("--models", default=",".join(("builtin", "tiny", *FAMILIES)),
                   help="builtin, tiny (presets) and family names (tests/families.py checkpoints)")
    p.add_argument("--dtypes", default="", help="comma-separated (default bfloat16,float32; --quick bfloat16)")
    p.add_argument("--prompts", type=int, default=0, help="prompts per model (default 8; --quick 4)")
    p.add_argument("--tokens", type=int, default=0, help="greedy tokens per prompt (default 32; --quick 16)")
    p.add_argument("--write", action="store_true", help="write the quantize section of bench/RESULTS.md")
    p.add_argument("--kv", action="store_true", help="also fp8 decode KV against the dtype's (paged layout)")
    a = p.parse_args(argv)
    dtypes = [d for d in (a.dtypes or ("bfloat16" if a.quick else "bfloat16,float32")).split(",") if d]
    prompts_n = a.prompts or (4 if a.quick else 8)
    tokens = a.tokens or (16 if a.quick else 32)
    models = [m for m in a.models.split(",") if m]
    unknown = [m for m in models if m not in ("builtin", "tiny", *FAMILIES)]
    if unknown:
        p.error(f"unknown models {unknown}: use builtin, tiny or one of {list(FAMILIES)}")
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        paths = build_families(Path(tmp), [m for m in models if m in FAMILIES])
        for m in models:
            for r in run_model(paths.get(m, m), dtypes, prompts_n, tokens, a.kv):
                r["model"] = m
                results.append(r)
                print(f"{m} {r['dtype']}: agree {r['agree']:.3f} identical {r['identical']}/{r['prompts']} "
                      f"first_div {r['first_div']} max_err {r['max_err']:.3g} rel {r['rel_err']:.4f} "
                      f"top1 {r['top1']:.3f} bytes {r['bytes']} -> {r['bytes_int8']}", flush=True)
    command = "python bench/quantize_quality.py " + " ".join(argv if argv is not None else sys.argv[1:])
    body = report(results, command.strip())
    print(body)
    if a.write:
        write_section(SECTION, body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
