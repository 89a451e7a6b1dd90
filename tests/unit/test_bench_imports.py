"""bench/ is one harness (common.py, loadgen.py, systems.py and the *_report.py modules) under the
benchmark scripts: no two bench modules import each other, directly or round a loop, and every
`from bench.X import name` names something X defines. Read from the source (ast), imports inside
functions included, so nothing heavy is imported to check it."""
from __future__ import annotations

import ast
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench"


def _modules() -> dict[str, ast.Module]:
    return {f.stem: ast.parse(f.read_text(), str(f)) for f in sorted(BENCH.glob("*.py")) if f.stem != "__init__"}


def _bench_imports(tree: ast.Module) -> list[tuple[str, list[str], int]]:
    """(bench module, names imported from it, line) for every import of a bench module in `tree`."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(a.name.split(".")[1], [], node.lineno) for a in node.names
                    if a.name.startswith("bench.") and a.name.count(".") == 1]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module == "bench":
                out += [(a.name, [], node.lineno) for a in node.names]
            elif node.module.startswith("bench.") and node.module.count(".") == 1:
                out.append((node.module.split(".")[1], [a.name for a in node.names], node.lineno))
    return out


def _graph(mods: dict[str, ast.Module]) -> dict[str, set[str]]:
    return {name: {m for m, _, _ in _bench_imports(tree)} - {name} for name, tree in mods.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def _defined(tree: ast.Module) -> set[str]:
    names: set[str] = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            for t in node.targets if isinstance(node, ast.Assign) else [node.target]:
                names |= {n.id for n in ast.walk(t) if isinstance(n, ast.Name)}
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
    return names


def test_no_import_cycles_between_bench_modules():
    cycles = _cycles(_graph(_modules()))
    assert not cycles, (
        f"bench modules import each other round a loop: {cycles}. Move what both need into the shared "
        "harness (bench/common.py, loadgen.py, systems.py or a *_report.py module) and import it from there.")


def test_every_name_imported_from_a_bench_module_exists():
    mods = _modules()
    missing = []
    for name, tree in mods.items():
        for mod, names, line in _bench_imports(tree):
            if mod not in mods:
                missing.append(f"bench/{name}.py:{line} imports bench.{mod}, which does not exist")
                continue
            missing += [f"bench/{name}.py:{line} imports {n} from bench/{mod}.py, which does not define it"
                        for n in set(names) - _defined(mods[mod]) - {"*"}]
    assert not missing, "\n".join(missing)


def test_the_cycle_check_finds_a_loop():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_every_benchmark_of_make_bench_takes_its_flags():
    """`make bench QUICK=1` passes --quick to every script of run_all.BENCHMARKS, with the flags
    its entry names: each must declare them (argparse), or the run fails there (paged_step.py did,
    2026-12-07). Read from the source: every `add_argument("--x", ...)` string literal."""
    tree = _modules()["run_all"]
    entries = next(ast.literal_eval(n.value) for n in ast.walk(tree) if isinstance(n, ast.Assign)
                   and any(isinstance(t, ast.Name) and t.id == "BENCHMARKS" for t in n.targets))
    missing = []
    for entry in entries:
        script, *flags = entry.split()
        declared = {a.value for n in ast.walk(ast.parse((BENCH / script).read_text()))
                    if isinstance(n, ast.Call) and getattr(n.func, "attr", "") == "add_argument"
                    for a in n.args if isinstance(a, ast.Constant) and isinstance(a.value, str)}
        missing += [f"{script} {flag}" for flag in ["--quick", *flags] if flag not in declared]
    assert not missing, f"benchmarks run by make bench without the flag: {missing}"
