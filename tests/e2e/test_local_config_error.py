"""`tandem local` with a configuration no worker can start with (issue 28): it reports the error
once and exits 78 instead of restarting the workers six times; the embedded Redis's data folder
goes with it. A model directory without weights passes the launcher's own check (config.json is
there), so the workers are the ones that fail; an unknown model family is refused up front."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tandem.redis_proc import free_port
from tandem_core.exits import EXIT_CONFIG
from tandem_core.models import BUILTIN_DIR

pytestmark = pytest.mark.e2e
ROOT = Path(__file__).resolve().parents[2]


def _local(model: Path, tmp_path: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "TMPDIR": str(tmp_path)}  # its Redis data lands here
    return subprocess.run([sys.executable, "-m", "tandem.cli", "local", "--model", str(model), "--port",
                           str(free_port()), "--ready-timeout", "120"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=180)


def test_missing_weights_stop_the_cluster_once_with_the_error(tmp_path):
    model = tmp_path / "no-weights"
    shutil.copytree(BUILTIN_DIR, model, ignore=shutil.ignore_patterns("*.safetensors"))
    done = _local(model, tmp_path)
    out = done.stdout + done.stderr
    assert done.returncode == EXIT_CONFIG, out[-3000:]
    assert "stopped on its configuration (exit code 78), so it is not restarted" in out
    assert "no *.safetensors files" in out
    assert "restarting in" not in out  # not one restart
    for role in ("prefill-0", "decode-0"):
        assert out.count(f"started {role} ") == 1, out[-3000:]
    assert not any((tmp_path / "tandem-redis").iterdir())  # the embedded Redis's data went with it


def test_an_unknown_model_family_is_refused_before_anything_starts(tmp_path):
    model = tmp_path / "mamba"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "mamba", "architectures": ["MambaForCausalLM"]}))
    done = _local(model, tmp_path)
    out = done.stdout + done.stderr
    assert done.returncode == EXIT_CONFIG, out[-3000:]
    assert "'mamba' (MambaForCausalLM) is not a family this engine serves" in out and "started " not in out
    (model / "config.json").write_text(json.dumps({"model_type": "llama"}))  # a config with nothing in it
    done = _local(model, tmp_path)
    out = done.stdout + done.stderr
    assert done.returncode == EXIT_CONFIG and "has no 'num_attention_heads'" in out, out[-3000:]
