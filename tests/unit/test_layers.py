"""The architecture's arrows point down: this walks every module's imports and checks them."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SERVICES = {"prefill_svc", "decode_svc", "gateway", "planner"}
JAX = {"jax", "jaxlib", "tandem_engine", "flax", "ml_dtypes"}


def _imports(pkg: str) -> dict[str, set[str]]:
    out = {}
    for f in (ROOT / pkg).rglob("*.py"):
        mods = set()
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.Import):
                mods |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                mods.add(node.module.split(".")[0])
        out[str(f.relative_to(ROOT))] = mods
    return out


def test_core_imports_no_jax_and_no_service():
    for f, mods in _imports("tandem_core").items():
        bad = mods & (JAX - {"ml_dtypes"} | SERVICES)  # ml_dtypes: only for bfloat16 KV decoding
        assert not bad, f"{f} imports {bad}"


def test_engine_imports_no_io():
    for f, mods in _imports("tandem_engine").items():
        bad = mods & ({"redis", "grpc", "fastapi", "pydantic_settings", "tandem_proto"} | SERVICES)
        assert not bad, f"{f} imports {bad}"


def test_services_never_import_each_other():
    for svc in SERVICES:
        for f, mods in _imports(svc).items():
            bad = mods & (SERVICES - {svc})
            assert not bad, f"{f} imports {bad}"


def test_gateway_has_no_jax():
    for f, mods in _imports("gateway").items():
        assert not mods & JAX, f"{f} imports {mods & JAX}"


def test_planner_has_no_jax():
    """The planner runs from the gateway's image, which has no JAX."""
    for f, mods in _imports("planner").items():
        assert not mods & JAX, f"{f} imports {mods & JAX}"
