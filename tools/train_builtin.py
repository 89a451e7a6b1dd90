"""Train Tandem's built-in demo model: a few-million-parameter Llama on the Python standard library.

Why: `make serve` should print text a person can recognise, and every machine that runs Python
already holds the training text (the standard library's own source files). This script trains a
byte-level BPE tokenizer and a small Llama on a deterministic subset of those files, using the
engine's own forward function (`tandem_engine.reference_forward`) so the trained weights mean the
same thing to the engine that serves them, and writes a Hugging Face Llama directory that
`transformers`, vLLM and Tandem all load.

    python tools/train_builtin.py --minutes 18 --out tandem_core/assets/tandem-tiny-py

The corpus depends on the Python version that runs the script (its stdlib), so a rerun on another
version trains on slightly different text; with the same version and seed the data order and
initial weights are the same (CPU float timing noise aside). It knows nothing about serving.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from functools import partial
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout

from tandem_core.models import ModelInfo
from tandem_engine import (
    config_from_info, reference_forward, reference_greedy, save_hf_checkpoint,
)

BOS, EOS = "<s>", "</s>"
SKIP_DIRS = {"test", "tests", "site-packages", "dist-packages", "idlelib", "lib2to3", "turtledemo",
             "ensurepip", "__pycache__", "config-3", "tkinter", "pydoc_data", "encodings"}


# ---------------------------------------------------------------------------------------------
# data


def stdlib_files(max_bytes: int) -> list[Path]:
    """A deterministic subset of the stdlib's .py files: sorted paths, test suites skipped,
    files of 2 KB..200 KB, until `max_bytes` of source is collected."""
    root = Path(os.path.dirname(os.__file__))
    picked, total = [], 0
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in SKIP_DIRS and not d.startswith("config-"))
        for name in sorted(filenames):
            path = Path(dirpath) / name
            if not name.endswith(".py") or not 2_000 <= path.stat().st_size <= 200_000:
                continue
            picked.append(path)
            total += path.stat().st_size
            if total >= max_bytes:
                return picked
    return picked


def read_texts(files: list[Path]) -> list[str]:
    texts = []
    for f in files:
        try:
            texts.append(f.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, OSError):
            continue
    return texts


def train_tokenizer(texts: list[str], vocab_size: int):
    """Byte-level BPE (any text round-trips); ids 0 and 1 are BOS and EOS; a post-processor adds
    BOS when a caller asks for special tokens (transformers, vLLM)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=[BOS, EOS], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(texts, trainer=trainer)
    bos_id = tok.token_to_id(BOS)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)],
    )
    return tok


def encode_corpus(tok, texts: list[str], val_every: int) -> tuple[np.ndarray, np.ndarray]:
    """One token stream per split: BOS file EOS BOS file EOS ... (every `val_every`-th file is
    held out for validation)."""
    bos, eos = tok.token_to_id(BOS), tok.token_to_id(EOS)
    train, val = [], []
    encoded = tok.encode_batch(texts, add_special_tokens=False)
    for i, enc in enumerate(encoded):
        held_out = i % val_every == val_every - 1 or (len(encoded) < val_every and i == len(encoded) - 1)
        (val if held_out else train).extend([bos, *enc.ids, eos])
    return np.asarray(train, np.int32), np.asarray(val, np.int32)


def batch_at(stream: np.ndarray, rng: np.random.Generator, batch: int, seq: int) -> np.ndarray:
    """[batch, seq + 1] random windows of the stream (inputs and shifted targets)."""
    starts = rng.integers(0, len(stream) - seq - 1, size=batch)
    return np.stack([stream[s : s + seq + 1] for s in starts])


# ---------------------------------------------------------------------------------------------
# model and optimiser


def model_info(args, vocab_size: int, bos: int, eos: int) -> ModelInfo:
    return ModelInfo(
        name=args.name, vocab_size=vocab_size, hidden_size=args.hidden,
        intermediate_size=args.intermediate, num_layers=args.layers, num_heads=args.heads,
        num_kv_heads=args.kv_heads, head_dim=args.hidden // args.heads,
        max_position_embeddings=args.max_positions, rope_theta=10000.0, rms_norm_eps=1e-5,
        bos_token_id=bos, eos_token_ids=(eos,), seed=args.seed, tokenizer="hf",
    )


def init_weights(info: ModelInfo, seed: int) -> dict:
    """GPT-2-style init: N(0, 0.02) embeddings, N(0, 1/fan_in) matrices with the residual
    outputs (wo, w_down) scaled by 1/sqrt(2 * layers), unit norms."""
    d, f, hd, L = info.hidden_size, info.intermediate_size, info.head_dim, info.num_layers
    shapes = {
        "wq": (d, info.num_heads * hd), "wk": (d, info.num_kv_heads * hd),
        "wv": (d, info.num_kv_heads * hd), "wo": (info.num_heads * hd, d),
        "w_gate": (d, f), "w_up": (d, f), "w_down": (f, d),
    }
    keys = jax.random.split(jax.random.key(seed), len(shapes) + 2)
    layers = {"attn_norm": jnp.ones((L, d)), "mlp_norm": jnp.ones((L, d))}
    for key, (name, shape) in zip(keys, sorted(shapes.items())):
        scale = 1.0 / math.sqrt(shape[0])
        if name in ("wo", "w_down"):
            scale /= math.sqrt(2 * L)
        layers[name] = jax.random.normal(key, (L, *shape), jnp.float32) * scale
    v = info.vocab_size
    return {
        "embed": jax.random.normal(keys[-2], (v, d), jnp.float32) * 0.02,
        "layers": layers,
        "norm": jnp.ones((d,)),
        "lm_head": jax.random.normal(keys[-1], (d, v), jnp.float32) / math.sqrt(d),
    }


def lr_at(step: int, frac: float, peak: float, warmup: int, floor: float = 0.1) -> float:
    """Linear warmup over `warmup` steps to `peak`, then cosine decay to `floor * peak` as the
    run's progress `frac` (steps done / steps, or elapsed / budget) goes from 0 to 1."""
    if step < warmup:
        return peak * (step + 1) / warmup
    frac = min(1.0, max(0.0, frac))
    return peak * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * frac)))


def make_step(cfg, weight_decay: float, b1=0.9, b2=0.95, eps=1e-8, clip=1.0, teacher=None):
    """A jitted AdamW step (decoupled weight decay on matrices only, global-norm clipping). With
    `teacher` (params, cfg): the loss is the cross-entropy against the teacher's next-token
    distribution (distillation) rather than against the text's next token."""

    def loss_fn(params, batch):
        logits = jax.vmap(lambda t: reference_forward(params, t, cfg))(batch[:, :-1])
        logp = jax.nn.log_softmax(logits, axis=-1)
        if teacher is not None:
            t_params, t_cfg = teacher
            t_logits = jax.vmap(lambda t: reference_forward(t_params, t, t_cfg))(batch[:, :-1])
            target = jax.lax.stop_gradient(jax.nn.softmax(t_logits, axis=-1))
            return -(target * logp).sum(-1).mean()
        nll = -jnp.take_along_axis(logp, batch[:, 1:, None], axis=-1)[..., 0]
        return nll.mean()

    @jax.jit
    def evaluate(params, batch):
        return loss_fn(params, batch)

    @partial(jax.jit, donate_argnums=(0, 1, 2))  # params and Adam moments update in place
    def step(params, m, v, batch, lr, t):
        loss, grads = jax.value_and_grad(loss_fn)(params, batch)
        gnorm = jnp.sqrt(sum(jnp.sum(g * g) for g in jax.tree.leaves(grads)))
        grads = jax.tree.map(lambda g: g * jnp.minimum(1.0, clip / (gnorm + 1e-6)), grads)
        m = jax.tree.map(lambda m_, g: b1 * m_ + (1 - b1) * g, m, grads)
        v = jax.tree.map(lambda v_, g: b2 * v_ + (1 - b2) * g * g, v, grads)
        c1, c2 = 1 - b1 ** t, 1 - b2 ** t

        def update(p, m_, v_):
            decay = weight_decay * p if p.ndim >= 2 else 0.0
            return p - lr * ((m_ / c1) / (jnp.sqrt(v_ / c2) + eps) + decay)

        params = jax.tree.map(update, params, m, v)
        return params, m, v, loss, gnorm

    return step, evaluate


# ---------------------------------------------------------------------------------------------
# the run


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--out", default=str(ROOT / "tandem_core" / "assets" / "tandem-tiny-py"),
                   help="output Hugging Face directory")
    p.add_argument("--minutes", type=float, default=18.0,
                   help="training wall-time budget; the LR schedule follows elapsed time (the "
                        "machine may be shared), so use --steps for a step-exact rerun")
    p.add_argument("--steps", type=int, default=0, help="exact number of steps (overrides --minutes)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--corpus-mb", type=float, default=8.0, help="stdlib source to read, in MB")
    p.add_argument("--vocab", type=int, default=2048)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--intermediate", type=int, default=688)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--max-positions", type=int, default=1024)
    p.add_argument("--seq", type=int, default=256, help="training sequence length")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup", type=int, default=30)
    p.add_argument("--weight-decay", type=float, default=0.05)
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--name", default="tandem-tiny-py", help="the model's name")
    p.add_argument("--tokenizer", default="", metavar="DIR",
                   help="use DIR's tokenizer.json instead of training one (a draft model for DIR's model)")
    p.add_argument("--init", default="", metavar="DIR", help="start from DIR's weights (the same shapes)")
    p.add_argument("--teacher", default="", metavar="DIR",
                   help="distil: train on DIR's model's next-token distribution (soft targets) instead of the "
                        "text's next token, so a small draft model agrees with it (speculative decoding)")
    return p.parse_args(argv)


def prepare(args):
    t0 = time.perf_counter()
    files = stdlib_files(int(args.corpus_mb * 1e6))
    texts = read_texts(files)
    if args.tokenizer:  # a draft model: the served model's own tokenizer, ids for ids
        from tokenizers import Tokenizer
        tok = Tokenizer.from_file(str(Path(args.tokenizer) / "tokenizer.json"))
    else:
        tok = train_tokenizer(texts, args.vocab)
    train, val = encode_corpus(tok, texts, val_every=25)
    nbytes = sum(len(t.encode()) for t in texts)
    print(f"corpus: {len(texts)} files, {nbytes / 1e6:.1f} MB from {files[0].parent} "
          f"-> {len(train):,} train / {len(val):,} val tokens "
          f"({nbytes / (len(train) + len(val)):.2f} bytes/token), "
          f"vocab {tok.get_vocab_size()}, {time.perf_counter() - t0:.0f}s", flush=True)
    return tok, train, val


class Budget:
    """Progress of a run bounded by --steps (exact) or --minutes (wall time)."""

    def __init__(self, steps: int, minutes: float) -> None:
        self.steps, self.seconds, self.start = steps, minutes * 60, time.perf_counter()

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def frac(self, step: int) -> float:
        return step / self.steps if self.steps else self.elapsed() / self.seconds

    def done(self, step: int) -> bool:
        return step >= self.steps if self.steps else self.elapsed() >= self.seconds


def log_progress(i: int, budget: Budget, loss: float, gnorm: float, lr: float, tokens: int) -> None:
    elapsed = budget.elapsed()
    frac = max(budget.frac(i), 1e-9)
    eta = elapsed / frac - elapsed
    print(f"step {i:5d} loss {loss:.3f} gnorm {gnorm:.2f} lr {lr:.2e} "
          f"{tokens * i / elapsed:,.0f} tok/s elapsed {elapsed / 60:.1f}m eta {eta / 60:.1f}m "
          f"({100 * min(frac, 1):.0f}%)", flush=True)


def train(args, info: ModelInfo, train_ids: np.ndarray, val_ids: np.ndarray) -> tuple[dict, dict]:
    cfg = config_from_info(info)
    rng = np.random.default_rng(args.seed)
    if args.init:  # go on from a checkpoint of this shape (e.g. the draft, on longer windows)
        from tandem_core.models import resolve_model
        from tandem_engine.weights import load_params
        params = jax.tree.map(jnp.asarray, load_params(resolve_model(args.init), "float32"))
    else:
        params = init_weights(info, args.seed)
    m = jax.tree.map(jnp.zeros_like, params)
    v = jax.tree.map(jnp.zeros_like, params)
    teacher = None
    if args.teacher:
        from tandem_core.models import resolve_model
        from tandem_engine.weights import load_params
        t_info = resolve_model(args.teacher)
        teacher = (load_params(t_info, "float32"), config_from_info(t_info))
    step_fn, evaluate = make_step(cfg, args.weight_decay, teacher=teacher)
    val_batch = batch_at(val_ids, np.random.default_rng(args.seed + 1), 32, args.seq)
    tokens_per_step, losses, i = args.batch * args.seq, [], 0
    budget = Budget(args.steps, args.minutes)
    while not budget.done(i):
        lr = lr_at(i, budget.frac(i), args.lr, args.warmup)
        batch = batch_at(train_ids, rng, args.batch, args.seq)
        params, m, v, loss, gnorm = step_fn(params, m, v, batch, np.float32(lr), np.float32(i + 1))
        losses.append(float(loss))
        i += 1
        if i % args.log_every == 0:
            avg = sum(losses[-args.log_every:]) / args.log_every
            log_progress(i, budget, avg, float(gnorm), lr, tokens_per_step)
    wall = budget.elapsed()
    val_loss = float(evaluate(params, val_batch))
    final = sum(losses[-20:]) / len(losses[-20:])
    stats = {"steps": i, "train_loss_last20": round(final, 4), "val_loss": round(val_loss, 4),
             "first_loss": round(losses[0], 4), "wall_s": round(wall, 1),
             "tokens_seen": i * tokens_per_step}
    return params, stats


def write_tokenizer_files(tok, out: Path, max_len: int) -> None:
    bos, eos = tok.token_to_id(BOS), tok.token_to_id(EOS)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": BOS, "eos_token": EOS,
        "model_max_length": max_len, "clean_up_tokenization_spaces": False,
        "add_bos_token": True, "add_eos_token": False,
    }, indent=2))
    (out / "special_tokens_map.json").write_text(json.dumps({"bos_token": BOS, "eos_token": EOS}, indent=2))
    (out / "generation_config.json").write_text(json.dumps({
        "bos_token_id": bos, "eos_token_id": eos, "do_sample": False, "max_new_tokens": 128,
    }, indent=2))


def sample_text(params: dict, info: ModelInfo, tok, prompt: str, n: int = 60) -> str:
    ids = [info.bos_token_id, *tok.encode(prompt, add_special_tokens=False).ids]
    out = reference_greedy(params, config_from_info(info), ids, n, pad_to=128)
    return prompt + tok.decode(out)


def main(argv=None) -> int:
    args = parse_args(argv)
    out = Path(args.out)
    tok, train_ids, val_ids = prepare(args)
    info = model_info(args, tok.get_vocab_size(), tok.token_to_id(BOS), tok.token_to_id(EOS))
    print(f"model: {info.num_params:,} params ({info.num_layers} layers, d={info.hidden_size}, "
          f"heads {info.num_heads}/{info.num_kv_heads}, ffn {info.intermediate_size})", flush=True)
    params, stats = train(args, info, train_ids, val_ids)
    save_hf_checkpoint(params, info, out)
    write_tokenizer_files(tok, out, info.max_position_embeddings)
    stats.update(params=info.num_params, command=" ".join(["python", "tools/train_builtin.py", *sys.argv[1:]]),
                 python=sys.version.split()[0], seed=args.seed)
    (out / "training.json").write_text(json.dumps(stats, indent=2))
    size = sum(f.stat().st_size for f in out.iterdir())
    print(f"done: {json.dumps(stats)}\nwrote {out} ({size / 1e6:.1f} MB)", flush=True)
    for prompt in ("def ", "import ", "class "):
        print(f"--- sample {prompt!r}:\n{sample_text(params, info, tok, prompt)}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
