"""The `token_plane` section of bench/RESULTS.md, drawn from bench/out/token_plane.json (every part
that was recorded there). Pure: a dict in, markdown out."""
from __future__ import annotations

from bench import token_plane_stats as st
from bench.common import fmt, machine_line, markdown_table


def _ms(x) -> str:
    return fmt(x, 3)


def report(doc: dict) -> str:
    parts = doc.get("parts", {})
    out = ["## Token plane (issue 15): decode pods' token writes -> one Redis -> gateways' token readers", ""]
    for name in ("plane", "streams", "keys", "e2e", "burst"):
        p = parts.get(name)
        if p:
            code = f", code {p['code']}" if p.get("code") else ""
            out.append(f"- `{name}`: `{p.get('command', '')}`{code} — {machine_line(p['machine'])}")
    out.append("")
    if "plane" in parts:
        res = parts["plane"]["result"]
        for series in (res["series"] if "series" in res else [res]):
            out += plane_md(series)
    if "streams" in parts:
        out += streams_md(parts["streams"])
    if "keys" in parts:
        out += keys_md(parts["keys"])
    if "e2e" in parts:
        out += e2e_md(parts["e2e"])
    if "burst" in parts:
        out += burst_md(parts["burst"], doc.get("gateway_defaults"))
    out += reading_md(parts)
    return "\n".join(out).rstrip() + "\n"


def reading_md(parts: dict) -> list[str]:
    """What ran out first and what would cut Redis's work per token, from the recorded numbers."""
    plane = parts.get("plane")
    if not plane:
        return []
    res = plane["result"]
    series = res["series"] if "series" in res else [res]
    rows = series[0]["rows"]
    if not rows:
        return []
    best = max(rows, key=lambda r: r["delivered_per_s"])
    low = rows[0]
    calls = low["redis"]["calls_per_token_by_command"]
    out = ["### Reading", "",
           f"- First bottleneck here: the machine's 2 cores, shared by every role (and other work). Per token at "
           f"{best['delivered_per_s']:,.0f} tok/s the gateways spent {best['gateway_cpu_us_per_token']:.0f} us, the "
           f"publishers {best['publisher_cpu_us_per_token']:.0f} us and Redis {best['redis']['cpu_us_per_token']:.0f} "
           f"us of CPU. Gateways and decode pods scale out; one Redis does not: it is the first shared limit, at "
           f"about {1e6 / best['redis']['cpu_us_per_token']:,.0f} tok/s per Redis process (one core) for this "
           f"plane, less when each XREAD returns few tokens ({low['redis']['cpu_us_per_token']:.0f} us per token at "
           f"{low['delivered_per_s']:,.0f} tok/s), and XREAD is the largest part of its time."]
    fit = None
    if "streams" in parts:
        fit = st.per_key_fit(parts["streams"]["result"]["runs"], "xread_redis_usec")
        gfit = st.per_key_fit(parts["streams"]["result"]["runs"], "gateway_cpu_s")
        if fit and gfit:
            out.append(f"- An XREAD names every stream the reader holds: {fit['per_key']:.1f} us of Redis time and "
                       f"{gfit['per_key'] * 1e6:.1f} us of gateway CPU per key named (fitted over the streams runs), "
                       f"whether or not the stream has news; 10,000 streams make every read cost that 10,000 times, "
                       f"and while Redis runs one it serves no one else.")
    wake = series[0].get("xread_wakeup")
    cfg = series[0]["config"]
    share = cfg["batch"] / cfg["gateways"]  # tokens of one pod step each gateway reads
    if wake:
        out.append(f"- A blocked XREAD over many streams is answered with the stream that woke it only (Redis "
                   f"{wake['redis_version']}: one script XADDing to {wake['streams']} streams woke an XREAD over all "
                   f"of them with {wake['in_reply']} in its reply), so each wake-up costs a second XREAD naming "
                   f"every stream: {calls.get('xread', 0):.4f} XREADs per token at {low['delivered_per_s']:,.0f} "
                   f"tok/s is {calls.get('xread', 0) * share:.1f} reads per pod step per gateway (each reads "
                   f"{share:g} tokens of a step).")
    out += [
        f"- Per token the fenced script runs HEXISTS ({calls.get('hexists', 0):.2f}), XADD ({calls.get('xadd', 0):.2f}) "
        f"and EXPIRE ({calls.get('expire', 0):.2f}; past 1: the token reader's wake pokes, an XADD and an EXPIRE "
        f"each); the EVALSHA itself is 1 per pod step "
        f"({calls.get('evalsha', 0):.4f}), one per key shard present in the step with more shards.",
        "- What would cut Redis's work per token, largest first: (1) read only streams with news: the decode "
        "pod's script adds the request ids it wrote to one notification stream per gateway and shard (one XADD "
        "per step), the gateway blocks on that and reads just those streams, or at least reads subscriptions "
        "without an entry for a while on a slower cadence; (2) EXPIRE only with a stream's first write and its "
        "finish (the TTL already outlives request_timeout_s): one command per token fewer; (3) one ownership check "
        "per request and script call is what HEXISTS is today, so the next step is a per-pod fence epoch checked "
        "once per call; (4) key shards = the masters' count (3 spread the keys as evenly as 16 here) since each "
        "shard is one more script call per pod step and one more reader per gateway; (5) cache the admission "
        "backlog read (5 XLENs per request end to end) and replace the 50 ms cancel MGET by a cancel stream.",
        ""]
    return out


def plane_md(res: dict) -> list[str]:
    plan, cfg = res["plan"], res["config"]
    rows = res["rows"]
    out = [
        f"### The token plane alone, rising load, one Redis ({cfg['shards']} key shard{'s' if cfg['shards'] > 1 else ''})",
        "",
        f"{plan['publishers']} publisher processes (a decode pod each: {cfg['batch']} slots, requests of "
        f"{cfg['tokens']} tokens, the pod's real entries through `OwnedPublisher.add_batch`, one pipeline per "
        f"step, cancel MGET every {cfg['cancel_poll_s'] * 1000:g} ms), {plan['gateways']} gateway processes (one "
        f"`TokenMux` each, a relay task per request, the next request of each slot subscribed ahead), key shards "
        f"{cfg['shards']}. Latency: the publisher's send (before its pipeline) to the relay task's `get` "
        f"returning, per token. Per-token costs divide by tokens written in the window.",
        "",
    ]
    head = ["steps/s", "asked tok/s", "written tok/s", "delivered tok/s", "p50 ms", "p99 ms", "Redis cmds/tok",
            "Redis B in/tok", "B out/tok", "Redis CPU us/tok", "Redis CPU", "gateway CPU us/tok", "gateways CPU",
            "publisher CPU us/tok", "publishers CPU", "load avg"]
    table = [[r["steps_per_s"], r["target_per_s"], r["written_per_s"], r["delivered_per_s"], _ms(r["latency_ms"]["p50"]),
              _ms(r["latency_ms"]["p99"]), r["redis"]["calls_per_token"], r["redis"]["bytes_in_per_token"],
              r["redis"]["bytes_out_per_token"], r["redis"]["cpu_us_per_token"], f"{r['redis']['cpu_util']:.0%}",
              r["gateway_cpu_us_per_token"], f"{r['gateway_cpu_util']:.0%}", r["publisher_cpu_us_per_token"],
              f"{r['publisher_cpu_util']:.0%}", r.get("load_avg_1m")] for r in rows]
    out += [markdown_table(head, table), ""]
    out.append(f"Stopped: {res['saturated'] or 'the last step (not saturated)'}. Streams checked: "
               f"{res['streams_ok']:,} of {res['streams']:,} exactly once and in order ({res['tokens']:,} tokens), "
               f"{res['errors']} bad{': ' + '; '.join(res['error_examples'][:3]) if res['errors'] else ''}; "
               f"fenced-off writes {res['fenced']}.")
    out.append("")
    if rows:
        pick = _pick_rows(rows)
        cmds = sorted({c for r in pick for c in r["redis"]["calls_per_token_by_command"]})
        head = ["command"] + [f"calls/tok @ {r['delivered_per_s']:,.0f} tok/s" for r in pick] + \
               [f"Redis us/tok @ {r['delivered_per_s']:,.0f}" for r in pick]
        table = [[c] + [r["redis"]["calls_per_token_by_command"].get(c, 0.0) for r in pick]
                 + [r["redis"]["usec_per_token_by_command"].get(c, 0.0) for r in pick] for c in cmds]
        out += ["Redis commands per token by command (INFO commandstats; commands a script calls count besides "
                "the EVALSHA; `us/tok` is Redis's own time in the command, a script's time includes its "
                "commands' time):", "", markdown_table(head, table), ""]
    for name, prof in ((rows[-1].get("profile") or {}).items() if rows else ()):
        if prof and prof.get("samples"):
            out.append(profile_line(f"{name} at the last step", prof))
            out.append("")
    out += cores_md(res.get("cores"))
    out += plane_reading(rows, res.get("nproc") or 2)
    best = max(rows, key=lambda r: r["delivered_per_s"]) if rows else None
    if best:
        cpu = best["redis"]["cpu_us_per_token"]
        out.append(f"At the highest delivered rate ({best['delivered_per_s']:,.0f} tok/s) Redis used "
                   f"{best['redis']['cpu_util']:.0%} of a core at {cpu:.1f} us CPU per token: one Redis core would "
                   f"carry about {1e6 / cpu:,.0f} tok/s of this plane if nothing else ran on it; the gateways "
                   f"spent {best['gateway_cpu_us_per_token']:.0f} us and the publishers "
                   f"{best['publisher_cpu_us_per_token']:.0f} us of CPU per token.")
        out.append("")
    return out


def plane_reading(rows: list[dict], nproc: int) -> list[str]:
    """What ran out, and where Redis's time went, from the rows themselves."""
    if not rows:
        return []
    last, first = rows[-1], rows[0]
    busy = {k: last["cpu_s"].get(k, 0.0) / last["seconds"] for k in ("redis", "gateway", "publisher")}
    total = sum(busy.values())
    out = [f"At the last step these processes kept {total:.2f} of the {nproc} cores busy (Redis {busy['redis']:.2f}, "
           f"gateways {busy['gateway']:.2f}, publishers {busy['publisher']:.2f}; load average "
           f"{last.get('load_avg_1m', 0):.1f} with other work on the machine)."]
    for r in (first, last):
        usec = r["redis"]["usec_per_token_by_command"]
        # a script's time includes the commands it calls: count EVALSHA's and XREAD's against the rest
        whole = usec.get("evalsha", 0.0) + sum(v for c, v in usec.items()
                                              if c not in ("evalsha", "hexists", "xadd", "expire", "hdel"))
        xr = usec.get("xread", 0.0)
        calls = r["redis"]["calls_per_token_by_command"].get("xread", 0.0)
        out.append(f"At {r['delivered_per_s']:,.0f} tok/s XREAD took {xr:.1f} of Redis's {whole:.1f} us of command time "
                   f"per token ({xr / max(whole, 1e-9):.0%}): {calls:.4f} XREADs per token, {1 / max(calls, 1e-9):.0f} "
                   f"tokens each, {xr / max(calls, 1e-9):,.0f} us each; the fenced script "
                   f"{usec.get('evalsha', 0.0):.1f} us per token.")
    out.append("")
    return out


def profile_line(what: str, prof: dict) -> str:
    return (f"py-spy of {what}, {prof['samples']} samples; most self time: "
            + ", ".join(f"{f} {v:.0%}" for f, v in prof["self"][:6]) + "; most total time: "
            + ", ".join(f"{f} {v:.0%}" for f, v in prof["total"][:8]) + ".")


def _pick_rows(rows: list[dict]) -> list[dict]:
    if len(rows) <= 3:
        return rows
    return [rows[0], rows[len(rows) // 2], rows[-1]]


def cores_md(cores: dict | None) -> list[str]:
    if not cores:
        return []
    items = []
    for name, aff in cores["affinity"].items():
        samples = cores["last_cpu_samples"].get(name, {})
        total = sum(samples.values()) or 1
        seen = ", ".join(f"cpu{c} {n / total:.0%}" for c, n in samples.items())
        items.append(f"{name} allowed {aff}, ran on {seen}")
    return ["Cores (this machine has 2; every process shares them unless pinned; sampled every 0.2 s): "
            + "; ".join(items) + ".", ""]


def streams_md(p: dict) -> list[str]:
    runs = p["result"]["runs"]
    out = ["### 10,000 streams on one gateway (one TokenMux, redis max_connections 64)", ""]
    head = ["streams written + idle", "exactly once, in order", "tokens", "deliver s", "delivered tok/s", "p50 ms",
            "p99 ms", "peak gw conns (CLIENT LIST / TCP)", "XREADs", "keys/XREAD", "tokens/XREAD", "Redis us/XREAD",
            "XREAD bytes sent", "gateway CPU ms/XREAD", "gateway CPU us/tok", "Redis CPU us/tok", "Redis cmds/tok"]
    table = []
    for r in runs:
        peak = r["peak_gateway_connections"]
        table.append([f"{r['streams']:,} + {r.get('idle_streams', 0):,}", f"{r['streams_ok']:,} ({r['errors']} bad)",
                      r["tokens"], r["deliver_s"], r["delivered_per_s"], _ms(r["latency_ms"]["p50"]),
                      _ms(r["latency_ms"]["p99"]), f"{peak['client_list']} / {peak['tcp']}", r["xread_calls"],
                      r.get("keys_per_read"), r["tokens_per_read"], r["xread_usec_per_call"],
                      r.get("xread_bytes_per_call"), r["gateway_cpu_ms_per_read"], r["gateway_cpu_us_per_token"],
                      r["redis"]["cpu_us_per_token"], r["redis"]["calls_per_token"]])
    out += [markdown_table(head, table), ""]
    r0 = runs[0]
    cfg = r0["config"]
    out.append(f"Publishers: {cfg['publishers']} processes x {cfg['pods']} pods x {cfg['batch']} slots, one request "
               f"of 8..16 tokens per slot, {r0['plan']['steps_per_s']:g} steps/s per pod; every stream subscribed "
               f"before the first write ({r0['subscribe_s']:.1f} s to subscribe {r0['streams']:,}).")
    gw_fit = st.per_key_fit(runs, "gateway_cpu_s")
    redis_fit = st.per_key_fit(runs, "xread_redis_usec")
    if gw_fit and redis_fit:
        out.append(f"Fitted over these runs (cost = per key named by an XREAD x keys named + per token x tokens): "
                   f"gateway CPU {gw_fit['per_key'] * 1e6:.2f} us per key + {gw_fit['per_token'] * 1e6:.1f} us per "
                   f"token; Redis time in XREAD {redis_fit['per_key']:.2f} us per key + {redis_fit['per_token']:.2f} "
                   f"us per token. Keys named per XREAD: "
                   + ", ".join(f"{r['keys_per_read']:,.0f} ({r['streams']:,} streams)" for r in runs) + ".")
    idle = [r for r in runs if r.get("idle_streams")]
    same = [r for r in runs if not r.get("idle_streams") and idle and r["streams"] == idle[0]["streams"]]
    if idle and same:
        a, b = same[0], idle[0]
        out.append(f"Idle subscriptions: {b['streams']:,} written streams with {b['idle_streams']:,} more subscribed "
                   f"that nobody writes vs without them: Redis time per XREAD {a['xread_usec_per_call']:,.0f} -> "
                   f"{b['xread_usec_per_call']:,.0f} us, gateway CPU per token {a['gateway_cpu_us_per_token']:.0f} -> "
                   f"{b['gateway_cpu_us_per_token']:.0f} us, Redis CPU per token {a['redis']['cpu_us_per_token']:.1f} "
                   f"-> {b['redis']['cpu_us_per_token']:.1f} us, p50 latency {a['latency_ms']['p50']:.0f} -> "
                   f"{b['latency_ms']['p50']:.0f} ms.")
    for r in runs:
        prof = r.get("profile")
        if prof and prof.get("samples"):
            out.append(profile_line(f"the gateway ({r['streams']:,} + {r.get('idle_streams', 0):,} streams)", prof))
    out += cores_md(r0.get("cores"))
    return out


def keys_md(p: dict) -> list[str]:
    res = p["result"]
    out = ["### Where the plane's keys land on 3 masters", "",
           f"The plane run's keys as tandem_core.keys names them under each shard count (`redis.shards`; the "
           f"run itself used the count in its row above), placed by {res['source']}; ops = HEXISTS per token on "
           f"the running hash, XADD + EXPIRE per token on the stream, HSET + HDEL per request. DBSIZE: each "
           f"node's keys after writing every key once through redis-py's cluster client.", ""]
    head = ["shards", "master", "keys", "slots used", "ops", "share of ops", "DBSIZE"]
    table = []
    for shards, doc in res["by_shards"].items():
        dbs = doc.get("dbsize") or {}
        for n, d in doc["nodes"].items():
            table.append([shards, n, d["keys"], d["slots_used"], d["ops"], f"{d['ops_share']:.1%}", dbs.get(n, "-")])
        for node in sorted({x[2] for x in res["ranges"]} - set(doc["nodes"])):
            table.append([shards, node, 0, 0, 0, "0%", dbs.get(node, "-")])
        if dbs.get("error"):
            out.append(f"DBSIZE check ({shards} shards) failed: {dbs['error']}")
    out += [markdown_table(head, table), ""]
    return out


def e2e_md(p: dict) -> list[str]:
    res = p["result"]
    if res.get("status") != "ok":
        return ["### Redis commands per output token on the real path", "", f"Not run: {res.get('reason')}", ""]
    out = ["### Redis commands per output token on the real path (`tandem local`)", "",
           f"{res['requests']} streamed completions of {res['output_len']} tokens (prompt {res['prompt_len']} "
           f"tokens, concurrency {res['concurrency']}), `tandem local` {res['tandem_args']}; {res['tokens']:,} "
           f"tokens streamed, {res['errors']} errors, {res['seconds']:.1f} s. INFO of its embedded Redis before "
           f"and after; `idle` is the same span of time with no requests (heartbeats, claim waits, load "
           f"reports), scaled to the run's duration, and `net` = run - idle.", ""]
    head = ["command", "calls/token (run)", "idle calls/token", "net calls/token", "Redis us/token (run)"]
    table = [[c, v["run"], v["idle"], v["net"], v["usec"]] for c, v in res["by_command"].items()]
    table.append(["**total**", res["total"]["run"], res["total"]["idle"], res["total"]["net"], res["total"]["usec"]])
    out += [markdown_table(head, table), ""]
    out.append(f"Bytes per token: in {res['bytes_in_per_token']:.0f} (net {res['net_bytes_in_per_token']:.0f}), out "
               f"{res['bytes_out_per_token']:.0f} (net {res['net_bytes_out_per_token']:.0f}); Redis CPU "
               f"{res['redis_cpu_us_per_token']:.1f} us per token (net {res['net_redis_cpu_us_per_token']:.1f}).")
    out.append("")
    return out


def _label(r: dict, now: list | None, then: list | None) -> str:
    env = r.get("env") or {}
    pair = [int(env.get("TANDEM_GATEWAY_ADMISSION_MAX_BACKLOG", 0)), int(env.get("TANDEM_GATEWAY_MAX_OPEN_STREAMS", 0))]
    if not all(pair):
        return r["label"]
    tags = [t for t, d in (("defaults now", now), ("defaults when run", then)) if d and list(d) == pair and now != then]
    tags = tags or (["defaults"] if now and list(now) == pair else [])
    return f"backlog {pair[0]}, open streams {pair[1]}" + (f" ({', '.join(tags)})" if tags else "")


def burst_md(p: dict, defaults_now: list | None = None) -> list[str]:
    res = p["result"]
    then = res.get("defaults")
    out = ["### A burst of short streamed requests against `tandem local`: served or refused", "",
           f"`tandem local --prefill 1 --decode 1 --slots {res['runs'][0].get('slots', 16)}`, prompts of "
           f"{res['runs'][0].get('prompt_len', 8)} tokens, {res['runs'][0].get('output_len', 8)} tokens out, every "
           f"request sent at once from one asyncio client (bench/loadgen.py), after a warm-up; the gateway's "
           f"admission_max_backlog and max_open_streams set per run.", ""]
    head = ["settings", "requests", "served", "429", "503", "other errors", "wall s", "TTFT p50 s", "TTFT p99 s",
            "peak Redis clients", "peak gateway RSS MiB", "why refused (first messages)"]
    table = []
    for r in res["runs"]:
        if r.get("status") != "ok":
            table.append([_label(r, defaults_now, then), r.get("requests", "-"), "-", "-", "-", "-", "-", "-", "-", "-", "-",
                          r.get("reason", "")[:200]])
            continue
        table.append([_label(r, defaults_now, then), r["requests"], r["served"], r["status_429"], r["status_503"], r["other_errors"],
                      r["wall_s"], r["ttft_s"]["p50"], r["ttft_s"]["p99"], r.get("peak_redis_clients"),
                      r.get("peak_gateway_rss_mib"), "; ".join(f"{n}x {m}" for m, n in r["reasons"][:2]) or "-"])
    out += [markdown_table(head, table), ""]
    out.append("TTFT is the client's, from sending the request: in a burst it includes the wait for the gateway to "
               "accept and read it, which the gateway's own first-token deadline does not count.")
    for n in sorted({r["requests"] for r in res["runs"] if r.get("status") == "ok"}):
        runs = [r for r in res["runs"] if r.get("status") == "ok" and r["requests"] == n]
        whole = [_label(r, defaults_now, then) for r in runs if r["served"] == n]
        limits = sorted({m.split(":", 1)[1].split(";")[0].strip() for r in runs for m, _ in r["reasons"]})
        out.append(f"- {n:,} at once: " + (f"all served with {' and with '.join(whole)}" if whole else "none served all")
                   + (f"; refusals came from: {' | '.join(limits)}" if limits else "") + ".")
    out.append("")
    return out
