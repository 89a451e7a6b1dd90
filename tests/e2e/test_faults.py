"""Fault tests: processes on loopback, real Redis, bounded in time and count. For each fault a
set of greedy streamed requests runs with the fault injected mid-flight; every request must
finish, with no token index missing or repeated, and the text of an unbroken reference run.
The scenarios live in bench/faults.py, which also writes docs/reliability.md from a real run."""
from __future__ import annotations

import asyncio
import time

import pytest

from bench import faults
from tests.e2e.conftest import stop_local

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
    r = asyncio.run(faults.run_fault(fault_cluster, name))
    assert r.finished == r.sent, r
    assert (r.duplicated, r.missing, r.wrong_text) == (0, 0, 0), r


def test_supervisor_restarted_the_killed_workers(fault_cluster):
    workers = asyncio.run(faults.wait_healthy(fault_cluster.base_url, faults.WANT))
    assert sorted(w["id"] for w in workers) == ["decode-0", "decode-1", "prefill-0"]
    log = "".join(fault_cluster.log)
    assert "exited with code -9; restarting" in log


def test_each_choice_of_n_resumes_after_a_decode_pod_dies(fault_cluster):
    """A streamed n=2 greedy request, every decode pod SIGKILLed mid-stream: each choice resumes on
    its own (from its own token stream) and both end with the unbroken run's text, every index once."""
    seen = len(fault_cluster.log)
    r = asyncio.run(_n_choices_through_a_kill(fault_cluster.base_url))
    assert r["killed"], "the decode pod was never killed: this test proved nothing"
    assert r["finish"] == ["length", "length"], r
    assert r["counts"] == [r["max_tokens"]] * 2, r
    assert r["texts"] == [r["reference"]] * 2, r
    deadline = time.monotonic() + 20  # the launcher relays its children's logs as they come
    while not [x for x in fault_cluster.log[seen:] if "resumed request_id=" in x and "~" in x]:
        assert time.monotonic() < deadline, "no choice resumed after the kill:\n" + "".join(fault_cluster.log[-40:])
        time.sleep(0.2)


async def _n_choices_through_a_kill(base: str) -> dict:
    import json
    import os
    import signal

    import httpx

    decode_pids = [w["pid"] for w in await faults.wait_healthy(base, faults.WANT) if w["role"] == "decode"]
    prompt, max_tokens = faults.prompts(1)[0], 420  # + the ~70-token prompt: inside the 512 context
    body = {"model": faults.MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    async with httpx.AsyncClient(base_url=base, timeout=180) as c:
        reference = (await c.post("/v1/completions", json=body)).json()["choices"][0]["text"]
        texts, counts, finish, killed = ["", ""], [0, 0], [None, None], False
        async with c.stream("POST", "/v1/completions", json={**body, "n": 2, "stream": True}) as resp:
            async for line in resp.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                chunk = json.loads(line[6:])
                assert "error" not in chunk, chunk
                for ch in chunk["choices"]:
                    i = ch["index"]
                    texts[i] += ch["text"]
                    counts[i] += 1
                    finish[i] = ch["finish_reason"] or finish[i]
                if not killed and min(counts) >= 10:  # every decode pod (whichever holds the choices), at once
                    for pid in decode_pids:
                        os.kill(pid, signal.SIGKILL)
                    killed = True
    return {"texts": texts, "counts": counts, "finish": finish, "reference": reference, "max_tokens": max_tokens,
            "killed": killed}


def test_constrained_json_stays_valid_through_a_decode_pod_kill(fault_cluster):
    """A streamed json_schema request at temperature 1, every decode pod SIGKILLed mid-stream: the
    request resumes on a fresh pod whose matcher is rebuilt from the tokens already streamed, so
    the whole reply still parses and validates."""
    import jsonschema

    schema = {"type": "object", "properties": {"text": {"type": "string", "minLength": 120, "maxLength": 130},
                                               "n": {"type": "integer", "minimum": 0, "maximum": 9}},
              "required": ["text", "n"], "additionalProperties": False}
    seen = len(fault_cluster.log)
    text, finish, killed = asyncio.run(_constrained_through_a_kill(fault_cluster.base_url, schema))
    assert killed and finish == "stop", (killed, finish, text)
    jsonschema.validate(__import__("json").loads(text), schema)
    deadline = time.monotonic() + 20
    while not [x for x in fault_cluster.log[seen:] if "resumed request_id=" in x]:
        assert time.monotonic() < deadline, "the request never resumed:\n" + "".join(fault_cluster.log[-40:])
        time.sleep(0.2)


async def _constrained_through_a_kill(base: str, schema: dict) -> tuple[str, str | None, bool]:
    import json
    import os
    import signal

    import httpx

    decode_pids = [w["pid"] for w in await faults.wait_healthy(base, faults.WANT) if w["role"] == "decode"]
    body = {"model": faults.MODEL, "prompt": faults.prompts(1)[0], "max_tokens": 400, "temperature": 1.0,
            "seed": 5, "stream": True, "structured_outputs": {"json": schema}}
    text, finish, count, killed = "", None, 0, False
    async with httpx.AsyncClient(base_url=base, timeout=180) as c:
        async with c.stream("POST", "/v1/completions", json=body) as resp:
            assert resp.status_code == 200, await resp.aread()
            async for line in resp.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                chunk = json.loads(line[6:])
                assert "error" not in chunk, chunk
                for ch in chunk["choices"]:
                    text += ch["text"]
                    count += 1
                    finish = ch["finish_reason"] or finish
                if not killed and count >= 20:  # at once: the reply must still be streaming
                    for pid in decode_pids:
                        os.kill(pid, signal.SIGKILL)
                    killed = True
    return text, finish, killed
