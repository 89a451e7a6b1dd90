"""The Redis key schema: every key and field Tandem writes, in one place.

Key shards. A request's keys, and the pool streams it passes through, carry the hash tag of its
shard, `{T}` below (`ks.request_tag(request_id)`, one of `ks.shards`: redis.shards, 1 on a plain
Redis, 16 on a Redis Cluster by default). Those keys are built by a `KeySpace`, which each service
builds once from its settings and passes to the bus; the rest are plain functions here. So every script and MULTI/EXEC Tandem runs touches
one slot: the prefill pod's fenced commit (admission entry, token 0, ready notice), the decode
pod's fenced token write (its running hash of that shard, the token streams), the gateway's
enqueue (stream, marker, pod set) and a resume (running hash, admission stream). The tags are
chosen so shard i hashes into the i-th of `ks.shards` equal slot ranges: on nodes that own
equal contiguous ranges the shards spread evenly. Readers of a pool's streams read every shard's;
with more than one shard, writers ring the pool's doorbell after enqueueing (no blocking read can
span slots), and a gateway runs one token reader per shard.

Keys (all prefixed `tandem:`; `<x>` is a value, `{...}` a hash tag):
| key | type | written by | read by | bound |
| --- | --- | --- | --- | --- |
| `tandem:{T}:<pool>:adm:<priority>` | stream, group `prefill` | gateway (XADD) | prefill (XREADGROUP) | MAXLEN ~ admission bound |
| `tandem:{T}:<pool>:adm:<priority>:pod:<worker_id>` | stream, group `prefill` | gateway (prefix routing) | that prefill pod first; any pod once it is dead | MAXLEN ~ admission bound |
| `tandem:{T}:<pool>:podstreams` | set of worker ids | gateway (SADD with each routed XADD) | prefill pods' reclaim (removed, with the streams, once dead and empty) | one per pod |
| `tandem:{T}:<pool>:direct` | stream, group `decode` | gateway (short prompts) | decode (prefills locally) | MAXLEN ~ |
| `tandem:{T}:<pool>:ready` | stream, group `decode` | prefill (XADD) | decode (XREADGROUP COUNT = free slots) | MAXLEN ~ |
| `tandem:{T}:<pool>:ready:pod:<worker_id>` | stream, group `decode` | prefill (the request's `decode_pod`) | that decode pod first; any pod once an entry waited `affinity_wait_ms` | MAXLEN ~ |
| `tandem:{T}:<pool>:podready` | set of worker ids | prefill (SADD with each steered XADD) | decode pods' steal and reclaim (removed, with the stream, once dead and empty) | one per pod |
| `tandem:{<pool>.bell}:<group>` | stream | enqueuers, with more than one shard | idle readers of the group (one XREAD BLOCK) | MAXLEN ~ 64 |
| `tandem:{T}:tok:<request_id>` | stream | prefill (index 0), decode (1..) | gateway (one XREAD BLOCK per shard over its streams) | MAXLEN, EXPIRE ttl |
| `tandem:{T}:gwwake:<gateway_id>` | stream | the gateway subscribing a new request | the same gateway's token reader of shard T | MAXLEN ~ 16, EXPIRE 1 h |
| `tandem:{T}:admitted:<request_id>` | string: admission entry id | gateway (in the enqueue script) | gateway (a retried enqueue) | EXPIRE 120 s |
| `tandem:{T}:cancel:<request_id>` | string | gateway | prefill, decode | EXPIRE ttl |
| `tandem:{T}:running:<worker_id>` | hash request id -> GenerationRequest JSON | decode (on taking a request) | decode recovery | at most `slots` fields in all |
| `tandem:recovering:<worker_id>` | string lock | the pod recovering a dead one | same | EXPIRE 30 s (`recovering_lock_ttl_s`) |
| `tandem:{T}:resume:<request_id>:<index>` | string: the attempt resumed | whoever resumes the request from `index` (one script with the re-enqueue) | same | EXPIRE 120 s (`resume_marker_ttl_s`) |
| `tandem:{T}:gwresume:<request_id>` | hash | gateway (resumable requests) | gateway resume endpoint | EXPIRE (gateway/resume.py) |
| `tandem:meta:shards` | string: the deployment's shard count | the first service to start (SET NX) | every service at start | one |
| `tandem:worker:<worker_id>` | hash | each worker's heartbeat | gateway /admin/cluster | EXPIRE 3 heartbeats |
| `tandem:workers` | sorted set id -> last heartbeat | each worker | gateway | pruned by readers |
| `tandem:gwload:<gateway_id>` | hash: cumulative load counts (tandem_core/load_report.py) | each gateway replica | planner | EXPIRE 30 s |
| `tandem:gateways` | sorted set id -> last load report | each gateway replica | planner | pruned by readers |
| `tandem:planner:<pool>:decision` | hash `prefill`, `decode`, `ts`, `reason` | planner (mode local) | `tandem local --planner` | one per pool |

Fences: a decode pod writes a request's tokens only while the request is in its running hash
(tandem_core/bus/token_stream.py); a prefill pod writes token 0 and the ready notice, and acks the
admission entry, only while that entry is pending to it in group `prefill` (the consumer group's
pending list is the fence: XCLAIM moves it; tandem_core/bus/entry_fence.py). No extra key is needed.

Fields:
- admission and direct entries: `rid` (request id), `req` (GenerationRequest JSON)
- ready entry: `rid`, `notice` (ReadyNotice JSON: request, prefill address, capability, kv bytes)
- token entry: `i` (token index, 0-based), `t` (token id, -1 for none), optional `f` (finish reason,
  last entry only), optional `e` (error message, with `f`=`error`)
- worker hash: `role`, `id`, `pid`, `address`, `slots`, `free_slots`, `held_kv_bytes`, `ts`
"""
from __future__ import annotations

import zlib
from dataclasses import dataclass
from functools import lru_cache

from redis.crc import REDIS_CLUSTER_HASH_SLOTS, key_slot

from tandem_core.types import CHOICE_SEP  # a choice's id is its parent's, this, and its index

PREFIX = "tandem"
PREFILL_GROUP = "prefill"
DECODE_GROUP = "decode"
PRIORITIES = ("high", "normal")  # highest first
WORKERS = f"{PREFIX}:workers"
GATEWAYS = f"{PREFIX}:gateways"
SHARDS_KEY = f"{PREFIX}:meta:shards"


@lru_cache(maxsize=None)
def _tags(n: int) -> tuple[str, ...]:
    """One hash tag per shard, tag i hashing into the i-th of n equal ranges of the 16,384 slots,
    so shards spread evenly over nodes that own equal contiguous ranges (what `redis-cli
    --cluster create` and the managed services assign)."""
    out = []
    for i in range(n):
        lo, hi = i * REDIS_CLUSTER_HASH_SLOTS // n, (i + 1) * REDIS_CLUSTER_HASH_SLOTS // n
        k = 0
        while not lo <= key_slot(f"s{i}.{k}".encode()) < hi:
            k += 1
        out.append(f"{{s{i}.{k}}}")
    return tuple(out)


@dataclass(frozen=True)
class KeySpace:
    """The keys that depend on the deployment's shard count: every key with a `{T}` in the table.

    Built once per service from its settings (`KeySpace(settings.redis.shard_count())`, in its
    app) and passed to what builds those keys; `bus.conn.check_shards` holds it to the count the
    deployment recorded in Redis. A test builds its own (`KeySpace(1)` on a plain Redis)."""

    shards: int

    def __post_init__(self) -> None:
        if not 1 <= self.shards <= 1024:
            raise ValueError(f"redis.shards must be 1..1024, got {self.shards}")

    def all_shards(self) -> range:
        return range(self.shards)

    def request_shard(self, request_id: str) -> int:
        """The shard of a request's keys and of the pool streams it passes through. A choice of
        an n > 1 request (types.choice_id) has its parent's: their first tokens are written
        together."""
        if self.shards == 1:
            return 0
        parent = request_id.split(CHOICE_SEP, 1)[0]
        return zlib.crc32(parent.encode()) % self.shards

    def tag(self, shard: int) -> str:
        """`{...}`: the part of a key Redis Cluster hashes, so keys with one tag share a slot."""
        return _tags(self.shards)[shard]

    def request_tag(self, request_id: str) -> str:
        return self.tag(self.request_shard(request_id))

    def admission_stream(self, pool: str, priority: str, shard: int) -> str:
        return f"{PREFIX}:{self.tag(shard)}:{pool}:adm:{priority}"

    def admission_streams(self, pool: str, priority: str) -> list[str]:
        """One priority's shared admission streams, every shard."""
        return [self.admission_stream(pool, priority, s) for s in self.all_shards()]

    def pod_admission_stream(self, pool: str, priority: str, worker_id: str, shard: int) -> str:
        """Prompts the gateway routed to one prefill pod, likeliest to hold their prefix in its
        cache. That pod reads it before the shared stream of the same priority; when it is dead,
        any pod does."""
        return f"{self.admission_stream(pool, priority, shard)}:pod:{worker_id}"

    def pod_streams_set(self, pool: str, shard: int) -> str:
        """Worker ids that may have per-pod admission streams in `shard` (so a dead pod's are
        found and drained)."""
        return f"{PREFIX}:{self.tag(shard)}:{pool}:podstreams"

    def direct_stream(self, pool: str, shard: int) -> str:
        """Prompts the gateway routes straight to decode pods (conditional disaggregation)."""
        return f"{PREFIX}:{self.tag(shard)}:{pool}:direct"

    def ready_stream(self, pool: str, shard: int) -> str:
        return f"{PREFIX}:{self.tag(shard)}:{pool}:ready"

    def pod_ready_stream(self, pool: str, worker_id: str, shard: int) -> str:
        """Ready notices the gateway steered to one decode pod, likeliest to hold their prompt's
        leading KV blocks (`GenerationRequest.decode_pod`). That pod reads it before the shared
        ready stream; any other takes an entry left unread there for `affinity_wait_ms`, and a
        dead pod's pending ones are reclaimed as the shared stream's are."""
        return f"{self.ready_stream(pool, shard)}:pod:{worker_id}"

    def pod_ready_set(self, pool: str, shard: int) -> str:
        """Decode pod ids that may have per-pod ready streams in `shard` (so they are found)."""
        return f"{PREFIX}:{self.tag(shard)}:{pool}:podready"

    def token_stream(self, request_id: str) -> str:
        return f"{PREFIX}:{self.request_tag(request_id)}:tok:{request_id}"

    def gateway_wake_stream(self, gateway_id: str, shard: int) -> str:
        """A gateway's token reader of `shard` watches this stream too: an XADD ends its blocking
        read."""
        return f"{PREFIX}:{self.tag(shard)}:gwwake:{gateway_id}"

    def admitted_key(self, request_id: str) -> str:
        """The admission entry id of a request the gateway enqueued (a retried enqueue is a no-op)."""
        return f"{PREFIX}:{self.request_tag(request_id)}:admitted:{request_id}"

    def cancel_key(self, request_id: str) -> str:
        return self.cancel_prefix(self.request_shard(request_id)) + request_id

    def cancel_prefix(self, shard: int) -> str:
        """The cancel keys of `shard`'s requests are this and the request id (the decode pod's
        fenced token script looks them up from it)."""
        return f"{PREFIX}:{self.tag(shard)}:cancel:"

    def running_key(self, worker_id: str, shard: int) -> str:
        """Requests of `shard` a decode pod owns. Its token writes are fenced on this hash: once a
        recoverer removes a request from it, a paused-then-resumed owner can no longer publish
        for it."""
        return f"{PREFIX}:{self.tag(shard)}:running:{worker_id}"

    def resume_marker(self, request_id: str, index: int) -> str:
        return f"{PREFIX}:{self.request_tag(request_id)}:resume:{request_id}:{index}"

    def gateway_resume_key(self, request_id: str) -> str:
        """A resumable request's record (gateway/resume.py)."""
        return f"{PREFIX}:{self.request_tag(request_id)}:gwresume:{request_id}"


def doorbell(pool: str, group: str) -> str:
    """With more than one shard no single blocking read covers a group's streams (they live in
    different slots): writers XADD here after they enqueue, and idle readers block on it. Both
    groups' bells share one tag, so one XREAD waits on both."""
    return f"{PREFIX}:{{{pool}.bell}}:{group}"


RUNNING_PATTERN = f"{PREFIX}:*:running:*"  # SCAN match for every pod's running hashes


def running_owner(key: bytes | str) -> str:
    """The worker id of a `running_key`."""
    text = key.decode() if isinstance(key, bytes) else key
    return text.split(":running:", 1)[1]


def recovering_key(worker_id: str) -> str:
    return f"{PREFIX}:recovering:{worker_id}"


def worker_key(worker_id: str) -> str:
    return f"{PREFIX}:worker:{worker_id}"


def gateway_load_key(gateway_id: str) -> str:
    """One gateway replica's cumulative load counts, for the planner."""
    return f"{PREFIX}:gwload:{gateway_id}"


def planner_decision_key(pool: str) -> str:
    """The replicas the planner wants for `pool` (mode local: `tandem local --planner` follows it)."""
    return f"{PREFIX}:planner:{pool}:decision"
