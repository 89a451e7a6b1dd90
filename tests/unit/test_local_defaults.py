"""`tandem local`'s defaults fit the model (issue 33): the context is the model's own, bounded by
a cap and by memory, and the launcher says which; every flag's default is in --help; the embedded
Redis's data folder goes when it is closed; and a worker that fails on its configuration stops the
launcher once, with its error, instead of being restarted (issue 28). Real child processes."""
from __future__ import annotations

import dataclasses
import os
import sys
import textwrap
import time
from pathlib import Path

import pytest

from gateway.settings import GatewaySettings
from gateway.validation import check_model, served_name
from tandem import local
from tandem.redis_proc import RedisProcess
from tandem.supervisor import Child, ConfigExit, Supervisor
from tandem_core.exits import EXIT_CONFIG
from tandem_core.models import resolve_model

ROOT = Path(__file__).resolve().parents[2]
GiB = 1 << 30


def test_the_builtin_model_gets_its_own_context():
    info = resolve_model("builtin")
    length, why = local.auto_context(info, slots=4, decode_workers=1, memory_bytes=8 * GiB)
    assert length == info.max_position_embeddings == 1024
    assert "own context length" in why


def test_a_long_context_is_bounded_by_the_cap_and_by_memory():
    big = dataclasses.replace(resolve_model("small-100m"), max_position_embeddings=131072)
    length, why = local.auto_context(big, slots=4, decode_workers=1, memory_bytes=64 * GiB)
    assert length == local.AUTO_MAX_LEN and str(local.AUTO_MAX_LEN) in why
    length, why = local.auto_context(big, slots=8, decode_workers=2, memory_bytes=1 * GiB)
    per_position = 2 * big.num_layers * big.num_kv_heads * big.head_dim * local.KV_BYTES
    assert length * per_position * 8 * 2 <= local.KV_MEMORY_FRACTION * GiB < 2 * length * per_position * 8 * 2
    assert "memory" in why


def test_prefill_buckets_reach_the_context():
    assert local.buckets_for(1024) == [16, 32, 64, 128, 256, 512, 1024]
    assert local.buckets_for(512) == [16, 32, 64, 128, 256, 512]
    assert local.buckets_for(3000) == [16, 32, 64, 128, 256, 512, 1024, 2048, 3000]
    assert local.buckets_for(100) == [16, 32, 64, 100]


def test_every_flag_shows_its_default():
    p = local._parser()
    text = " ".join(p.format_help().split())
    flags = [a for a in p._actions if a.dest != "help"]
    assert text.count("(default:") == len(flags)
    for a in flags:  # in order: each flag's help ends with its own default
        assert f"(default: {a.default})" in text, a.dest


def test_the_built_in_model_is_served_as_builtin():
    info = resolve_model("builtin")
    s = GatewaySettings(model="builtin")
    assert served_name(s, info) == "builtin"
    assert check_model(info.name, s, info) == "builtin"  # the checkpoint's own name stays an alias
    assert served_name(GatewaySettings(model="tiny"), resolve_model("tiny")) == "tiny"


def test_closing_the_embedded_redis_removes_its_data():
    r = RedisProcess(appendonly=True).start()
    data = Path(r.dir)
    assert data.parent.name == "tandem-redis" and data.is_dir()
    r.stop()
    r.start()  # a restart keeps the folder (and its data)
    assert data.is_dir()
    r.close()
    assert not data.exists() and r.proc is None


def _module(tmp_path: Path, body: str) -> dict[str, str]:
    (tmp_path / "childmod.py").write_text(textwrap.dedent(body))
    return {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{ROOT}"}


def _tick_until(sup: Supervisor, cond, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "the child did not get there in time"
        sup.tick()
        time.sleep(0.05)


def test_a_worker_that_fails_on_its_configuration_stops_once_with_its_error(tmp_path):
    env = _module(tmp_path, """
        import sys
        from tandem_core.errors import ModelNotFound
        from tandem_core.exits import run_service
        def main():
            raise ModelNotFound("/models/x: no *.safetensors files")
        sys.exit(run_service("tandem decode", main))
        """)
    sup = Supervisor(backoff_s=0.01)
    child = Child("decode-0", "childmod", env)
    sup.add(child)
    with pytest.raises(ConfigExit, match=r"decode-0 .* stopped on its configuration .*no \*\.safetensors files"):
        _tick_until(sup, lambda: False)
    assert child.restarts == 0 and child.proc.returncode == EXIT_CONFIG
    sup.stop(5)


def test_a_crash_is_still_restarted(tmp_path):
    env = _module(tmp_path, """
        import sys
        sys.exit(3)
        """)
    sup = Supervisor(backoff_s=0.01)
    child = Child("decode-0", "childmod", env)
    sup.add(child)
    _tick_until(sup, lambda: child.restarts >= 2)
    sup.stop(5)


@pytest.mark.parametrize("module, env, name", [
    ("decode_svc", {"TANDEM_DECODE_SLOTS": "-3"}, "slots"),
    ("prefill_svc", {"TANDEM_PREFILL_KV_BUDGET_BYTES": "lots"}, "kv_budget_bytes"),
    ("gateway", {"TANDEM_GATEWAY_PORT": "-1"}, "port"),
    ("decode_svc", {"TANDEM_DECODE_SPECULATIVE__METHOD": "draft"}, "draft_model"),
    ("decode_svc", {"TANDEM_DECODE_SPECULATIVE__METHOD": "draft", "TANDEM_DECODE_SPECULATIVE__DRAFT_MODEL": "tiny"},
     "the draft model tiny cannot propose for tandem-tiny-py: it has a vocabulary of 258 tokens"),
])
def test_the_services_exit_78_on_a_bad_setting(module, env, name):
    import subprocess

    env = {**os.environ, "PYTHONPATH": str(ROOT), **env}
    done = subprocess.run([sys.executable, "-m", module], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == EXIT_CONFIG, done.stderr[-2000:]
    assert "cannot start with this configuration" in done.stderr and name in done.stderr
    assert "Traceback" not in done.stderr  # one line that says what is wrong


def test_cpu_workers_do_not_start_the_tpu_plugin(tmp_path, monkeypatch):
    """With libtpu installed (make test installs it) and no accelerator, a worker's JAX would start
    the TPU plugin and print its initialisation errors into a healthy CPU cluster's log: `tandem
    local` gives its workers JAX_PLATFORMS=cpu there, and leaves a machine with a TPU or a GPU alone."""
    import subprocess

    monkeypatch.delenv("JAX_PLATFORMS", raising=False)
    assert local.jax_platforms_env(str(tmp_path)) == {"JAX_PLATFORMS": "cpu"}
    (tmp_path / "accel0").touch()
    assert local.jax_platforms_env(str(tmp_path)) == {}
    monkeypatch.setenv("JAX_PLATFORMS", "tpu")
    assert local.jax_platforms_env(str(tmp_path / "none")) == {}
    monkeypatch.delenv("JAX_PLATFORMS")
    env = {**os.environ, **local.jax_platforms_env(str(tmp_path / "none"))}
    run = subprocess.run([sys.executable, "-c", "import jax; print(jax.devices()[0].platform)"], env=env,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and run.stdout.strip() == "cpu"
    assert "TPU" not in run.stderr and "E0000" not in run.stderr, run.stderr[-2000:]
