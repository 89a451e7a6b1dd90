"""The images built here, run as the chart runs them (tests/containers/stack.py): Redis (Debian's
redis-server on the same base), the gateway, one prefill and two decode containers on one Docker
network, each with the chart's command, environment, security context, volumes and probes. The
`openai` client streams a completion and a chat through the gateway; a decode container is killed
mid-stream and the stream finishes on the other, every token once, with the unbroken run's text."""
from __future__ import annotations

import json
import time

import httpx
import openai
import pytest
import redis

from tandem_core import keys

# The first test's clock includes the stack's start (images' containers created, every worker's
# shapes compiled on CI's two cores).
pytestmark = [pytest.mark.containers, pytest.mark.e2e, pytest.mark.timeout(1200)]
MESSAGES = [{"role": "system", "content": "You write Python."}, {"role": "user", "content": "def add(a, b):"}]


def _client(stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.base_url + "/v1", api_key=stack.api_key, max_retries=0, timeout=120)


def _status(pod) -> dict[str, str]:
    """The service process's (PID 1's) credentials and privileges, as the kernel holds them."""
    code, out = pod.container.get_wrapped_container().exec_run(["cat", "/proc/1/status"])
    assert code == 0, out
    return dict(line.split(":\t", 1) for line in out.decode().splitlines() if ":\t" in line)


def test_every_container_runs_as_the_charts_security_context(stack):
    for pod in stack.pods():
        status = _status(pod)
        want_uid = "999" if pod is stack.redis else "10001"  # the bundled Redis' own podSecurityContext
        assert status["Uid"].split()[0] == want_uid and status["Gid"].split()[0] == want_uid, (pod.name, status["Uid"])
        assert status["CapEff"].strip() == "0000000000000000", (pod.name, status["CapEff"])
        assert status["NoNewPrivs"].strip() == "1", pod.name
        code, out = pod.container.get_wrapped_container().exec_run(["sh", "-c", "touch /opt/x || touch /usr/x"])
        assert code != 0 and b"Read-only file system" in out, (pod.name, out)
        code, out = pod.container.get_wrapped_container().exec_run(["sh", "-c", "touch /tmp/x && echo ok"])
        assert code == 0 and out.strip() == b"ok", (pod.name, out)  # the emptyDir's tmpfs


def test_streamed_completion_and_chat_through_the_openai_client(stack):
    client = _client(stack)
    model = client.models.list().data[0].id
    whole = client.completions.create(model=model, prompt="import os\n", max_tokens=12, temperature=0)
    streamed = list(client.completions.create(model=model, prompt="import os\n", max_tokens=12, temperature=0,
                                              stream=True))
    text = "".join(c.choices[0].text for c in streamed if c.choices)
    assert text and text == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in streamed if c.choices][-1] in ("length", "stop")

    chunks = list(client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=8, temperature=0,
                                                 stream=True))
    reply = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    plain = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=8, temperature=0)
    assert reply and reply == plain.choices[0].message.content
    # Auth is on, as the chart installs it: no key, no completion.
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=stack.base_url + "/v1", api_key="wrong", max_retries=0).models.list()


def _running_on(stack, timeout_s: float = 10) -> list[str]:
    """The decode pods (their worker ids: the pod names) whose running hash holds a request."""
    r = redis.Redis(host=stack.redis.host, port=stack.redis.host_port("redis"), password=stack.redis_password)
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            busy = [p.name for p in stack.decodes if r.hlen(keys.KeySpace(1).running_key(p.name, 0))]
            if busy or time.monotonic() > deadline:
                return busy
            time.sleep(0.01)
    finally:
        r.close()


def test_a_decode_container_killed_mid_stream_and_the_stream_finishing(stack):
    n = 300  # + the prompt's few tokens < the chart's max_len 512
    body = {"model": "builtin", "prompt": "import os\n", "max_tokens": n, "temperature": 0, "ignore_eos": True}
    headers = {"Authorization": f"Bearer {stack.api_key}"}
    model = _client(stack).models.list().data[0].id
    body["model"] = model
    reference = httpx.post(stack.base_url + "/v1/completions", json=body, headers=headers, timeout=180).json()
    got: list[dict] = []
    killed: list[str] = []
    with httpx.stream("POST", stack.base_url + "/v1/completions", json={**body, "stream": True}, headers=headers,
                      timeout=180) as resp:
        assert resp.status_code == 200, resp.read()
        for line in resp.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            assert "error" not in chunk, chunk
            got += chunk["choices"]
            if not killed and len(got) >= 20:
                killed = _running_on(stack)
                assert killed, "no decode pod holds the request: the kill would prove nothing"
                for pod in stack.decodes:
                    if pod.name in killed:
                        pod.kill()
    assert len(killed) == 1, killed
    dead = next(p for p in stack.decodes if p.name == killed[0])
    survivor = next(p for p in stack.decodes if p is not dead)
    assert not dead.running()
    assert len(got) == n and got[-1]["finish_reason"] == "length", (len(got), got[-1:])
    assert "".join(c["text"] for c in got) == reference["choices"][0]["text"]
    deadline = time.monotonic() + 20
    while "resumed request_id=" not in survivor.logs():
        assert time.monotonic() < deadline, survivor.logs()[-3000:]
        time.sleep(0.2)
