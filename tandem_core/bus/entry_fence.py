"""Fenced commits of a consumer-group entry: a prefill pod's token 0, ready notice and ack of one
admission entry reach Redis only while that entry is still pending to the pod, so a pod that
wakes up after its work was reclaimed (SIGSTOP, a long GC or VM pause) publishes nothing twice.
The decode pods' token writes are fenced the same way on their running hash (bus/token_stream.py).

Why the consumer group's pending list is the fence, and who can still write, in which order:
- An admission entry is pending to exactly one consumer at a time. XREADGROUP `>` hands out only
  entries never delivered; XCLAIM (a reclaimer taking a dead pod's entries) moves one from its
  owner to the claimer in one command; XACK removes it. Nothing else changes the owner.
- `commit` is one script: it reads the owner (XPENDING of that one id) and, only if it is this
  consumer, does the writes, then XACKs and XDELs the entry. Scripts run alone, so no XCLAIM
  falls between the check and the writes.
- So for an entry first claimed by A and reclaimed by B: if A commits before B's XCLAIM, the
  entry is gone and B's XCLAIM returns nothing (B does no work); if B's XCLAIM comes first, A's
  commit writes nothing, and B (or whoever reclaims from B) is the only one who still can. Either
  way one commit per entry succeeds. A's ack is fenced too: an unfenced XACK by a woken A would
  remove the entry from B's pending list under B's feet, and B's own commit would then be
  fenced off, losing the request.
- The same consumer name is not split by this fence (a pod restarted under its own id reclaims
  its own entries): that pod's earlier process is gone, and a second commit of an entry already
  committed finds it acked and writes nothing.

What this module must not know: what the writes are. `EntryWrites` records the XADD/EXPIRE/SADD calls
that the `bus.token_stream` and `bus.ready` helpers (`add_tokens`, `add_ready`, `add_prompt_logprobs`) queue on a
pipeline, so the fenced writes are exactly the ones the unfenced code writes. Every key touched is
passed to the script in KEYS, as Redis Cluster requires (the keys must then share a slot, as the
transaction this replaces required too).
"""
from __future__ import annotations

from typing import Any, Awaitable, Callable

import redis.asyncio as aioredis

# KEYS[1]: the entry's stream; KEYS[2..]: the keys the writes touch. ARGV[1] group, ARGV[2]
# consumer, ARGV[3] entry id, then the writes in order, each one of
#   'x', key index, maxlen ('' = none), '~' or '=', field count n, then n values (name, value, ...)
#   'e', key index, seconds
#   's', key index, member (SADD)
# Returns 1 (written and acked) or 0 (the entry is no longer pending to this consumer: nothing
# written). XPENDING goes through pcall: a stream or group deleted meanwhile (a dead pod's per-pod
# stream forgotten once drained) reads as "not pending", not as an error.
_COMMIT_IF_PENDING = """
local p = redis.pcall('XPENDING', KEYS[1], ARGV[1], ARGV[3], ARGV[3], 1)
if type(p) ~= 'table' or p.err or #p == 0 or p[1][2] ~= ARGV[2] then return 0 end
local i = 4
while i <= #ARGV do
  local key = KEYS[tonumber(ARGV[i + 1])]
  if ARGV[i] == 'x' then
    local args, n = {key}, tonumber(ARGV[i + 4])
    if ARGV[i + 2] ~= '' then
      args[#args + 1] = 'MAXLEN'; args[#args + 1] = ARGV[i + 3]; args[#args + 1] = ARGV[i + 2]
    end
    args[#args + 1] = '*'
    for k = 1, n do args[#args + 1] = ARGV[i + 4 + k] end
    redis.call('XADD', unpack(args))
    i = i + 5 + n
  elseif ARGV[i] == 's' then
    redis.call('SADD', key, ARGV[i + 2])
    i = i + 3
  else
    redis.call('EXPIRE', key, ARGV[i + 2])
    i = i + 3
  end
end
redis.call('XACK', KEYS[1], ARGV[1], ARGV[3])
redis.call('XDEL', KEYS[1], ARGV[3])
return 1
"""


class EntryWrites:
    """The writes that go with one entry's ack, recorded in order. Duck-types the pipeline
    methods the `add_*` helpers call, so they can queue here unchanged."""

    def __init__(self) -> None:
        self.keys: list[str] = []
        self.args: list = []
        self._index: dict[str, int] = {}

    def __bool__(self) -> bool:
        return bool(self.args)

    def _key(self, name) -> int:
        """The key's KEYS index in the script (2..: KEYS[1] is the entry's stream)."""
        name = name.decode() if isinstance(name, bytes) else str(name)
        if name not in self._index:
            self.keys.append(name)
            self._index[name] = len(self.keys) + 1
        return self._index[name]

    def xadd(self, name, fields: dict, maxlen: int | None = None, approximate: bool = True) -> None:
        flat = [x for kv in fields.items() for x in kv]
        self.args += ["x", self._key(name), "" if maxlen is None else maxlen, "~" if approximate else "=",
                      len(flat), *flat]

    def expire(self, name, time: int) -> None:
        self.args += ["e", self._key(name), int(time)]

    def sadd(self, name, member: str) -> None:
        self.args += ["s", self._key(name), member]


class EntryFence:
    """Commits of entries of one consumer group, fenced on the entry being pending to `consumer`."""

    def __init__(self, r: aioredis.Redis, group: str, consumer: str) -> None:
        self.r, self.group, self.consumer = r, group, consumer
        self._script: Callable[..., Awaitable[Any]] | None = None  # registered on first use (a worker built without Redis never commits)

    async def commit(self, stream: str, entry_id: bytes, writes: EntryWrites | None = None) -> bool:
        """Do `writes`, then XACK and XDEL the entry, only if it is still pending to this consumer:
        True if so, False if another consumer took it over (or it is gone): nothing was written.
        With no writes it is a fenced ack."""
        if self._script is None:  # a Script: EVALSHA, and on NOSCRIPT (a restarted Redis) load and retry
            self._script = self.r.register_script(_COMMIT_IF_PENDING)
        w = writes or EntryWrites()
        got = await self._script(keys=[stream, *w.keys], args=[self.group, self.consumer, entry_id, *w.args])
        return bool(got)
