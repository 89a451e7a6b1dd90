"""The service images (docker/*.Dockerfile) agree with the chart: the chart's non-root user,
the `tandem` entry point, jax[tpu] only in the TPU worker and no JAX at all in the gateway.
No Docker engine is needed: the files are read, and the gateway's requirements filter is run.
"""
from __future__ import annotations

import contextlib
import io
import re

import yaml

from tests.unit.test_chart import CHART, ROOT

# Images
# ------------------------------------------------------------------------------------------------

DOCKER = ROOT / "docker"


def test_dockerfiles_run_as_the_charts_user_and_start_tandem():
    uid = yaml.safe_load((CHART / "values.yaml").read_text())["podSecurityContext"]["runAsUser"]
    for name in ("gateway", "worker-cpu", "worker-tpu"):
        text = (DOCKER / f"{name}.Dockerfile").read_text()
        assert re.search(rf"^USER {uid}:{uid}$", text, re.M), name
        assert 'ENTRYPOINT ["tandem"]' in text, name
        assert (DOCKER / f"{name}.Dockerfile.dockerignore").exists()
    assert '"jax[tpu]"' in (DOCKER / "worker-tpu.Dockerfile").read_text()
    cpu = (DOCKER / "worker-cpu.Dockerfile").read_text()
    assert "RUN pip install . &&" in cpu and "jax[tpu]" not in cpu and "libtpu" not in cpu


def test_gateway_image_requirements_exclude_jax(tmp_path, monkeypatch):
    """Run the gateway Dockerfile's requirements filter on the real pyproject.toml."""
    text = (DOCKER / "gateway.Dockerfile").read_text()
    script = text.split("<<'PY'\n", 1)[1].split("\nPY\n", 1)[0]
    monkeypatch.chdir(ROOT)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(script, "gateway.Dockerfile", "exec"), {})
    reqs = out.getvalue().split()
    names = {re.split(r"[\[<>=!~;]", r, 1)[0].lower() for r in reqs}
    assert "jax" not in names and "jaxlib" not in names
    assert {"redis", "grpcio", "fastapi", "pydantic-settings", "tokenizers"} <= names
    assert "kubernetes" in names, "the planner (tandem planner, run from the gateway image) needs the kubernetes client"
