"""The interleave section of bench/RESULTS.md: its table, its ratio and its text, from a
bench/serve.py document (`doc["systems"][name]["burst"]`, made by `loadgen.burst_summary`).

Shared by bench/serve.py, which writes the section after its own runs, and bench/interleave.py,
which writes it from serve.py's runs or its own; neither imports the other for it. Nothing here
measures anything.
"""
from __future__ import annotations

import math
from pathlib import Path

from bench.common import fmt, machine_line, markdown_table, write_section
from bench.loadgen import DELAY_FACTOR

SECTION = "interleave"
SYSTEMS = ("disagg", "colocated")


def table(systems: dict) -> str:
    rows = []
    for name in SYSTEMS:
        b = systems.get(name, {}).get("burst")
        if not b:
            rows.append([name, systems.get(name, {}).get("reason", "not run")] + [None] * 8)
            continue
        sh = b["short"]
        rows.append([name, "ok", sh["itl_s"]["p50"] * 1e3, sh["itl_s"]["p99"] * 1e3,
                     b["itl_under_burst_s"]["p99"] * 1e3, b["all"]["output_tokens_per_s"],
                     b["delayed_step_fraction"], sh["ttft_s"]["p99"] * 1e3, b["long"]["ttft_s"]["p50"] * 1e3,
                     b["all"]["errors"]])
    return markdown_table(["system", "status", "ITL p50 ms", "ITL p99 ms", "ITL p99 under burst ms",
                           "out tok/s", "delayed steps", "short TTFT p99 ms", "long TTFT p50 ms", "errors"], rows)


def ratio(systems: dict, key: str = "itl_under_burst_s") -> float | None:
    """p99 ITL disaggregated / colocated: of the gaps under bursts (default), or of all the short
    requests' gaps (key="short")."""
    try:
        if key == "short":
            a, b = (systems[n]["burst"]["short"]["itl_s"]["p99"] for n in SYSTEMS)
        else:
            a, b = (systems[n]["burst"][key]["p99"] for n in SYSTEMS)
    except (KeyError, TypeError):
        return None
    return a / b if b and not math.isnan(a) and not math.isnan(b) else None


def write_from(doc: dict, raw_dir: Path, plots: list[str], how: str = "") -> None:
    """The interleave section of RESULTS.md from a bench/serve.py document."""
    plan, systems = doc["plan"], doc["systems"]
    size, every, plen, olen = plan["burst"]
    r = ratio(systems)
    body = "\n".join([
        "## Interleaving: disaggregated vs colocated under long-prompt bursts", "",
        f"Measured by `python bench/serve.py {' '.join(doc['argv'])}` (its `burst` workload) {how}on "
        f"{machine_line(doc['machine'])}. Model `{plan['model']}`, {plan['slots']} slots. Decode pod on CPU 1 "
        "in both systems; disaggregated: prefill pod on CPU 0 with the gateway, Redis and the client, and "
        "`TANDEM_GATEWAY_DIRECT_PREFILL_MAX_TOKENS=0` (every prompt prefilled on the prefill pod); "
        "colocated: the decode pod prefills between steps.",
        f"Load: Poisson {plan['burst_rate']:g} req/s of chat-like short requests for "
        f"{plan['burst_duration_s']:g} s, plus every {every:g} s a burst of {size} prompts of {plen} tokens "
        f"({olen} output tokens each). ITL columns are the short requests' gaps; \"under burst\" keeps the "
        "gaps that end while a long request is in flight; \"delayed steps\" is the fraction of short "
        f"requests' gaps longer than {DELAY_FACTOR:g}x the median gap of the same system in the same run.", "",
        table(systems), "",
        f"`itl_p99_disagg_over_colocated` (p99 of the gaps under bursts) = {fmt(r)} (target <= 0.5); "
        f"over all the short requests' gaps: {fmt(ratio(systems, 'short'))}. In the disaggregated system every "
        "request's first gap (token 0 from the prefill pod -> token 1 from the decode pod) carries the "
        "hand-off: ready-notice claim, KV pull, insert.", "",
        *(f"![{Path(p).stem}](plots/{Path(p).name})" for p in plots if "interleave" in p),
    ])
    write_section(SECTION, body)
