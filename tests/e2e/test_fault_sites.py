"""A fault at an await, under load (issue 31): the whole cluster as processes, a fault plan
(tandem_core/faults.py, a test aid set through TANDEM_FAULTS) that makes one call at each named
site raise, and a batch of greedy streams. Every request ends with the engine's greedy text (the
unbroken run's) or a clear error that names the fault; afterwards no decode seat is held, nothing is
owed, no KV is held, no queue has a leftover, and every planned fault fired.

Faults at a decode site must cost the client nothing (the request is handed back and resumed; a
failed engine step stops the pod, which hands its requests back and is restarted); a Redis-down
fault at the gateway's enqueue or token read or the prefill claim is waited out; a fault in the
prefill itself or its commit fails that one request with a clear error. A planned fault fires once
per cluster (TANDEM_FAULTS_STATE), not again in a restarted process.

By default one cluster takes every site's fault in one run; TANDEM_FAULT_SITES_EACH=1 walks the
sites one cluster each (what docs/reliability.md's table reports)."""
from __future__ import annotations

import asyncio
import json
import os
import shutil
import tempfile
import time

import httpx
import pytest

from tandem_core import faults
from tandem_core.types import SamplingParams
from tests.e2e.conftest import start_local, stop_local
from tests.e2e.test_api_parity import engine_text, reference

pytestmark = [pytest.mark.e2e]

MAX_TOKENS = 24
# long prompts: prefill pod -> KV pull -> decode pod; short ones: prefilled by the decode pod
PROMPTS = [[0] + [300 + (i * 41 + k * 13) % 1500 for i in range(24 + k)] for k in range(12)] \
    + [[0, 500 + k, 501, 502 + k] for k in range(4)]
# the call at each site that fails: a few requests in, so the load is under way
PLAN = {
    "decode.claim": "decode.claim@4-5:down",
    "decode.pull": "decode.pull@3",
    "decode.own": "decode.own@5",
    "decode.ack": "decode.ack@7",
    "decode.publish": "decode.publish@9",
    "decode.handback": "decode.handback@1,decode.pull@2",  # a handback needs a failure first
    "prefill.prefill": "prefill.prefill@4",
    "prefill.commit": "prefill.commit@6",
    "gateway.enqueue": "gateway.enqueue@1:down",  # the first pipeline: a burst may be one or two
    "gateway.read": "gateway.read@3-4:down",
    "prefill.claim": "prefill.claim@4-5:down",
    "decode.step": "decode.step@6",
    # an engine call other than the step fails: the engine thread dies, the pod stops and is restarted
    "decode.insert": "decode.insert@5",
    "decode.local_prefill": "decode.local_prefill@2",
    # the connection dies inside a hand back's resume (its writes made, the reply lost): the retry finds it done
    "recovery.resume": "recovery.resume@1:down,decode.pull@2",
}
# Every site at once: one request can be struck by the two engine-thread kills (decode.step,
# decode.insert), a pull, an own and a publish fault, more than the default 3 resumes
# (max_attempts; its bound is tested in tests/integration/test_resume.py). Here each decode fault
# must cost nothing, so the bound is set above what one run can spend.
FAST = {"TANDEM_DECODE_RECOVER_INTERVAL_S": "0.3", "TANDEM_PREFILL_RECOVER_INTERVAL_S": "0.3",
        "TANDEM_DECODE_MAX_ATTEMPTS": "8"}
EACH = os.environ.get("TANDEM_FAULT_SITES_EACH") == "1"


def test_every_site_is_in_the_plan():
    assert set(PLAN) == set(faults.SITES)
    faults.configure(",".join(PLAN.values()))  # the spec parses
    faults.configure("")


@pytest.fixture(scope="module")
def expected() -> dict[int, str]:
    from tandem_engine import load_engine

    engine = load_engine("builtin", slots=2, max_len=512)
    return {i: engine_text(reference(engine, p, MAX_TOKENS, SamplingParams(), stop_ids=())) for i, p in
            enumerate(PROMPTS)}


async def _stream(c: httpx.AsyncClient, i: int) -> tuple[str, str | None]:
    """(text, error message or None) of one greedy stream, every event parsed."""
    body = {"model": "builtin", "prompt": PROMPTS[i], "max_tokens": MAX_TOKENS, "temperature": 0, "stream": True,
            "ignore_eos": True}
    text, error = "", None
    try:
        async with c.stream("POST", "/v1/completions", json=body) as resp:
            if resp.status_code != 200:
                return text, f"HTTP {resp.status_code}: {(await resp.aread())[:300]!r}"
            rid = resp.headers.get("x-request-id", "")
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    error = chunk["error"]["message"]
                for ch in chunk.get("choices") or []:
                    text += ch["text"]
    except httpx.HTTPError as e:  # the client's patience ran out: a lost request
        return text, f"LOST request {i} ({rid if 'rid' in locals() else '?'}) after {text!r}: {type(e).__name__}"
    return text, error


def _settled(base: str) -> dict:
    snap = httpx.get(base + "/admin/cluster", timeout=10).json()
    dec = [w for w in snap["workers"] if w["role"] == "decode"]
    pre = [w for w in snap["workers"] if w["role"] == "prefill"]
    return {
        "free": all(w["free_slots"] == w["slots"] for w in dec),
        "records": sum(sum(w["extra"]["requests"].values()) for w in dec),
        "owed": sum(w["extra"].get("owed", 0) for w in dec),
        "handed_back": sum(w["extra"].get("handed_back", 0) for w in dec),
        "held_kv": sum(w["held_kv_bytes"] for w in pre),
        "admission": snap["queues"]["admission_backlog"], "ready": snap["queues"]["ready"],
    }


def _run_with(plan: str, expected: dict[int, str]) -> tuple[list, dict, str]:
    state = tempfile.mkdtemp(prefix="tandem-faults-")  # a restarted pod does not fire the same fault again
    cl = start_local(slots=4, env={faults.ENV: plan, faults.STATE_ENV: state, **FAST})
    try:
        async def load():
            async with httpx.AsyncClient(base_url=cl.base_url, timeout=60) as c:
                return await asyncio.gather(*[_stream(c, i) for i in range(len(PROMPTS))])

        results = asyncio.run(load())
        deadline = time.monotonic() + 30
        while True:
            after = _settled(cl.base_url)
            idle = after["free"] and not (after["records"] or after["owed"] or after["held_kv"]
                                          or after["admission"] or after["ready"])
            if idle or time.monotonic() > deadline:
                break
            time.sleep(0.3)
    finally:
        stop_local(cl.proc)
        shutil.rmtree(state, ignore_errors=True)
        if os.environ.get("TANDEM_FAULT_SITES_LOG"):
            with open(os.environ["TANDEM_FAULT_SITES_LOG"], "w") as f:
                f.write("".join(cl.log))
    return results, after, "".join(cl.log)


def _check(plan: str, results: list, after: dict, log: str, expected: dict[int, str]) -> str:
    sites = {part.split("@")[0] for part in plan.split(",")}
    fired = {s for s in sites if f"injected fault at {s} " in log}
    assert fired == sites, f"planned faults that never fired (the load missed them): {sites - fired}"
    # a stale ready notice (its KV replaced by a later prefill of the request) is acked, never
    # resumed: a resume would enqueue the request twice and spend an attempt (CI failed on it)
    assert not any("wrong capability" in line and "resuming" in line for line in log.splitlines()), \
        "a superseded ready notice was resumed"
    failed = []
    for i, (text, error) in enumerate(results):
        if error is not None:
            assert "injected fault at prefill." in error, f"request {i} failed without a clear cause: {error}"
            failed.append(i)
        else:
            assert text == expected[i], f"request {i}: a token lost, duplicated or wrong: {text!r}"
    assert after["free"] and after["records"] == 0, f"decode seats held after the load: {after}"
    assert after["owed"] == 0, f"hand-backs still owed: {after}"
    assert after["held_kv"] == 0 and after["admission"] == 0 and after["ready"] == 0, after
    return f"{len(results) - len(failed)} served, {len(failed)} clear errors, handed back {after['handed_back']}"


@pytest.mark.parametrize("site", list(PLAN) if EACH else ["every site at once"])
def test_a_fault_at_each_await_loses_nothing(site, expected):
    plan = ",".join(PLAN.values()) if site == "every site at once" else PLAN[site]
    results, after, log = _run_with(plan, expected)
    verdict = _check(plan, results, after, log, expected)
    print(f"FAULT SITE {site} ({plan}): {verdict}")


def test_bad_entries_under_load_cost_only_their_own_requests(expected):
    """Issue 42: malformed and unknown-field entries written into every stream a gateway or pod
    reads, while the 16 streams run: an admission, a direct and a ready entry no request reads
    from (dead letters: each answered with a clear error on its request's stream, and acked), a
    worker heartbeat with garbage in it (before, every reader of the registry failed: the
    gateway's admission among them), and an entry whose `i` is not a number in the token stream
    of one more running request (before, it ended the gateway's token reader and every stream
    with it). That one request fails with an error naming its stream; every other request is
    served, and afterwards nothing is left in the queues."""
    import redis

    from tandem_core import keys
    from tests.e2e.fault_inject import redis_url

    cl = start_local(slots=4, env=FAST)
    ks = keys.KeySpace(1)
    try:
        r = redis.Redis.from_url(redis_url(cl.log))
        r.xadd(ks.admission_stream("default", "high", 0), {"rid": "fuzz-adm", "req": "{not json", "x-new": "1"})
        r.xadd(ks.direct_stream("default", 0), {"rid": "fuzz-direct", "req": '{"request_id": "fuzz-direct"}'})
        r.xadd(ks.ready_stream("default", 0), {"rid": "fuzz-ready", "notice": "[1, 2"})
        r.hset(keys.worker_key("fuzz-pod"), mapping={"role": "decode", "id": "fuzz-pod", "pid": "many", "extra": "{"})
        r.expire(keys.worker_key("fuzz-pod"), 60)
        r.zadd(keys.WORKERS, {"fuzz-pod": time.time()})

        async def victim(c: httpx.AsyncClient) -> str | None:
            body = {"model": "builtin", "prompt": PROMPTS[0], "max_tokens": 400, "temperature": 0, "stream": True,
                    "ignore_eos": True}
            async with c.stream("POST", "/v1/completions", json=body) as resp:
                assert resp.status_code == 200, await resp.aread()
                rid, struck = resp.headers["x-request-id"], False
                async for line in resp.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        return chunk["error"]["message"]
                    if not struck:  # running: a bad entry into its token stream
                        r.xadd(ks.token_stream(rid), {"i": "three", "t": "5", "x-new": "1"})
                        struck = True
            return None

        async def load():
            async with httpx.AsyncClient(base_url=cl.base_url, timeout=60) as c:
                return await asyncio.gather(victim(c), *[_stream(c, i) for i in range(len(PROMPTS))])

        error, *results = asyncio.run(load())
        assert error and "malformed token stream entry" in error, f"the struck request did not fail clearly: {error}"
        for i, (text, err) in enumerate(results):
            assert err is None and text == expected[i], f"request {i} paid for another's bad entry: {err} {text!r}"
        deadline = time.monotonic() + 30
        while True:
            after = _settled(cl.base_url)
            if not (after["admission"] or after["ready"]) or time.monotonic() > deadline:
                break
            time.sleep(0.3)
        assert after["admission"] == 0 and after["ready"] == 0, f"a dead letter was left in its queue: {after}"
        for rid in ("fuzz-adm", "fuzz-direct", "fuzz-ready"):
            ends = [f for _id, f in r.xrange(ks.token_stream(rid)) if b"f" in f]
            assert ends and ends[-1][b"f"] == b"error", f"the dead letter of {rid} got no answer: {ends}"
        print("BAD ENTRIES: 16 served; the struck request failed with:", error)
    finally:
        stop_local(cl.proc)
