"""`tandem local --planner`, end to end: under load the planner scales prefill and decode up, the
launcher starts the workers; when the load drops it scales them down, the launcher drains them
(SIGTERM), and no request is lost or changed on the way: every answer is the greedy text the
same prompt got before any scaling."""
from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tandem.redis_proc import free_port
from tests.e2e.conftest import start_local, stop_local

pytestmark = pytest.mark.e2e

# Made-up capacities, so that ~5 requests/s need 2 prefill and 2 decode pods and ~0 need 1:
# prefill 0.3 s a prompt (TTFT target 3 s: 80% busy at most -> 5 x 0.3 / 0.8 = 1.9 -> 2 pods);
# decode 4 slots stepping every 0.1 s (ITL target 0.2 s: 0.8 x 4 / 0.1 = 32 tokens/s a pod;
# 5 x 8 = 40 tokens/s -> 2 pods).
PROFILE = {"format": "tandem-capacity-profile/v1", "model": "made-up",
           "prefill": {"points": [{"tokens": 16, "seconds": 0.3}, {"tokens": 128, "seconds": 0.35}]},
           "decode": {"slots": 4, "points": [{"batch": 1, "itl_s": 0.05}, {"batch": 4, "itl_s": 0.1}]}}
PROMPTS = [f"planner check number {i} asks for a continuation of this longer prompt text" for i in range(6)]


def _complete(base: str, prompt: str) -> str:
    r = httpx.post(f"{base}/v1/completions", timeout=120, json={
        "prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def _workers(base: str) -> dict[str, int]:
    ws = httpx.get(f"{base}/admin/cluster", timeout=10).json()["workers"]
    return {role: sum(1 for w in ws if w["role"] == role and not w["draining"]) for role in ("prefill", "decode")}


def _wait_for(cond, timeout_s: float, what: str, log: list[str]) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} within {timeout_s:.0f}s; last log lines:\n" + "".join(log[-30:]))
        time.sleep(0.5)


def test_planner_scales_up_under_load_and_drains_on_the_way_down(tmp_path):
    profile = tmp_path / "profile.json"
    profile.write_text(json.dumps(PROFILE))
    planner_port = free_port()
    env = {"TANDEM_PLANNER_PROFILE_PATH": str(profile), "TANDEM_PLANNER_SLO__TTFT_S": "3",
           "TANDEM_PLANNER_SLO__ITL_S": "0.2", "TANDEM_PLANNER_MARGIN_SIGMAS": "0",
           "TANDEM_PLANNER_SCALE_UP_COOLDOWN_S": "0", "TANDEM_PLANNER_SCALE_DOWN_COOLDOWN_S": "8",
           "TANDEM_PLANNER_CORRECTION": "false"}  # the profile is made up: the real pods would correct it away
    cl = start_local("tiny", slots=4, max_len=128, env=env, extra=[
        "--planner", "--planner-port", str(planner_port), "--planner-interval", "2", "--planner-max", "2"])
    base = cl.base_url
    try:
        want = {p: _complete(base, p) for p in PROMPTS}  # the reference, before any scaling
        stop, got, errors = threading.Event(), [], []

        def load(rate: float) -> None:  # open loop: a request every 1/rate s, whatever the answers do
            with ThreadPoolExecutor(32) as pool:
                i = 0
                while not stop.is_set():
                    p = PROMPTS[i % len(PROMPTS)]
                    fut = pool.submit(_complete, base, p)
                    fut.add_done_callback(lambda f, p=p: errors.append(f.exception()) if f.exception()
                                          else got.append((p, f.result(), time.monotonic())))
                    i += 1
                    time.sleep(1 / rate(time.monotonic()) if callable(rate) else 1 / rate)

        heavy = {"rate": 6.0}
        t = threading.Thread(target=load, args=(lambda _now: heavy["rate"],), daemon=True)
        t.start()
        _wait_for(lambda: _workers(base) == {"prefill": 2, "decode": 2}, 150, "no scale-up to 2 + 2", cl.log)
        heavy["rate"] = 0.5  # the load drops; requests keep arriving while the extra pods drain
        dropped_at = time.monotonic()
        _wait_for(lambda: _workers(base) == {"prefill": 1, "decode": 1}
                  and sum("drained and exited" in line for line in cl.log) >= 2, 120,
                  "no scale-down to 1 + 1 with both extra workers drained", cl.log)
        time.sleep(2)
        stop.set()
        t.join(timeout=150)
        history = httpx.get(f"http://127.0.0.1:{planner_port}/decision", timeout=10).json()["history"]
    finally:
        stop_local(cl.proc)
    assert not errors, errors[:3]
    assert got and all(text == want[p] for p, text, _ in got), [x for x in got if x[1] != want[x[0]]][:3]
    assert sum(1 for *_, done in got if done > dropped_at + 3) >= 3, "no request was served during the scale-down"
    desired = [(h["desired"]["prefill"], h["desired"]["decode"]) for h in history if h["desired"]]
    assert (2, 2) in desired and desired[-1] == (1, 1), desired
    assert any("retiring prefill-1" in line for line in cl.log) and any("retiring decode-1" in line for line in cl.log)
