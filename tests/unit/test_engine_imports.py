"""The engine imports no I/O: loading `tandem_engine` (and building a model description) pulls in
no Redis client, gRPC or HTTP framework (README: the engine knows nothing of Redis or gRPC)."""
from __future__ import annotations

import subprocess
import sys


def test_importing_the_engine_loads_no_io_library():
    code = ("import sys, tandem_engine, tandem_engine.arch, tandem_engine.weights; "
            "print(','.join(m for m in ('redis', 'grpc', 'fastapi', 'uvicorn', 'httpx') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == ""
