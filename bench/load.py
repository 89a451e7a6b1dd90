"""How fast does a checkpoint load, and how much memory does the load take, against reading the
same files (issue 41)?

A Llama checkpoint of a few hundred MB in bfloat16, written by transformers in several safetensors
shards (made once, kept under --dir), is loaded by `load_engine(DIR, dtype="bfloat16", tp=N)` in
a fresh child process per measurement, with the page cache dropped first (root only: `sync;
echo 3 > /proc/sys/vm/drop_caches`; without root the section says the reads were warm). Per tp:
- load: seconds from the call to an engine whose weights are on the devices;
- raw read: seconds to read the same files start to end (16 MiB reads), page cache dropped first;
- peak RSS growth: the process's peak resident set (VmHWM, reset before the load through
  /proc/self/clear_refs) minus its resident set before the load, against the checkpoint's bytes.
On CPU devices the weights themselves live in host memory, so 1.0x is the floor of the RSS ratio.

`--old-root DIR` loads with the checkout at DIR too (its `tandem_engine` on the child's path), in
alternation with this tree, so old and new code are compared back to back on the same files.
Targets (issue 41): load <= 1.5x the cold raw read, peak RSS growth <= 1.2x the checkpoint.

    python bench/load.py [--quick] [--tp 1,2] [--rounds 3] [--old-root DIR] [--no-write]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.common import machine_line, markdown_table, merge_summary, write_section

# ~309M parameters: what the issue measured (618 MB of bfloat16 in four shards)
FULL = dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=16, num_attention_heads=16,
            num_key_value_heads=8, vocab_size=32000, shard="180MB")
QUICK = dict(hidden_size=512, intermediate_size=2048, num_hidden_layers=8, num_attention_heads=8,
             num_key_value_heads=4, vocab_size=32000, shard="40MB")


def make_checkpoint(path: Path, spec: dict) -> Path:
    if (path / "config.json").is_file():
        return path
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=spec["hidden_size"], intermediate_size=spec["intermediate_size"],
                      num_hidden_layers=spec["num_hidden_layers"], num_attention_heads=spec["num_attention_heads"],
                      num_key_value_heads=spec["num_key_value_heads"], vocab_size=spec["vocab_size"],
                      max_position_embeddings=2048, tie_word_embeddings=False, torch_dtype="bfloat16")
    model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(path, max_shard_size=spec["shard"], safe_serialization=True)
    return path


def files_of(path: Path) -> list[Path]:
    return sorted(path.glob("*.safetensors"))


def drop_caches() -> bool:
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as fh:
            fh.write("3\n")
        return True
    except OSError:
        return False


def raw_read(path: Path) -> float:
    buf = bytearray(16 << 20)
    view = memoryview(buf)
    t0 = time.perf_counter()
    for f in files_of(path):
        with open(f, "rb", buffering=0) as fh:
            while fh.readinto(view):
                pass
    return time.perf_counter() - t0


CHILD = r"""
import json, os, sys, time
sys.path.insert(0, sys.argv[1])
def rss_kb(field):
    for line in open("/proc/self/status"):
        if line.startswith(field):
            return int(line.split()[1])
import jax, numpy as np
jax.devices()
from tandem_engine import load_engine
before = rss_kb("VmRSS:")
with open("/proc/self/clear_refs", "w") as fh:
    fh.write("5")
t0 = time.perf_counter()
e = load_engine(sys.argv[2], dtype="bfloat16", tp=int(sys.argv[3]), slots=1, max_len=256, prefill_buckets=(16,))
jax.block_until_ready(e.params)
dt = time.perf_counter() - t0
print(json.dumps({"load_s": dt, "rss_growth": (rss_kb("VmHWM:") - before) * 1024}))
"""


def load_once(root: Path, ckpt: Path, tp: int) -> dict:
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": f"--xla_force_host_platform_device_count={max(tp, 1)}"}
    env.pop("PYTHONPATH", None)
    out = subprocess.run([sys.executable, "-c", CHILD, str(root), str(ckpt), str(tp)], env=env, cwd=str(root),
                         capture_output=True, text=True, timeout=900)
    if out.returncode:
        raise RuntimeError(f"load with {root} at tp={tp} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="a smaller checkpoint (~80 MB), one round")
    p.add_argument("--dir", default="/tmp/tandem-bench-load", help="where the checkpoints are made and kept")
    p.add_argument("--tp", default="1,2")
    p.add_argument("--rounds", type=int, default=0, help="measurements per system and tp (default 3; quick 1)")
    p.add_argument("--old-root", default="", help="a checkout of older code, loaded in alternation with this tree")
    p.add_argument("--no-write", action="store_true")
    args = p.parse_args(argv)
    spec = QUICK if args.quick else FULL
    rounds = args.rounds or (1 if args.quick else 3)
    ckpt = make_checkpoint(Path(args.dir) / ("quick" if args.quick else "full"), spec)
    nbytes = sum(f.stat().st_size for f in files_of(ckpt))
    tps = [int(t) for t in args.tp.split(",") if t]
    systems = [("new", ROOT)] + ([("old", Path(args.old_root).resolve())] if args.old_root else [])
    cold = drop_caches()
    results: dict = {}
    for _ in range(rounds):
        for tp in tps:
            for name, root in systems:
                drop_caches()
                results.setdefault(("raw", tp), []).append({"load_s": raw_read(ckpt), "rss_growth": 0})
                drop_caches()
                results.setdefault((name, tp), []).append(load_once(root, ckpt, tp))
    rows, summary = [], {}
    for tp in tps:
        raw = [r["load_s"] for r in results[("raw", tp)]]
        for name, _ in systems:
            got = results[(name, tp)]
            loads = [r["load_s"] for r in got]
            rss = [r["rss_growth"] for r in got]
            rows.append([name, tp, f"{min(loads):.2f}–{max(loads):.2f}", f"{min(raw):.2f}–{max(raw):.2f}",
                         f"{statistics.median(loads) / statistics.median(raw):.2f}x",
                         f"{max(rss) / 1e9:.2f} GB", f"{max(rss) / nbytes:.2f}x"])
            summary[f"load_{name}_tp{tp}_over_read"] = statistics.median(loads) / statistics.median(raw)
            summary[f"load_{name}_tp{tp}_rss_over_ckpt"] = max(rss) / nbytes
    table = markdown_table(["loader", "tp", "load s (min–max)", "raw read s", "load / read (medians)",
                            "peak RSS growth", "RSS / checkpoint"], rows)
    n_params = (spec["vocab_size"] * spec["hidden_size"] * 2 + spec["num_hidden_layers"] * (
        2 * spec["hidden_size"] ** 2 + 2 * spec["hidden_size"] * spec["hidden_size"] * spec["num_key_value_heads"]
        // spec["num_attention_heads"] + 3 * spec["hidden_size"] * spec["intermediate_size"]))
    head = (f"`python bench/load.py{' --quick' if args.quick else ''}{' --old-root ' + args.old_root if args.old_root else ''}`"
            f" — {machine_line()}; Llama, {n_params / 1e6:.0f}M parameters, bfloat16, {len(files_of(ckpt))} "
            f"safetensors files, {nbytes / 1e6:.0f} MB; {rounds} round(s), systems alternated; page cache "
            f"{'dropped before every read and load' if cold else 'NOT dropped (not root): warm reads'}; "
            f"JAX CPU devices (`--xla_force_host_platform_device_count`).")
    body = head + "\n\n" + table + "\n"
    print(body)
    if not args.no_write:
        write_section("load", body)
        merge_summary(summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
