"""PNG plots of bench/serve.py's runs (matplotlib, the `bench` extra; skipped with a note if absent).

  * serve_latency_cdf.png: CDFs of TTFT, inter-token latency and end-to-end latency per system, at
    the steady rate every system ran (the middle of the sweep);
  * serve_rates.png: SLO attainment (goodput marked) and p99 inter-token latency against the
    request rate, one line per system;
  * interleave_itl.png: every short request's inter-token gaps over time in the burst run,
    disaggregated above colocated, with the long-prompt bursts shaded.
Small on purpose (they are committed under bench/plots/). Reads the raw per-request JSON files.
"""
from __future__ import annotations

import json
from pathlib import Path

from bench.common import pyplot

DPI = 72
COLORS = {"disagg": "tab:blue", "colocated": "tab:orange", "vllm": "tab:green", "bare": "tab:gray"}




def _raw(raw_dir: Path, name: str) -> dict | None:
    f = raw_dir / f"{name}.json"
    return json.loads(f.read_text()) if f.exists() else None


def _cdf(ax, values, label, color) -> None:
    v = sorted(values)
    if v:
        ax.plot(v, [(i + 1) / len(v) for i in range(len(v))], label=label, color=color)


def latency_cdf(plt, doc: dict, raw_dir: Path, out: Path) -> Path | None:
    rates = doc["plan"]["rates"]
    rate = str(rates[len(rates) // 2])
    fig, axes = plt.subplots(1, 3, figsize=(10, 3))
    drawn = False
    for name in doc["plan"]["systems"]:
        raw = _raw(raw_dir, name)
        runs = (raw or {}).get("steady", {})
        key = rate if rate in runs else next((k for k in runs if float(k) == float(rate)), None)
        if key is None:
            continue
        ok = [r for r in runs[key]["results"] if r["error"] is None and r["tokens_out"] > 0]
        c = COLORS.get(name)
        _cdf(axes[0], [r["ttft_s"] * 1e3 for r in ok], name, c)
        _cdf(axes[1], [g * 1e3 for r in ok for g in r["itl_s"]], name, c)
        _cdf(axes[2], [r["e2e_s"] * 1e3 for r in ok], name, c)
        drawn = True
    if not drawn:
        plt.close(fig)
        return None
    for ax, t in zip(axes, ("TTFT", "inter-token latency", "end-to-end latency")):
        ax.set_xscale("log")
        ax.set_xlabel(f"{t} (ms)")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("fraction of requests / gaps")
    axes[0].legend(fontsize=8)
    fig.suptitle(f"Latency CDFs, Poisson {float(rate):g} req/s, chat-like lengths", fontsize=10)
    return _save(plt, fig, out / "serve_latency_cdf.png")


def rates_plot(plt, doc: dict, out: Path) -> Path | None:
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 3))
    drawn = False
    for name, s in doc["systems"].items():
        steady = s.get("steady")
        if not steady:
            continue
        rs = sorted(steady, key=float)
        c = COLORS.get(name)
        a1.plot([float(r) for r in rs], [steady[r]["slo_attainment"] for r in rs], "o-", label=name, color=c)
        a2.plot([float(r) for r in rs], [steady[r]["itl_s"]["p99"] * 1e3 for r in rs], "o-", label=name, color=c)
        g = s.get("goodput_rps")
        if g:
            a1.axvline(g, color=c, ls=":", lw=1)
        drawn = True
    if not drawn:
        plt.close(fig)
        return None
    a1.axhline(0.9, color="k", lw=0.8, ls="--")
    a1.set(xlabel="request rate (req/s)", ylabel="SLO attainment", title="goodput (dotted: where 90% meet SLOs)")
    a2.set(xlabel="request rate (req/s)", ylabel="p99 ITL (ms)", title="p99 inter-token latency")
    for ax in (a1, a2):
        ax.grid(alpha=0.3)
        ax.title.set_fontsize(10)
    a1.legend(fontsize=8)
    return _save(plt, fig, out / "serve_rates.png")


def interleave_plot(raw_dir: Path, out: Path, prefix: str = "") -> Path | None:
    plt = pyplot()
    if plt is None:
        return None
    fig, axes = plt.subplots(2, 1, figsize=(10, 4), sharex=True, sharey=True)
    drawn = False
    for ax, name in zip(axes, ("disagg", "colocated")):
        raw = _raw(raw_dir, prefix + name)
        burst = (raw or {}).get("burst")
        if not burst:
            continue
        res = burst["results"]
        for r in res:
            if r["kind"] == "long" and r["error"] is None and r["tokens_out"]:
                ax.axvspan(r["sent_s"], r["sent_s"] + r["e2e_s"], color="tab:red", alpha=0.05, lw=0)
        pts = [(t, g * 1e3) for r in res if r["kind"] == "short" for g, t in zip(r["itl_s"], r["token_s"][1:])]
        ax.scatter([p[0] for p in pts], [p[1] for p in pts], s=2, color=COLORS[name])
        ax.set_yscale("log")
        ax.set_ylabel(f"{name}\nITL (ms)")
        ax.grid(alpha=0.3)
        drawn = True
    if not drawn:
        plt.close(fig)
        return None
    axes[1].set_xlabel("time since start of run (s); red: long prompts in flight")
    fig.suptitle("Short requests' inter-token gaps under long-prompt bursts", fontsize=10)
    return _save(plt, fig, out / "interleave_itl.png")


def _save(plt, fig, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    return path


def draw(doc: dict, raw_dir: Path, out: Path) -> list[str]:
    """Every plot that has data; returns their paths."""
    plt = pyplot()
    if plt is None:
        return []
    got = [latency_cdf(plt, doc, raw_dir, out), rates_plot(plt, doc, out), interleave_plot(raw_dir, out)]
    return [str(p) for p in got if p]
