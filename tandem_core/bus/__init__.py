"""The Redis bus: every key of `tandem_core.keys` is written and read through one module here.

- `conn`: the client, the shard-count check, what an outage raises (`REDIS_DOWN`, `retry_redis`).
- `groups`: consumer-group mechanics (claim, doorbell, ack) for the admission and ready streams.
- `admission`: the admission streams (the gateway's enqueue, the backlog readers, per-pod streams).
- `ready`: the ready notices (a prefill result waiting for a decode slot).
- `token_stream`: the per-request token streams, their entry encoding and the decode pods' fenced
  writes.
- `entry_fence`: a prefill pod's fenced commit of one admission entry (token 0, ready, ack).
- `registry`: worker heartbeats and the server id.
- `reclaim`: work pending to dead consumers, a dead decode pod's running requests.
- `cancel`: cancel keys.
- `recovery`: resuming a request from the tokens its stream already holds.

Services use these modules instead of building keys or fields themselves; the engine knows none
of them. `KeySpace` (re-exported from the key table) is the deployment's key shards: each service
builds one from its settings (`KeySpace(settings.redis.shard_count())`) and passes it to the calls
that build a shard's keys.
"""
from tandem_core.keys import KeySpace

__all__ = ["KeySpace"]
