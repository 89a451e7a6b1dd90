"""The Redis key schema: every key and field Tandem writes, in one place.

Keys (all prefixed `tandem:`):
| key | type | written by | read by | bound |
| --- | --- | --- | --- | --- |
| `tandem:{pool}:adm:{priority}` | stream, group `prefill` | gateway (XADD) | prefill (XREADGROUP) | MAXLEN ~ admission bound |
| `tandem:{pool}:adm:{priority}:pod:{worker_id}` | stream, group `prefill` | gateway (prefix routing) | that prefill pod first; any pod once it is dead | MAXLEN ~ admission bound |
| `tandem:{pool}:podstreams` | set of worker ids | gateway (SADD with each routed XADD) | prefill pods' reclaim (removed, with the streams, once dead and empty) | one per pod |
| `tandem:{pool}:direct` | stream, group `decode` | gateway (short prompts) | decode (prefills locally) | MAXLEN ~ |
| `tandem:{pool}:ready` | stream, group `decode` | prefill (XADD) | decode (XREADGROUP COUNT = free slots) | MAXLEN ~ |
| `tandem:tok:{request_id}` | stream | prefill (index 0), decode (1..) | gateway (one XREAD BLOCK over all its streams) | MAXLEN, EXPIRE ttl |
| `tandem:gwwake:{gateway_id}` | stream | the gateway subscribing a new request | the same gateway's token reader | MAXLEN ~ 16, EXPIRE 1 h |
| `tandem:admitted:{request_id}` | string: admission entry id | gateway (in the enqueue script) | gateway (a retried enqueue) | EXPIRE 120 s |
| `tandem:cancel:{request_id}` | string | gateway | prefill, decode | EXPIRE ttl |
| `tandem:running:{worker_id}` | hash request id -> GenerationRequest JSON | decode (on taking a request) | decode recovery | at most `slots` fields |
| `tandem:recovering:{worker_id}` | string lock | the pod recovering a dead one | same | EXPIRE 30 s |
| `tandem:resume:{request_id}:{index}` | string | whoever resumes the request from `index` | same (SET NX) | EXPIRE token ttl |
| `tandem:gw:resume:{request_id}` | string | gateway (resumable requests) | gateway resume endpoint | EXPIRE (gateway/resume.py) |
| `tandem:worker:{worker_id}` | hash | each worker's heartbeat | gateway /admin/cluster | EXPIRE 3 heartbeats |
| `tandem:workers` | sorted set id -> last heartbeat | each worker | gateway | pruned by readers |
| `tandem:gwload:{gateway_id}` | hash: cumulative load counts (tandem_core/load_report.py) | each gateway replica | planner | EXPIRE 30 s |
| `tandem:gateways` | sorted set id -> last load report | each gateway replica | planner | pruned by readers |
| `tandem:planner:{pool}:decision` | hash `prefill`, `decode`, `ts`, `reason` | planner (mode local) | `tandem local --planner` | one per pool |

Fences: a decode pod writes a request's tokens only while the request is in its running hash
(tandem_core/token_writes.py); a prefill pod writes token 0 and the ready notice, and acks the
admission entry, only while that entry is pending to it in group `prefill` (the consumer group's
pending list is the fence: XCLAIM moves it; tandem_core/entry_fence.py). No extra key is needed.

Fields:
- admission and direct entries: `rid` (request id), `req` (GenerationRequest JSON)
- ready entry: `rid`, `notice` (ReadyNotice JSON: request, prefill address, capability, kv bytes)
- token entry: `i` (token index, 0-based), `t` (token id, -1 for none), optional `f` (finish reason,
  last entry only), optional `e` (error message, with `f`=`error`)
- worker hash: `role`, `id`, `pid`, `address`, `slots`, `free_slots`, `held_kv_bytes`, `ts`
"""
from __future__ import annotations

PREFIX = "tandem"
PREFILL_GROUP = "prefill"
DECODE_GROUP = "decode"
PRIORITIES = ("high", "normal")  # highest first
WORKERS = f"{PREFIX}:workers"
GATEWAYS = f"{PREFIX}:gateways"


def admission_stream(pool: str, priority: str) -> str:
    return f"{PREFIX}:{pool}:adm:{priority}"


def pod_admission_stream(pool: str, priority: str, worker_id: str) -> str:
    """Prompts the gateway routed to one prefill pod, likeliest to hold their prefix in its cache.
    That pod reads it before the shared stream of the same priority; when it is dead, any pod does."""
    return f"{admission_stream(pool, priority)}:pod:{worker_id}"


def pod_streams_set(pool: str) -> str:
    """Worker ids that may have per-pod admission streams (so a dead pod's are found and drained)."""
    return f"{PREFIX}:{pool}:podstreams"


def direct_stream(pool: str) -> str:
    """Prompts the gateway routes straight to decode pods (conditional disaggregation)."""
    return f"{PREFIX}:{pool}:direct"


def ready_stream(pool: str) -> str:
    return f"{PREFIX}:{pool}:ready"


def token_stream(request_id: str) -> str:
    return f"{PREFIX}:tok:{request_id}"


def gateway_wake_stream(gateway_id: str) -> str:
    """A gateway's token reader watches this stream too: an XADD ends its blocking read."""
    return f"{PREFIX}:gwwake:{gateway_id}"


def admitted_key(request_id: str) -> str:
    """The admission entry id of a request the gateway enqueued (a retried enqueue is a no-op)."""
    return f"{PREFIX}:admitted:{request_id}"


def cancel_key(request_id: str) -> str:
    return f"{PREFIX}:cancel:{request_id}"


def running_key(worker_id: str) -> str:
    """Requests a decode pod owns. Its token writes are fenced on this hash: once a recoverer
    removes a request from it, a paused-then-resumed owner can no longer publish for it."""
    return f"{PREFIX}:running:{worker_id}"


def recovering_key(worker_id: str) -> str:
    return f"{PREFIX}:recovering:{worker_id}"


def resume_marker(request_id: str, index: int) -> str:
    return f"{PREFIX}:resume:{request_id}:{index}"


def worker_key(worker_id: str) -> str:
    return f"{PREFIX}:worker:{worker_id}"


def gateway_load_key(gateway_id: str) -> str:
    """One gateway replica's cumulative load counts, for the planner."""
    return f"{PREFIX}:gwload:{gateway_id}"


def planner_decision_key(pool: str) -> str:
    """The replicas the planner wants for `pool` (mode local: `tandem local --planner` follows it)."""
    return f"{PREFIX}:planner:{pool}:decision"
