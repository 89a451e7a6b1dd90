"""The whole cluster on a real Redis Cluster (3 masters with a replica each; `tandem local
--redis-url URL --redis-cluster`, so 16 key shards): greedy tokens are the engine's, every stream
arrives exactly once and in order, and a master SIGKILLed mid-load, its replica taking over, leaves
every request in flight at the kill finished with its tokens: none fails, none hangs, and no token
is duplicated at the client (a duplicate or a gap would change the greedy text)."""
from __future__ import annotations

import concurrent.futures as cf
import threading
import time

import openai
import pytest

from tandem_core.types import SamplingParams
from tests.e2e.conftest import start_local, stop_local
from tests.e2e.test_api_parity import engine_text, reference

pytestmark = pytest.mark.e2e
# long prompts go through a prefill pod and a KV pull; short ones are prefilled by the decode pod
PROMPTS = [[0] + [300 + (i * 37 + k * 11) % 1500 for i in range(24 + k)] for k in range(6)] \
    + [[0, 400 + k, 401, 402 + k] for k in range(6)]


@pytest.fixture(scope="module")
def engine():
    from tandem_engine import load_engine

    return load_engine("builtin", slots=2, max_len=512)


@pytest.fixture(scope="module")
def expected(engine) -> dict[int, str]:
    return {i: engine_text(reference(engine, p, 24, SamplingParams(), stop_ids=())) for i, p in enumerate(PROMPTS)}


@pytest.fixture(scope="module")
def on_cluster(redis_cluster):
    redis_cluster.flushall()
    c = start_local(slots=4, extra=["--redis-url", redis_cluster.url, "--redis-cluster"])
    try:
        yield c
    finally:
        stop_local(c.proc)
        assert c.proc.returncode == 0, "tandem local did not stop cleanly:\n" + "".join(c.log[-30:])


def _client(c) -> openai.OpenAI:
    return openai.OpenAI(base_url=c.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)


def _streamed(client, prompt: list[int]) -> str:
    chunks = client.completions.create(model="builtin", prompt=prompt, max_tokens=24, temperature=0, stream=True,
                                       extra_body={"ignore_eos": True})
    return "".join(c.choices[0].text for c in chunks)


def test_greedy_tokens_and_n_are_the_engines(on_cluster, expected):
    client = _client(on_cluster)
    for i in (0, 5, 6, 11):
        got = client.completions.create(model="builtin", prompt=PROMPTS[i], max_tokens=24, temperature=0,
                                        extra_body={"ignore_eos": True})
        assert got.choices[0].text == expected[i] and got.usage.completion_tokens == 24
    many = client.completions.create(model="builtin", prompt=PROMPTS[1], max_tokens=24, temperature=0, n=3,
                                     extra_body={"ignore_eos": True})
    assert [c.text for c in many.choices] == [expected[1]] * 3  # three choices, three shards' worth of keys


def test_concurrent_streams_arrive_exactly_once_in_order(on_cluster, expected):
    client = _client(on_cluster)
    with cf.ThreadPoolExecutor(12) as ex:
        got = list(ex.map(lambda i: _streamed(client, PROMPTS[i % len(PROMPTS)]), range(36)))
    assert got == [expected[i % len(PROMPTS)] for i in range(36)]


class _Flight:
    """Which streams have their first token and have not ended, as the load runs (thread-safe)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.streaming: set[int] = set()
        self.spans: dict[int, tuple[float, float]] = {}  # request -> (sent, ended), monotonic

    def run(self, client, i: int) -> tuple[int, str]:
        sent, text = time.monotonic(), ""
        try:
            for c in client.completions.create(model="builtin", prompt=PROMPTS[i % len(PROMPTS)], max_tokens=24,
                                               temperature=0, stream=True, extra_body={"ignore_eos": True}):
                if not text:
                    with self.lock:
                        self.streaming.add(i)
                text += c.choices[0].text
        except openai.APIError as e:
            text = f"ERROR {type(e).__name__}: {e}"
        finally:
            with self.lock:
                self.streaming.discard(i)
                self.spans[i] = (sent, time.monotonic())
        return i, text

    def wait_streaming(self, n: int, timeout_s: float) -> int:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with self.lock:
                if len(self.streaming) >= n:
                    return len(self.streaming)
            time.sleep(0.01)
        return len(self.streaming)


def test_a_master_killed_mid_load_loses_and_duplicates_nothing(on_cluster, redis_cluster, expected):
    """The kill lands while requests are in flight (streams that have tokens and have not ended,
    others queued behind them), and none of them fails: each ends with the engine's greedy text."""
    client = _client(on_cluster)
    flight = _Flight()
    try:
        with cf.ThreadPoolExecutor(12) as ex:
            futures = [ex.submit(flight.run, client, i) for i in range(48)]
            streaming = flight.wait_streaming(4, 120)  # requests in every phase: queued, prefilling, decoding
            killed_at = time.monotonic()
            killed = redis_cluster.kill_master(1)
            redis_cluster.wait_failover(30)
            failover_s = time.monotonic() - killed_at
            results = [f.result(timeout=180) for f in futures]  # none hangs
    finally:
        redis_cluster.heal()
    in_flight = [i for i, (sent, ended) in flight.spans.items() if sent < killed_at < ended]
    assert streaming >= 4 and len(in_flight) >= 8, \
        f"the kill landed on an idle cluster ({streaming} streaming, {len(in_flight)} in flight): it proves nothing"
    errors = [(i, text) for i, text in results if text.startswith("ERROR")]
    assert not errors, f"{len(errors)} of {len(results)} failed after the failover of {killed.port}: {errors[:3]}"
    for i, text in results:
        assert text == expected[i % len(PROMPTS)], f"request {i}: a token lost or duplicated"
    print(f"master {killed.port} killed with {len(in_flight)} requests in flight ({streaming} streaming): "
          f"failover in {failover_s:.1f}s, none failed")
    # and the cluster still serves after the failover
    assert _streamed(client, PROMPTS[2]) == expected[2]
