"""bench/token_plane.py's parts on the real path, against `tandem local` (the built-in model):

* `run_e2e`: Redis commands and bytes per output token. Streamed completions through the gateway
  (bench/loadgen.py's client), INFO of the embedded Redis (its url is in the launcher's log) just
  before and just after; then the same span of time with no requests, whose commands (heartbeats,
  claim waits, load reports, cancel polls of an empty pod) are the background to subtract.
* `run_burst`: thousands of short streamed requests sent at once; what the gateway answered (200,
  429, 503) and the message of each refusal, with the gateway's default settings and with others
  passed as TANDEM_GATEWAY_* environment variables.
"""
from __future__ import annotations

import asyncio
import re
import time
from collections import Counter
from pathlib import Path

from bench import token_plane_stats as st
from bench.loadgen import RequestSpec, percentile, run_load
from bench.systems import TandemLocal, model_id

RAW = Path(__file__).resolve().parent / "out" / "token_plane"


class LoggedTandem(TandemLocal):
    """`tandem local` logging at INFO, so the embedded Redis's url can be read from its log."""

    def __init__(self, *args, extra_args: list[str] | None = None, **kw) -> None:
        super().__init__(*args, **kw)
        self.extra_args = list(extra_args or [])

    def command(self) -> list[str]:
        cmd = super().command()
        cmd[cmd.index("--log-level") + 1] = "INFO"
        return cmd + self.extra_args

    def redis_url(self) -> str:
        m = re.search(r"redis pid=\d+ url=(redis://\S+)", self.log_path.read_text())
        if not m:
            raise RuntimeError(f"no embedded Redis url in {self.log_path}: {self.tail()}")
        return m.group(1)


def _specs(n: int, prompt_len: int, output_len: int, vocab: int, seed: int) -> list[RequestSpec]:
    import numpy as np

    rng = np.random.default_rng(seed)
    return [RequestSpec(0.0, prompt_len, output_len, "short", rng.integers(3, vocab, prompt_len).tolist())
            for _ in range(n)]


def _info(url: str) -> dict:
    import redis

    with redis.Redis.from_url(url) as r:
        return r.info("all")


def run_e2e(requests: int = 64, output_len: int = 32, prompt_len: int = 64, concurrency: int = 16,
            slots: int = 16, progress=print) -> dict:
    from tandem_core.models import resolve_model

    vocab = resolve_model("builtin").vocab_size
    server = LoggedTandem("e2e", "builtin", colocated=False, slots=slots, max_len=512, pin="", env={},
                          log_path=RAW / "e2e.log")
    try:
        server.start()
        url, model = server.redis_url(), model_id(server.base_url)
        # warm-up: compile the prefill bucket and the decode batches
        asyncio.run(run_load(server.base_url, model, _specs(concurrency, prompt_len, output_len, vocab, 1),
                             concurrency=concurrency))
        time.sleep(1.0)
        i0, t0 = _info(url), time.monotonic()
        results, wall = asyncio.run(run_load(server.base_url, model, _specs(requests, prompt_len, output_len, vocab, 2),
                                             concurrency=concurrency))
        i1, t1 = _info(url), time.monotonic()
        progress(f"  e2e: {requests} requests in {wall:.1f} s; idle for as long")
        time.sleep(t1 - t0)
        i2, t2 = _info(url), time.monotonic()
    except Exception as e:  # noqa: BLE001 - the other parts still report
        return {"status": "failed", "reason": f"{type(e).__name__}: {e}"[:500]}
    finally:
        server.stop()
    tokens = sum(r.tokens_out for r in results)
    run = st.redis_cost(i0, i1, t1 - t0, tokens)
    idle = st.redis_cost(i1, i2, t2 - t1, tokens)
    scale = (t1 - t0) / (t2 - t1)
    by_cmd = {}
    for c in sorted(set(run["commands"]) | set(idle["commands"])):
        r_calls = run["commands"].get(c, {}).get("calls", 0) / max(tokens, 1)
        i_calls = idle["commands"].get(c, {}).get("calls", 0) / max(tokens, 1) * scale
        by_cmd[c] = {"run": r_calls, "idle": i_calls, "net": r_calls - i_calls,
                     "usec": run["commands"].get(c, {}).get("usec", 0) / max(tokens, 1)}
    by_cmd = dict(sorted(by_cmd.items(), key=lambda kv: -kv[1]["run"]))
    total = {k: sum(v[k] for v in by_cmd.values()) for k in ("run", "idle", "net", "usec")}
    return {"status": "ok", "requests": requests, "output_len": output_len, "prompt_len": prompt_len,
            "concurrency": concurrency, "tandem_args": f"--prefill 1 --decode 1 --slots {slots}", "tokens": tokens,
            "errors": sum(1 for r in results if r.error), "seconds": t1 - t0, "by_command": by_cmd, "total": total,
            "bytes_in_per_token": run["bytes_in_per_token"], "bytes_out_per_token": run["bytes_out_per_token"],
            "net_bytes_in_per_token": run["bytes_in_per_token"] - idle["bytes_in_per_token"] * scale,
            "net_bytes_out_per_token": run["bytes_out_per_token"] - idle["bytes_out_per_token"] * scale,
            "redis_cpu_us_per_token": run["cpu_us_per_token"],
            "net_redis_cpu_us_per_token": run["cpu_us_per_token"] - idle["cpu_us_per_token"] * scale,
            "redis_cpu_util": run["cpu_util"], "idle_redis_cpu_util": idle["cpu_util"],
            "errors_examples": [r.error for r in results if r.error][:3]}


# ---------------------------------------------------------------------------------------------
# burst


def refusal(error: str | None) -> tuple[str, str]:
    """(kind, message) of one request's outcome: ok, 429, 503, or other (a transport error, a
    timeout, an in-band error)."""
    if error is None:
        return "ok", ""
    m = re.match(r"HTTP (\d+): b?['\"]?(.*)", error)
    if m:
        code, body = m.group(1), m.group(2)
        msg = re.search(r'"message":\s*"([^"]*)', body)
        text = msg.group(1) if msg else body[:160]
        text = re.sub(r"\d+(\.\d+)?", "N", text)  # one line per reason, whatever the numbers
        return (code if code in ("429", "503") else "other"), f"{code}: {text}"
    return "other", re.sub(r"\d+(\.\d+)?", "N", error)[:160]


def run_burst(n: int, label: str, env: dict[str, str], slots: int = 16, prompt_len: int = 8,
              output_len: int = 8, timeout_s: float = 300.0, progress=print) -> dict:
    """Start `tandem local` with `env`, warm it up, then send `n` streamed requests at once."""
    from tandem_core.models import resolve_model

    vocab = resolve_model("builtin").vocab_size
    server = LoggedTandem(f"burst-{label}", "builtin", colocated=False, slots=slots, max_len=512, pin="", env=env,
                          log_path=RAW / f"burst-{n}-{label}.log")
    try:
        server.start()
        model = model_id(server.base_url)
        asyncio.run(run_load(server.base_url, model, _specs(slots, prompt_len, output_len, vocab, 1),
                             concurrency=slots))
        peak = {"connected_clients": 0, "gateway_rss_mib": 0.0}
        url = server.redis_url()
        results, wall = asyncio.run(_burst(server.base_url, model, _specs(n, prompt_len, output_len, vocab, 3),
                                           timeout_s, url, peak, _gateway_pid(server.proc.pid)))
    except Exception as e:  # noqa: BLE001 - the other runs still report
        return {"status": "failed", "label": label, "requests": n, "reason": f"{type(e).__name__}: {e}"[:500]}
    finally:
        server.stop()
    kinds = Counter()
    reasons = Counter()
    for r in results:
        kind, msg = refusal(r.error)
        kinds[kind] += 1
        if msg:
            reasons[msg] += 1
    ttft = [r.ttft_s for r in results if r.ok]
    out = {"status": "ok", "label": label, "env": env, "requests": n, "served": kinds["ok"],
           "status_429": kinds["429"], "status_503": kinds["503"], "other_errors": kinds["other"], "wall_s": wall,
           "ttft_s": {"p50": percentile(ttft, 50), "p99": percentile(ttft, 99)},
           "reasons": reasons.most_common(6), "peak_redis_clients": peak["connected_clients"],
           "peak_gateway_rss_mib": peak["gateway_rss_mib"],
           "slots": slots, "prompt_len": prompt_len, "output_len": output_len}
    progress(f"  burst {n} ({label}): served {out['served']}, 429 {out['status_429']}, 503 {out['status_503']}, "
             f"other {out['other_errors']} in {wall:.1f} s; {reasons.most_common(2)}")
    return out


def _gateway_pid(launcher_pid: int) -> int | None:
    import psutil

    for child in psutil.Process(launcher_pid).children(recursive=True):
        try:
            if "gateway" in child.cmdline():
                return child.pid
        except psutil.Error:
            continue
    return None


async def _burst(base_url: str, model: str, specs: list[RequestSpec], timeout_s: float, redis_url: str,
                 peak: dict, gateway_pid: int | None) -> tuple[list, float]:
    import psutil
    import redis.asyncio as aioredis

    r = aioredis.Redis.from_url(redis_url)
    stop = asyncio.Event()
    gw = psutil.Process(gateway_pid) if gateway_pid else None

    async def watch() -> None:
        while not stop.is_set():
            try:
                peak["connected_clients"] = max(peak["connected_clients"],
                                                int((await r.info("clients"))["connected_clients"]))
                if gw is not None:
                    peak["gateway_rss_mib"] = max(peak["gateway_rss_mib"], gw.memory_info().rss / 2**20)
            except Exception:  # noqa: BLE001 - a sample lost
                pass
            await asyncio.sleep(0.5)

    w = asyncio.create_task(watch())
    try:
        return await run_load(base_url, model, specs, concurrency=0, timeout_s=timeout_s)
    finally:
        stop.set()
        await w
        await r.aclose()
