"""Helpers every benchmark shares: the machine's and the code's description, markdown tables, and the two
outputs (a marked section of `bench/RESULTS.md`, merged keys of `bench/out/summary.json`).

Each benchmark owns one section of RESULTS.md between `<!-- NAME:start -->` and
`<!-- NAME:end -->` and rewrites only that, so benchmarks written by different people can share
the file. Nothing here measures anything.
"""
from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import re
import subprocess
import sys
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
RESULTS_MD = BENCH_DIR / "RESULTS.md"
SUMMARY_JSON = BENCH_DIR / "out" / "summary.json"
RESULTS_HEADER = (
    "# Benchmark results\n\n"
    "Each section is written by one benchmark (`make bench` runs them all through "
    "`bench/run_all.py`). Absolute times on small shared machines are noisy: read the ratios, "
    "which are measured side by side in one run.\n"
)


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def mem_total_gib() -> float:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) / 2**20
    except OSError:
        pass
    return float("nan")


def machine_info() -> dict:
    return {
        "nproc": os.cpu_count(),
        "mem_gib": round(mem_total_gib(), 1),
        "cpu": cpu_model(),
        "date": _dt.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z"),
        "python": sys.version.split()[0],
        "load_avg_1m": round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None,
    }


def machine_line(info: dict | None = None) -> str:
    m = info or machine_info()
    load = f", load average {m['load_avg_1m']} at start" if m.get("load_avg_1m") is not None else ""
    return (f"{m['nproc']} CPUs ({m['cpu']}), {m['mem_gib']} GiB memory, Python {m['python']}, "
            f"{m['date']}{load}")


def code_version() -> str:
    """`git describe`-like: the commit, and whether the working tree had uncommitted changes."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=BENCH_DIR.parent, capture_output=True,
                              text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=BENCH_DIR.parent,
                               capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""
    return f"{head} + uncommitted changes" if dirty else head


def fmt(x, digits: int = 3) -> str:
    """A number for a table: integers with separators, floats to `digits` significant digits."""
    if x is None:
        return "-"
    if isinstance(x, str):
        return x
    if isinstance(x, int):
        return f"{x:,}"
    if x != x:  # NaN
        return "-"
    if abs(x) >= 10 ** digits:
        return f"{x:,.0f}"
    return f"{x:.{digits}g}"


def markdown_table(headers: list[str], rows: list[list]) -> str:
    """A GitHub markdown table; cells go through `fmt`, columns are padded for plain-text reading."""
    cells = [[str(h) for h in headers]] + [[fmt(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = ["| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |" for r in cells]
    lines.insert(1, "| " + " | ".join("-" * w for w in widths) + " |")
    return "\n".join(lines)


def replace_section(text: str, name: str, body: str) -> str:
    """`text` with the section NAME replaced by `body` (appended when it is not there yet)."""
    start, end = f"<!-- {name}:start -->", f"<!-- {name}:end -->"
    block = f"{start}\n{body.rstrip()}\n{end}"
    pattern = re.compile(re.escape(start) + r".*?" + re.escape(end), re.S)
    if pattern.search(text):
        return pattern.sub(lambda _: block, text, count=1)
    return (text.rstrip() + "\n\n" if text.strip() else "") + block + "\n"


def write_section(name: str, body: str, path: Path = RESULTS_MD) -> None:
    text = path.read_text() if path.exists() else RESULTS_HEADER
    path.write_text(replace_section(text, name, body))


def merge_summary(values: dict, path: Path = SUMMARY_JSON) -> dict:
    """Merge `values` into the JSON summary (other benchmarks' keys are kept)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    data = json.loads(path.read_text()) if path.exists() else {}
    data.update(values)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    tmp.replace(path)
    return data


def pyplot():
    """matplotlib.pyplot on the Agg backend, or None (and a line saying so) when it is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is missing (pip install -e '.[bench]'): no plots", flush=True)
        return None
    return plt
