"""The container tier: the images built here (make base-image images) run as the chart runs them,
on one Docker network (tests/containers/stack.py says how the pod specs become containers).

When no Docker engine answers or an image is missing the tests are skipped with the reason, which
`pytest -ra` (make test) prints in its summary; with TANDEM_REQUIRE_CONTAINERS=1 (set by .ci/run
once it has started the engine and built the images) they fail instead, so CI cannot pass them
by not running them."""
from __future__ import annotations

import os
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import pytest

# testcontainers' reaper (Ryuk) is an image from Docker Hub; nothing here pulls. The stack is
# removed by the fixture's teardown instead.
os.environ.setdefault("TESTCONTAINERS_RYUK_DISABLED", "true")

from tests.containers import stack as st

RELEASE = "rel"
# The chart's defaults (auth on, mutual TLS between the workers, per-role Redis users) with one
# gateway, the workers' heartbeats as fast as the process fault tests' (tests/e2e/faults.py), so
# a killed decode pod's request is taken over in seconds rather than a minute, and fewer shapes to
# compile before the pods are ready: prompts batched by 2 (max_batch; 5 batched prefill shapes,
# not 15) and 2 decode slots (the fault tests' number), on CI's two cores.
FAST = {"heartbeat_interval_s": 0.5, "recover_interval_s": 0.5, "drain_timeout_s": 1}
VALUES = {
    "gateway": {"replicas": 1},
    "prefill": {"settings": {**FAST, "stale_pending_s": 5, "drain_timeout_s": 10, "max_batch": 2}},
    "decode": {"settings": {**FAST, "stale_pending_s": 8, "slots": 2}},
}
# Each decode call slowed by 60 ms (a fault plan's `sleep`, a test aid: tandem_core/faults.py; the
# chart refuses TANDEM_* in extraEnv, so the harness adds it), so the kill test's 300 tokens take
# seconds (at 20 ms: 1.7 s, the 20th token relayed at 0.2 s). Unslowed, the built-in model decodes
# them in ~0.25 s here, and on CI's busy cores the stream relayed to the client lagged past the end
# of the request, which had finished on its pod before the kill could land mid-stream ("no decode
# pod holds the request").
DECODE_ENV = {"TANDEM_FAULTS": "decode.step@1+:sleep60"}
DECODE_PODS = 2  # the kill test's survivor


@dataclass
class Stack:
    rendered: object
    redis: st.Pod
    prefill: st.Pod
    decodes: list[st.Pod]
    gateway: st.Pod
    api_key: str
    redis_password: str
    started_s: dict[str, float] = field(default_factory=dict)

    @property
    def base_url(self) -> str:
        return f"http://{self.gateway.host}:{self.gateway.host_port('http')}"

    def pods(self) -> list[st.Pod]:
        return [self.redis, self.prefill, *self.decodes, self.gateway]


def _not_running(reason: str):
    if os.environ.get("TANDEM_REQUIRE_CONTAINERS") == "1":
        pytest.fail(f"TANDEM_REQUIRE_CONTAINERS=1 but the container tests cannot run: {reason}", pytrace=False)
    pytest.skip(f"container tests not run: {reason}")


@pytest.fixture(scope="session")
def stack():
    reason = st.missing_engine_reason()
    if reason:
        _not_running(reason)
    import json

    from testcontainers.core.network import Network

    from tests.unit.test_chart import Rendered

    r = Rendered(VALUES)
    assert r.files, "the chart did not render"
    prefix = st.unique_prefix()
    gw_env = st.container_env(r, r.component("gateway"), "x")
    redis_host = gw_env["TANDEM_GATEWAY_REDIS__URL"].split("//")[1].split(":")[0]
    api_key = json.loads(gw_env["TANDEM_GATEWAY_API_KEYS"])[0]
    redis_password = st.secret_value(r, f"{RELEASE}-tandem-redis", "redis-password")
    network = Network().create()
    pods: list[st.Pod] = []
    jax_cache = None
    t0 = time.monotonic()
    try:
        redis = st.start_pod(r, r.get("StatefulSet", f"{RELEASE}-tandem-redis"), f"{prefix}-redis-0",
                             st.IMAGES["redis"], network, aliases=[redis_host])
        pods.append(redis)
        started = {"redis": st.wait_started(redis)}
        # The workers' compilation cache: one host directory (the chart: an emptyDir per pod), and
        # the second decode pod started once the first is ready, so it loads what the first
        # compiled instead of compiling it again on the same cores (CI's minutes).
        jax_cache = tempfile.TemporaryDirectory(prefix="tandem-jax-cache-")
        os.chmod(jax_cache.name, 0o1777)
        cache_dir = st.container_env(r, r.component("decode"), "x")["JAX_COMPILATION_CACHE_DIR"]
        shared = {cache_dir: jax_cache.name}
        first = [("prefill-0", r.component("prefill"), st.IMAGES["worker"]),
                 ("decode-0", r.component("decode"), st.IMAGES["worker"]),
                 ("gateway-0", r.component("gateway"), st.IMAGES["gateway"])]
        later = [(f"decode-{i}", r.component("decode"), st.IMAGES["worker"]) for i in range(1, DECODE_PODS)]
        for batch in (first, later):
            new = [st.start_pod(r, workload, f"{prefix}-{name}", image, network, shared=shared,
                                env=DECODE_ENV if name.startswith("decode") else None)
                   for name, workload, image in batch]
            pods += new
            with ThreadPoolExecutor(len(new)) as ex:
                for (name, _, _), secs in zip(batch, ex.map(st.wait_started, new), strict=True):
                    started[name] = secs
        started["all"] = time.monotonic() - t0
        print(f"\ncontainer stack ready: {({k: round(v, 1) for k, v in started.items()})}", file=sys.stderr)
        by_name = {p.name.removeprefix(prefix + "-"): p for p in pods}
        yield Stack(r, redis, by_name["prefill-0"], [by_name[f"decode-{i}"] for i in range(DECODE_PODS)],
                    by_name["gateway-0"], api_key, redis_password, started)
    finally:
        for pod in reversed(pods):
            if os.environ.get("TANDEM_CONTAINER_LOGS"):
                print(f"----- {pod.name}\n{pod.logs()[-3000:]}", file=sys.stderr)
            try:
                pod.container.stop()
            except Exception as e:  # noqa: BLE001  (teardown goes on with the other pods)
                print(f"removing {pod.name}: {e}", file=sys.stderr)
            for d in pod.secret_dirs:
                d.cleanup()
        network.remove()
        if jax_cache is not None:
            jax_cache.cleanup()
