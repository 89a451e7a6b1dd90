"""Each role runs as its own Redis ACL user (tandem_core/bus/acl.py) on a real redis-server: the
users are made from that data with ACL SETUSER, each role connects as its user through
`conn.connect` (username and password from RedisConfig), and drives the code paths the other
integration tests exercise: one request goes gateway -> prefill -> decode -> gateway with the
real enqueue script, consumer-group claims, the fenced commit, own-and-ack and the owned publish
scripts, a resume (its script), heartbeats, a dead consumer's reclaim, and the planner's ticks. No NOPERM. A command
or key outside a role's list is refused (NOPERM)."""
from __future__ import annotations

import asyncio
import json

import pytest
import redis
from redis.exceptions import NoPermissionError

from gateway.tokens import TokenMux
from planner.service import PlannerService
from tandem.redis_proc import RedisProcess
from tandem_core import keys, load_report
from tandem_core.bus import KeySpace, acl, admission, cancel, conn, entry_fence, groups, ready, reclaim, recovery, \
    registry, token_stream
from tandem_core.settings import RedisConfig
from tandem_core.types import GenerationRequest
from tests.integration.test_planner import PROFILE, settings
from tests.unit.clock import Clock

POOL = "acl"
TTL, MAXLEN = 300, 1000


@pytest.fixture(scope="module")
def acl_redis():
    """A redis-server of its own (its users must not leak into the shared one), with every
    role's user made from `acl.ROLES`; yields (url, passwords)."""
    proc = RedisProcess().start()
    passwords = {role: f"pw-{role}-{i}" for i, role in enumerate(acl.ROLES)}
    try:
        with redis.Redis.from_url(proc.url) as admin:  # the default user (no password here)
            for role, pw in passwords.items():
                assert admin.execute_command("ACL", "SETUSER", *acl.ROLES[role].setuser_args(pw)) in (b"OK", "OK", True)
        yield proc.url, passwords
    finally:
        proc.close()


def _cfg(url: str, passwords: dict[str, str], role: str) -> RedisConfig:
    return RedisConfig(url=url, username=acl.ROLES[role].username, password=passwords[role])


async def _as(url, passwords, role):
    r = conn.connect(_cfg(url, passwords, role), client_name=f"acl-{role}")  # CLIENT SETNAME, the INFO probe
    await r.ping()
    return r


async def test_each_role_runs_its_paths_as_its_own_user(acl_redis, tmp_path):
    url, pw = acl_redis
    ks = KeySpace(1)
    gw, pf, dc, pl = [await _as(url, pw, role) for role in ("gateway", "prefill", "decode", "planner")]
    mux = TokenMux(gw, ks, block_ms=200)
    try:
        # gateway: groups, one load report, the enqueue script (twice: idempotent), the backlog read,
        # the registry read, a cancel key, the token reader
        await groups.ensure_groups(gw, ks, POOL)
        await load_report.publish(gw, "gw-acl", 1, {"admitted": 1}, ttl_s=30)
        req = GenerationRequest("acl-r1", [1, 2, 3], 4)
        first = await admission.enqueue(gw, ks, POOL, req, MAXLEN)
        assert await admission.enqueue(gw, ks, POOL, req, MAXLEN) == first
        assert await admission.total_backlog(gw, ks, POOL) == 1
        await registry.list_workers(gw)
        await cancel.request_cancel(gw, ks, "acl-other", ttl_s=30)
        mux.start()
        sub = mux.subscribe(req.request_id)

        # prefill: heartbeat, claim, a dead consumer's entry reclaimed, the fenced commit (token 0, ready)
        await groups.ensure_groups(pf, ks, POOL)
        assert await registry.heartbeat(pf, registry.WorkerInfo("prefill", "acl-p0", 1, "127.0.0.1:1"), 30)
        adm = [ks.admission_stream(POOL, p, 0) for p in keys.PRIORITIES]
        got = await groups.claim(pf, adm, keys.PREFILL_GROUP, "acl-p-dead", count=1, block_ms=100)
        assert len(got) == 1
        stream = got[0].stream
        dead = await reclaim.dead_consumer_entries(pf, stream, keys.PREFILL_GROUP, "acl-p0")
        assert [c for c, _ in dead] == ["acl-p-dead"]
        taken = await reclaim.claim_ids(pf, stream, keys.PREFILL_GROUP, "acl-p0", [i for _, i in dead], min_idle_ms=0)
        assert len(taken) == 1
        entry = taken[0]
        w = entry_fence.EntryWrites()
        token_stream.add_tokens(w, ks, req.request_id, 0, [11], None, TTL, MAXLEN)
        ready.add_ready(w, ks, POOL, ready.ReadyNotice(req, "127.0.0.1:1", "cap", 0, "acl-p0", 11), MAXLEN)
        assert await entry_fence.EntryFence(pf, keys.PREFILL_GROUP, "acl-p0").commit(stream, entry.entry_id, w)
        assert await cancel.cancelled(pf, ks, [req.request_id, "acl-other"]) == {"acl-other"}

        # decode: heartbeat, claim of the ready notice, own-and-ack, the owned publish, recovery reads
        assert await registry.heartbeat(dc, registry.WorkerInfo("decode", "acl-d0", 1, "127.0.0.1:2", 4, 4), 30)
        rdy = ready.decode_streams(ks, POOL)
        got = await groups.claim(dc, rdy, keys.DECODE_GROUP, "acl-d0", count=4, block_ms=100)
        assert len(got) == 1
        pub = token_stream.OwnedPublisher(dc, ks, "acl-d0", TTL, MAXLEN, 30)
        await pub.load()
        assert pub.can_own_and_ack(req.request_id, got[0].stream)
        await pub.own_and_ack(req, got[0].stream, keys.DECODE_GROUP, got[0].entry_id)
        assert "acl-d0" in await reclaim.running_owners(dc)
        assert set(await reclaim.running_requests(dc, ks, "acl-d0")) == {req.request_id}
        items = [token_stream.TokenEntry(req.request_id, 1, 12), token_stream.TokenEntry(req.request_id, 2, 13, "stop")]
        assert await pub.write(items, cancels=True) == [1, 1]
        # a recovery: a request owned by this pod, resumed (the resume script re-enqueues it)
        req2 = GenerationRequest("acl-r2", [1, 2], 4)
        await pub.own(req2)
        assert await recovery.resume(dc, ks, POOL, req2, max_attempts=3, maxlen=MAXLEN, token_ttl_s=TTL,
                                     token_maxlen=MAXLEN, why="acl test", owner="acl-d0") == "resumed"
        assert await reclaim.lock_recovery(dc, "acl-d9", "acl-d0", 30)
        await reclaim.unlock_recovery(dc, "acl-d9")
        await pub.disown(req.request_id)

        # the gateway reads the whole stream: token 0 from prefill, 1 and 2 from decode
        events, end = [], asyncio.get_running_loop().time() + 20
        while len(events) < 3 and asyncio.get_running_loop().time() < end:
            events += await sub.get(0.5)
        assert [(e.index, e.token_id, e.finish_reason) for e in events] == [(0, 11, None), (1, 12, None), (2, 13, "stop")]

        # planner: two ticks (local mode: it writes its decision), reading reports, registry, backlogs
        profile = tmp_path / "profile.json"
        profile.write_text(json.dumps(PROFILE))
        s = settings(url, POOL, str(profile), mode="local", interval_s=10)
        clock = Clock(100.0)
        svc = PlannerService(s, pl, clock=clock)
        d = await svc.tick()  # a Redis error (NOPERM too) would be a hold "Redis unreachable: ..."
        assert d.held.startswith("first interval"), d.held
        await load_report.publish(gw, "gw-acl", 1, {"admitted": 5, "prompt_tokens": 50}, ttl_s=30)
        clock.t += 10
        d = await svc.tick()
        assert "Redis" not in (d.held or ""), d.held
        if not d.held:  # decided: written to its decision hash (mode local)
            assert await gw.exists(keys.planner_decision_key(POOL))
    finally:
        await mux.stop()
        for c in (gw, pf, dc, pl):
            await c.aclose()


@pytest.mark.parametrize("role,cmd", [
    ("gateway", ("FLUSHALL",)),                         # a command of no role
    ("gateway", ("CONFIG", "GET", "maxmemory")),
    ("planner", ("XADD", "tandem:x", "*", "a", "1")),   # another role's command
    ("planner", ("EVAL", "return 1", "0")),
    ("prefill", ("KEYS", "tandem:*")),
    ("decode", ("SET", "other:x", "1")),                # a key outside tandem:*
    ("gateway", ("ACL", "LIST")),
])
async def test_a_command_or_key_outside_a_roles_list_is_refused(acl_redis, role, cmd):
    url, pw = acl_redis
    r = await _as(url, pw, role)
    try:
        with pytest.raises(NoPermissionError):
            await r.execute_command(*cmd)
    finally:
        await r.aclose()


async def test_a_script_checks_its_commands_against_the_caller(acl_redis):
    """Redis checks what a script calls against the user running it: the planner may not EVAL,
    and the gateway's EVAL of a command outside its list fails inside the script."""
    url, pw = acl_redis
    r = await _as(url, pw, "gateway")
    try:
        with pytest.raises(redis.exceptions.ResponseError, match="(?i)NOPERM|can.t run this command"):
            await r.eval("return redis.call('FLUSHALL')", 0)
    finally:
        await r.aclose()


def test_setuser_lines_name_every_role():
    lines = acl.setuser_commands({role: "PW" for role in acl.ROLES})
    assert [ln.split()[2] for ln in lines] == [f"tandem-{role}" for role in acl.ROLES]
    assert all(" >PW " in ln and "~tandem:*" in ln and " -@all " in ln for ln in lines)
