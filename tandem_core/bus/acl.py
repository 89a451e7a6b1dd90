"""The Redis ACL of each Tandem role: the commands and keys it needs, nothing else.

Written once, here; read by the chart's bundled Redis (its ACL file), by `tandem redis-acl`
(the `ACL SETUSER` lines for a managed Redis: Memorystore, ElastiCache, docs/redis-ha.md) and by
tests/integration/test_redis_acl.py, which runs each role's code paths as its user.

How the lists were made: every Redis call site of each role's code was read (the role's package
and the tandem_core modules it imports; redis-py method -> command; `redis.call` inside the Lua
scripts, which Redis checks against the caller's user too), and the union was checked against
what the integration tests actually send (MONITOR over test_bus_contract, test_decode_claims,
test_resume, test_pod_streams, test_planner, test_claim, test_prefill_fence, test_worker_pod,
test_decode_handback): every command seen there from Tandem's code is in a list (the rest came
from the tests themselves: FLUSHDB, TTL, XREVRANGE, HEXISTS).

Keys: every key Tandem uses starts with `tandem:` (tandem_core/keys.py), so `~tandem:*`. No
pub/sub: no channels (`resetchannels`). No role may run FLUSHALL, CONFIG, KEYS, DEBUG, ACL, ...
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass

KEY_PATTERNS: tuple[str, ...] = ("tandem:*",)

# Every connection: redis-py's PING (health checks), CLIENT SETNAME (the services name their
# connections), SELECT (a URL naming a database other than 0), INFO (the start-up probe of
# tandem_core/redis_client.py, the heartbeat's server run_id), GET/SET (the shard-count check,
# tandem_core/bus/conn.py). Not CLIENT SETINFO, which redis-py sends too and whose refusal it
# ignores: Redis before 7.2 has no such subcommand, and 7.0 refuses a rule naming it.
_CONNECTION = ("ping", "info", "client|setname", "select", "get", "set")

# The Lua scripts' own commands (admission enqueue/forget, the fenced commit, the owned
# publish, own-and-ack, resume, preempt, forget-pod-ready), checked against the caller's user.
_SCRIPTS = ("eval", "evalsha", "script|load",
            "del", "exists", "expire", "get", "set", "hdel", "hexists", "hget", "hset", "sadd", "srem",
            "xack", "xadd", "xdel", "xlen")

# What a worker pod (prefill or decode) calls besides: claims (consumer groups), reclaim of dead
# consumers' entries (XPENDING, XCLAIM), the running hash and recovery (SCAN of running hashes,
# MULTI/EXEC of a resume), the registry (heartbeat hash and sorted set), cancel keys.
_WORKER = (*_CONNECTION, *_SCRIPTS,
           "xgroup|create", "xreadgroup", "xread", "xrange", "xpending", "xclaim",
           "hgetall", "mget", "smembers", "scan", "zadd", "zrange", "zrem", "multi", "exec")


@dataclass(frozen=True)
class RoleAcl:
    """One role's Redis user: `commands` (`name` or `name|subcommand`) on keys `keys`."""

    role: str
    commands: tuple[str, ...]
    keys: tuple[str, ...] = KEY_PATTERNS

    @property
    def username(self) -> str:
        return f"tandem-{self.role}"

    def rules(self) -> list[str]:
        """The user's ACL rules without its password: off nothing, reset everything first."""
        return (["on", "resetkeys", "resetchannels", "-@all"]
                + [f"+{c}" for c in sorted(set(self.commands))] + [f"~{k}" for k in self.keys])

    def setuser_args(self, password: str) -> list[str]:
        """`ACL SETUSER` arguments (for redis-py's execute_command): reset, then the rules."""
        return [self.username, "reset", f">{password}", *self.rules()]

    def acl_file_line(self, password: str) -> str:
        """The user's line in a Redis ACL file (`aclfile`): the password as its SHA-256, so the
        file never holds it in the clear."""
        digest = hashlib.sha256(password.encode()).hexdigest()
        return " ".join(["user", self.username, "reset", f"#{digest}", *self.rules()])


ROLES: dict[str, RoleAcl] = {
    # admission (enqueue script, per-pod stream set), the token reader (XREAD of token and wake
    # streams), cancel and resume keys (a MULTI/EXEC resume record), load reports, the registry
    # read behind /admin/cluster and the backlog check (XLEN, SMEMBERS of the per-pod sets).
    "gateway": RoleAcl("gateway", (*_CONNECTION, *_SCRIPTS,
                                   "xgroup|create", "xread", "xrange", "hget", "hgetall", "hincrby", "mget", "smembers",
                                   "zadd", "zrange", "zrem", "multi", "exec")),
    "prefill": RoleAcl("prefill", _WORKER),
    # the decode pod's steal pass also reads XINFO GROUPS (tandem_core/bus/steal.py)
    "decode": RoleAcl("decode", (*_WORKER, "xinfo|groups")),
    # reads: gateways' load reports, the registry, the backlogs (XLEN, SMEMBERS); writes: its
    # decision hash (mode local) and the pruning of expired reports (ZREM)
    "planner": RoleAcl("planner", (*_CONNECTION, "xlen", "smembers", "hgetall", "hset", "zrange", "zrem")),
}


def setuser_commands(passwords: dict[str, str]) -> list[str]:
    """`ACL SETUSER ...` lines, one a role of `passwords` (role -> password), for redis-cli."""
    return [" ".join(["ACL", "SETUSER", *ROLES[role].setuser_args(pw)]) for role, pw in passwords.items()]
