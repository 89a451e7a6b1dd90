"""Fault tests: processes on loopback, real Redis, bounded in time and count. For each fault a
set of greedy streamed requests runs with the fault injected mid-flight; every request must
finish, with no token index missing or repeated, and the text of an unbroken reference run.
The scenarios live in tests/e2e/faults.py; bench/faults.py runs the same ones to write
docs/reliability.md from a real run."""
from __future__ import annotations

import asyncio
import json
import os
import signal
import time

import httpx
import jsonschema
import pytest

from tests.e2e import fault_explain, faults
from tests.e2e.conftest import stop_local
from tests.e2e.fault_inject import WANT, redis_url, wait_healthy
from tests.e2e.fault_load import MODEL, prompts

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


@pytest.fixture(scope="module")
def fault_cluster():
    c = faults.start_cluster()
    try:
        yield c
    finally:
        stop_local(c.proc)


@pytest.mark.parametrize("name", list(faults.SCENARIOS))
def test_fault_loses_and_duplicates_nothing(fault_cluster, name):
    since_ms = int(time.time() * 1000)
    r = asyncio.run(faults.run_fault(fault_cluster, name))
    assert r.finished == r.sent, f"{r}\n{_explain(fault_cluster, r)}"
    assert (r.duplicated, r.missing, r.wrong_text) == (0, 0, 0), r
    if faults.SCENARIOS[name][2][0] == "prefill-holding":
        # The gateway drops a repeated index, so the client cannot tell: look in Redis. A woken
        # prefill pod that published again would have written a second token 0 (and its second
        # ready notice a second run of tokens 1..) into the request's token stream.
        time.sleep(1.0)  # the woken pod's last writes, if it made any
        assert written_twice(fault_cluster, since_ms) == []


def _explain(cluster, r) -> str:
    """The lost requests' log lines and Redis state (a rare loss leaves only this message)."""
    return fault_explain.explain(cluster.log, redis_url(cluster.log), r.notes)


def written_twice(cluster, since_ms: int) -> list[str]:
    """Token streams begun since `since_ms` (Redis time) with some token index written twice."""
    import redis

    r = redis.Redis.from_url(redis_url(cluster.log))
    out = []
    try:
        for key in r.scan_iter(match="tandem:*:tok:*", count=1000):
            entries = r.xrange(key)
            if not entries or int(entries[0][0].split(b"-")[0]) < since_ms:
                continue
            indices = [int(f[b"i"]) for _id, f in entries if int(f[b"i"]) >= 0]
            if len(indices) != len(set(indices)):
                out.append(key.decode())
    finally:
        r.close()
    return out


def test_supervisor_restarted_the_killed_workers(fault_cluster):
    workers = asyncio.run(wait_healthy(fault_cluster.base_url, WANT))
    assert sorted(w["id"] for w in workers) == ["decode-0", "decode-1", "prefill-0", "prefill-1"]
    log = "".join(fault_cluster.log)
    assert "exited with code -9; restarting" in log


def test_each_choice_of_n_resumes_after_a_decode_pod_dies(fault_cluster):
    """A streamed n=2 greedy request, every decode pod SIGKILLed mid-stream: each choice resumes on
    its own (from its own token stream) and both end with the unbroken run's text, every index once."""
    seen = len(fault_cluster.log)
    body = {"model": MODEL, "prompt": prompts(1)[0], "max_tokens": 420,  # + ~70 prompt tokens < 512
            "temperature": 0, "ignore_eos": True}
    reference = httpx.post(fault_cluster.base_url + "/v1/completions", json=body, timeout=180).json()
    chunks, killed = asyncio.run(_stream_killing_decode(fault_cluster.base_url, {**body, "n": 2}, after=20))
    assert killed, "the decode pods were never killed: this test proved nothing"
    for i in (0, 1):
        mine = [ch for ch in chunks if ch["index"] == i]
        assert len(mine) == 420 and mine[-1]["finish_reason"] == "length", (i, len(mine), mine[-1:])
        assert "".join(ch["text"] for ch in mine) == reference["choices"][0]["text"]
    _wait_for_log(fault_cluster, seen, lambda line: "resumed request_id=" in line and "~" in line)


def test_constrained_json_stays_valid_through_a_decode_pod_kill(fault_cluster):
    """A streamed json_schema request at temperature 1, every decode pod SIGKILLed mid-stream: the
    request resumes on a fresh pod whose matcher is rebuilt from the tokens already streamed, so
    the whole reply still parses and validates."""
    schema = {"type": "object", "properties": {"text": {"type": "string", "minLength": 120, "maxLength": 130},
                                               "n": {"type": "integer", "minimum": 0, "maximum": 9}},
              "required": ["text", "n"], "additionalProperties": False}
    seen = len(fault_cluster.log)
    body = {"model": MODEL, "prompt": prompts(1)[0], "max_tokens": 400, "temperature": 1.0,
            "seed": 5, "structured_outputs": {"json": schema}}
    chunks, killed = asyncio.run(_stream_killing_decode(fault_cluster.base_url, body, after=20))
    text = "".join(ch["text"] for ch in chunks)
    assert killed and chunks[-1]["finish_reason"] == "stop", (killed, chunks[-1:], text)
    jsonschema.validate(json.loads(text), schema)
    _wait_for_log(fault_cluster, seen, lambda line: "resumed request_id=" in line)


async def _stream_killing_decode(base: str, body: dict, after: int) -> tuple[list[dict], bool]:
    """Stream `body`; once `after` chunks have arrived, SIGKILL every decode pod at once (pids read
    before the stream, so nothing delays the kill while the reply is still being generated).
    Returns every streamed choice, in order, and whether the kill happened."""
    decode_pids = [w["pid"] for w in await wait_healthy(base, WANT) if w["role"] == "decode"]
    got: list[dict] = []
    killed = False
    async with httpx.AsyncClient(base_url=base, timeout=180) as c:
        async with c.stream("POST", "/v1/completions", json={**body, "stream": True}) as resp:
            assert resp.status_code == 200, await resp.aread()
            async for line in resp.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                chunk = json.loads(line[6:])
                assert "error" not in chunk, chunk
                got += chunk["choices"]
                if not killed and len(got) >= after:
                    for pid in decode_pids:
                        os.kill(pid, signal.SIGKILL)
                    killed = True
    return got, killed


def _wait_for_log(cluster, seen: int, match, timeout_s: float = 20) -> None:
    """Until a line after index `seen` of the cluster's log matches (the launcher relays its
    children's logs as they come)."""
    deadline = time.monotonic() + timeout_s
    while not any(match(line) for line in cluster.log[seen:]):
        assert time.monotonic() < deadline, "not in the log:\n" + "".join(cluster.log[-40:])
        time.sleep(0.2)
