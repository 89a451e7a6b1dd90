"""The committed gRPC stubs are what `make proto` generates from the .proto files now."""
from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_generated_stubs_are_fresh(tmp_path):
    (tmp_path / "tandem_proto").mkdir()
    protos = sorted((ROOT / "tandem_proto").glob("*.proto"))
    for p in protos:
        shutil.copy(p, tmp_path / "tandem_proto" / p.name)
    cmd = [sys.executable, "-m", "grpc_tools.protoc", "-I", ".", "--python_out=.", "--pyi_out=.",
           "--grpc_python_out=.", *[f"tandem_proto/{p.name}" for p in protos]]
    subprocess.run(cmd, cwd=tmp_path, check=True)
    for gen in sorted((tmp_path / "tandem_proto").glob("*_pb2*.py*")):
        committed = ROOT / "tandem_proto" / gen.name
        assert committed.exists(), f"{gen.name} is not committed: run `make proto`"
        assert committed.read_text() == gen.read_text(), f"{gen.name} is stale: run `make proto`"
