"""Token streams: one per request (KeySpace.token_stream), written by the pod that produces its
tokens and read by the gateway relaying them (gateway/tokens.py). Every entry carries its index, so
a reader drops duplicates and finds gaps; streams have a MAXLEN and expire.
"""
from __future__ import annotations

import asyncio
import struct
from dataclasses import dataclass

import redis.asyncio as aioredis
from redis.crc import key_slot
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoScriptError, ReadOnlyError, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from tandem_core import redis_client
from tandem_core.keys import KeySpace
from tandem_core.types import GenerationRequest, TokenLogprobs


@dataclass
class TokenEvent:
    index: int
    token_id: int
    finish_reason: str | None = None
    error: str | None = None
    entry_id: bytes = b""
    logprobs: TokenLogprobs | None = None  # field `l`, when the request asked for logprobs
    prompt_logprobs: bytes | None = None  # field `p` of the index -1 entry (echo with logprobs)


def entry_fields(index: int, token: int, finish: str | None = None, error: str | None = None,
                 logprobs: str | None = None, prompt_logprobs: str | None = None) -> dict[str, str | int]:
    """The one encoding of a token stream entry, for every writer (`add_tokens` on a pipeline or a
    fenced commit, and the decode pods' fenced script, which writes these fields as given): `i`
    index, `t` token (-1: none), and when set `l` the token's logprobs (`TokenLogprobs.encode`),
    `p` the prompt's logprobs (the index -1 entry of an echo), `f` finish, `e` error."""
    fields: dict[str, str | int] = {"i": index, "t": token}
    if logprobs:
        fields["l"] = logprobs
    if prompt_logprobs:
        fields["p"] = prompt_logprobs
    if finish:
        fields["f"] = finish
        if error:
            fields["e"] = error
    return fields


def add_tokens(
    pipe,
    ks: KeySpace,
    request_id: str,
    start_index: int,
    token_ids: list[int],
    finish_reason: str | None,
    ttl_s: int,
    maxlen: int,
    error: str | None = None,
    finished_ttl_s: int = 60,
    logprobs: list[TokenLogprobs | None] | None = None,
) -> None:
    """Queue XADDs for consecutive tokens of one request on `pipe` (no round trip here), unfenced.
    The last one carries `finish_reason` (and `error`); an end with no token is written `t=-1`."""
    key = ks.token_stream(request_id)
    ids = token_ids or [-1]
    for n, tok in enumerate(ids):
        lp = logprobs[n] if logprobs and n < len(logprobs) else None
        last = n == len(ids) - 1
        fields = entry_fields(start_index + n, tok, finish_reason if last else None, error if last else None,
                              lp.encode() if lp is not None else None)
        pipe.xadd(key, fields, maxlen=maxlen, approximate=True)
    # A finished stream stays just long enough for a dropped client to resume and read its end.
    pipe.expire(key, finished_ttl_s if finish_reason else ttl_s)


@dataclass(frozen=True)
class StreamBounds:
    """How long a token stream lives and how long it may grow: a worker's `token_ttl_s`,
    `token_maxlen` and `token_finished_ttl_s` (`StreamBounds.of(settings)`)."""

    ttl_s: int
    maxlen: int
    finished_ttl_s: int = 60

    @classmethod
    def of(cls, settings) -> StreamBounds:
        return cls(settings.token_ttl_s, settings.token_maxlen, settings.token_finished_ttl_s)


def add_finish(pipe, ks: KeySpace, request_ids: list[str], index: int, reason: str, bounds: StreamBounds,
               error: str | None = None) -> None:
    """Queue each request's end without a token (`t=-1`, finish `reason`, and `error` if set) at
    `index` on `pipe` (a pipeline, or a prefill pod's fenced `EntryWrites`): how a worker ends a
    request it cannot answer (cancelled, past its deadline, failed, its KV never pulled)."""
    for rid in request_ids:
        add_tokens(pipe, ks, rid, index, [], reason, bounds.ttl_s, bounds.maxlen, error=error,
                   finished_ttl_s=bounds.finished_ttl_s)


async def write_finish(r: aioredis.Redis, ks: KeySpace, request_ids: list[str], index: int, reason: str,
                       bounds: StreamBounds, error: str | None = None) -> None:
    """`add_finish`, written now in one pipelined round trip, unfenced (the caller knows it owns
    the requests, or nothing else can answer them)."""
    pipe = r.pipeline(transaction=False)
    add_finish(pipe, ks, request_ids, index, reason, bounds, error)
    await pipe.execute()


def add_prompt_logprobs(pipe, ks: KeySpace, request_id: str, encoded: str, ttl_s: int, maxlen: int) -> None:
    """Queue the prompt's logprobs (echo) as the stream's index -1 entry, before token 0: readers
    that know nothing of it drop it as a duplicate index, and resumes ignore it (no token)."""
    key = ks.token_stream(request_id)
    pipe.xadd(key, entry_fields(-1, -1, prompt_logprobs=encoded), maxlen=maxlen, approximate=True)
    pipe.expire(key, ttl_s)


def token_event(entry_id: bytes, f: dict) -> TokenEvent:
    """One token stream entry (fields i, t and optionally f, e, l, p; see `entry_fields`)."""
    fin, err, lp = f.get(b"f"), f.get(b"e"), f.get(b"l")
    return TokenEvent(index=int(f[b"i"]), token_id=int(f[b"t"]), finish_reason=_s(fin) if fin is not None else None,
                      error=_s(err) if err is not None else None, entry_id=entry_id,
                      logprobs=TokenLogprobs.decode(lp) if lp is not None else None, prompt_logprobs=f.get(b"p"))


def read_event(entry_id: bytes, f: dict, key: str) -> tuple[TokenEvent, str | None]:
    """`token_event`, or, for an entry that cannot be read as one (a field missing or not a
    number, logprobs that do not decode), its request's end: an `error` finish without a token
    whose message names the entry and its stream, and that message as the second item (None for
    a good entry). Fields no reader knows are ignored, so a newer writer's entries still read.
    One bad entry costs its request, never the reader (issue 42)."""
    try:
        return token_event(entry_id, f), None
    except Exception as e:  # noqa: BLE001 - whatever is wrong with it, its request ends here
        why = (f"malformed token stream entry {_s(entry_id)} in {key} ({type(e).__name__}: {e}); "
               "the request cannot go on: send it again")
        return TokenEvent(index=0, token_id=-1, finish_reason="error", error=why, entry_id=entry_id), why


# ---------------------------------------------------------------- fenced writes (decode pods)
# Fenced token writes: a decode pod's tokens reach a request's token stream only while the pod
# still owns the request (its field in the pod's running hash of the request's shard, see
# `KeySpace.running_key`), so a pod that wakes up after being replaced cannot double-deliver. One script
# call per shard writes a whole step's tokens of that shard (all of them in one pipelined round
# trip, whatever the batch): a script may touch only keys of one slot on a Redis Cluster.

# A step's tokens in one call: each XADDed only while the writer still owns its request (its
# field in the writer's running hash); a finishing token removes the field. The fields come encoded
# by `entry_fields`, as every other writer's do: the script only fences, writes and sets TTLs. The
# stream's TTL is set on every REFRESH-th index (0, 16, 32, ...: a decode pod that prefilled the
# prompt itself writes token 0) and with the finish, not on every token: a third of the commands a
# token cost, and a TTL of minutes cannot run out between two refreshes of a stream still being
# written. KEYS[1] is the running hash, KEYS[1 + j] item j's token stream; ARGV: ttl, maxlen,
# finished ttl, '1' to write without the fence (tokens of a request this writer itself finished:
# see `OwnedPublisher.add_batch`) or '', the shard's cancel-key prefix (`KeySpace.cancel_prefix`:
# each written item's request is looked up there, the decode pod's cancel watch over its running
# requests folded into the step's write) or '' for none, then the items' numbers packed in one
# argument (`_pack_numbers`: per item four little-endian int32s: index, token, 1 if it finishes or
# 0, the number of further field pairs), then each item's request id, then the further field pairs
# of the items that have some, in item order (`entry_fields` after `i` and `t`, in its order).
# Returns 1 (written), 2 (written, and its request has a cancel key: the client left) or 0 (fenced
# off) per item, in order, so a request that appears twice (two queued steps) is written in index
# order. A plain token costs two arguments (its stream's key and its request id, both encoded once
# per request) and 16 bytes of the numbers: no number is formatted per token, and the script adds
# the `i` and `t` field names itself.
EXPIRE_EVERY = 16
STREAM_CACHE_MAX = 65536  # requests whose stream key `OwnedPublisher` keeps (a pod runs far fewer at once)
_PUBLISH_OWNED = """
local REFRESH = """ + str(EXPIRE_EVERY) + """
local out = {}
local unfenced = ARGV[4] == '1'
local cancels = ARGV[5]
local nums = ARGV[6]
local items = #KEYS - 1
local q = 1
local p = 7 + items
for j = 1, items do
  local rid = ARGV[6 + j]
  local index, tok, fin, n
  index, tok, fin, n, q = struct.unpack('<i4i4i4i4', nums, q)
  local first = p
  p = first + 2 * n
  if not unfenced and redis.call('HEXISTS', KEYS[1], rid) == 0 then
    out[j] = 0
  else
    redis.call('XADD', KEYS[j + 1], 'MAXLEN', '~', ARGV[2], '*', 'i', string.format('%d', index),
               't', string.format('%d', tok), unpack(ARGV, first, p - 1))
    if fin == 1 then
      redis.call('EXPIRE', KEYS[j + 1], ARGV[3])
      redis.call('HDEL', KEYS[1], rid)
    elseif index % REFRESH == 0 then
      redis.call('EXPIRE', KEYS[j + 1], ARGV[1])
    end
    out[j] = 1
    -- (the cancel key shares the request's slot: its tag)
    if cancels ~= '' and fin ~= 1 and redis.call('EXISTS', cancels .. rid) == 1 then
      out[j] = 2
    end
  end
end
return out
"""

# A pulled request owned and its ready entry acked in one call (`OwnedPublisher.own_and_ack`):
# KEYS[1] the running hash, KEYS[2] the ready stream (one slot: both carry the request's shard
# tag); ARGV: request id, request json, group, entry id. A script runs whole or not at all, so the
# entry is never acked without the request owned (the order two round trips kept before).
_OWN_AND_ACK = """
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
redis.call('XACK', KEYS[2], ARGV[3], ARGV[4])
redis.call('XDEL', KEYS[2], ARGV[4])
return 1
"""


@dataclass(frozen=True, slots=True)
class TokenEntry:
    """One token stream entry to write (`entry_fields` encodes it): the token at `index` of a
    request (-1: none), and when set its finish, error, logprobs (`TokenLogprobs.encode`) and the
    prompt's logprobs (the index -1 entry of an echo). Anything with these attributes is an entry
    to `OwnedPublisher.add_batch` (decode_svc's `Emitted` adds the ack it carries)."""

    request_id: str
    index: int
    token: int
    finish: str | None = None
    error: str | None = None
    logprobs: str | None = None
    prompt_logprobs: str | None = None


class Placed:
    """Where `add_batch` put each item: which of its script calls (the first replies of the
    pipeline, in order) and which position in that call's reply."""

    def __init__(self, calls: list[list[int]], n: int) -> None:
        self.calls, self.n = calls, n

    def __len__(self) -> int:
        return len(self.calls)

    def results(self, replies: list) -> list[int]:
        """1 (written) / 2 (written, its request cancelled: `add_batch(cancels=True)`) / 0 (fenced
        off) per item, in the items' order, from the pipeline's replies."""
        if len(self.calls) == 1:  # one shard (always on one Redis): the reply is in the items' order
            return list(map(int, replies[0]))
        out = [0] * self.n
        for call, items in enumerate(self.calls):
            for k, j in enumerate(items):
                out[j] = int(replies[call][k])
        return out


class _Call:
    """One script call of a batch (one shard): its items' cached encodings (`OwnedPublisher._entry`),
    their numbers (four per item, `_PUBLISH_OWNED`), the further field pairs, the items' positions."""

    __slots__ = ("ents", "nums", "extras", "pos")

    def __init__(self) -> None:
        self.ents: list[tuple] = []
        self.nums: list[int] = []
        self.extras: list = []
        self.pos: list[int] = []


def _bulk(x) -> bytes:
    """One RESP bulk string (bytes, str or int)."""
    if isinstance(x, str):
        x = x.encode()
    elif isinstance(x, int):
        x = b"%d" % x
    return b"$%d\r\n%b\r\n" % (len(x), x)


def _pack(*args) -> bytes:
    """One command in RESP (as redis-py would send it)."""
    return b"*%d\r\n" % len(args) + b"".join([_bulk(a) for a in args])


def _pack_numbers(nums: list[int]) -> bytes:
    return struct.pack(f"<{len(nums)}i", *nums)


class _Wire:
    """One connection of the client's pool, held for a decode pod's step writes (`OwnedPublisher.write`)
    and its other frequent commands (`OwnedPublisher.command`): each caller's commands go out
    packed, in one write, at once (pipelined behind any still in flight), and each caller reads
    its own replies in the order the writes went out. No pool checkout, no redis-py packing or
    pipeline per step: most of the event loop's CPU per step, measured (bench/loop_ops.py).

    No reply is ever read as another command's: every write takes a ticket (`_last`) and reads
    only after the previous ticket's replies are read, and only on the connection it was written
    on (`gen` counts the connections dropped). Any failure (a broken socket, a timeout, a cancel
    with replies unread) drops the connection; the callers whose replies were still due raise
    redis-py's ConnectionError (`conn.REDIS_DOWN`: retried, as a pipeline whose connection broke
    after its write), and the next write connects again (a Sentinel-managed connection asks the
    sentinels again). The client's `aclose` closes it with the pool's others."""

    def __init__(self, pool) -> None:
        self.pool = pool
        self.conn = None
        self.gen = 0  # connections dropped so far: a caller reads only on the one it wrote on
        self._last: asyncio.Future | None = None  # the latest caller's replies read (or given up)
        self._send_lock = asyncio.Lock()  # (re)connecting and writing: one caller at a time

    async def call(self, packed: bytes, n: int) -> list:
        """Send `packed` (n commands), return their n replies; a command's error (ResponseError,
        NoScriptError) is raised after every reply is read, as redis-py's pipeline raises it. A
        failed write or read raises redis-py's ConnectionError / TimeoutError (`conn.REDIS_DOWN`)."""
        async with self._send_lock:
            conn = self.conn
            if conn is None:
                conn = self.conn = await self.pool.get_connection()
            await self._connected(conn)
            gen, prev = self.gen, self._last
            mine = self._last = asyncio.get_running_loop().create_future()
            try:
                await self._send(conn, packed)
            except BaseException:
                await self._drop(conn, gen)
                _done(mine)
                raise
        replies: list = []
        first: ResponseError | None = None
        try:
            if prev is not None and not prev.done():
                await prev  # the replies written before these are read first
            if gen != self.gen:
                raise RedisConnectionError("the connection to Redis was dropped before this command's reply came")
            for _ in range(n):
                try:
                    replies.append(await conn.read_response(disconnect_on_error=False))
                except ResponseError as e:
                    replies.append(e)
                    first = first or e
        except BaseException:  # replies may still be in flight: never read them as another call's
            await self._drop(conn, gen)
            raise
        finally:
            _done(mine)
        if isinstance(first, ReadOnlyError):  # a primary demoted under it: connect again (to the new one)
            await self._drop(conn, gen)
        if first is not None:
            raise first
        return replies

    async def _drop(self, conn, gen: int) -> None:
        if gen == self.gen:  # (not one made since by a later write)
            self.gen += 1
            await conn.disconnect(nowait=True)

    async def _connected(self, conn) -> None:
        writer = conn._writer if conn.is_connected else None
        if writer is None or writer.transport.is_closing():
            if writer is not None:
                await self._drop(conn, self.gen)
            await conn.connect()

    @staticmethod
    async def _send(conn, packed: bytes) -> None:
        """Write on the connection's stream (redis-py's `send_packed_command` runs every write as a
        task under `wait_for`: most of a step's remaining CPU, measured); wait only when the socket
        is full, up to the socket timeout. tests/integration/test_step_wire.py holds the redis-py
        internals this reads (`_writer`) to the pinned versions."""
        writer = conn._writer
        try:
            writer.write(packed)
            if writer.transport.get_write_buffer_size():
                await asyncio.wait_for(writer.drain(), conn.socket_timeout)
        except asyncio.TimeoutError:
            raise RedisTimeoutError("Timeout writing to socket") from None
        except OSError as e:
            raise RedisConnectionError(f"Error while writing to socket: {e}") from e


def _done(fut: asyncio.Future) -> None:
    if not fut.done():
        fut.set_result(None)


class OwnedPublisher:
    """Token writes of a decode pod, fenced on its running hashes (see `KeySpace.running_key`)."""

    def __init__(self, r: aioredis.Redis, ks: KeySpace, worker_id: str, ttl_s: int, maxlen: int,
                 finished_ttl_s: int = 60) -> None:
        self.r, self.ks, self.worker_id = r, ks, worker_id
        self.ttl_s, self.maxlen, self.finished_ttl_s = ttl_s, maxlen, finished_ttl_s
        self._script = r.register_script(_PUBLISH_OWNED)
        self._sha = self._script.sha.encode()
        self._own_ack = r.register_script(_OWN_AND_ACK)  # (loads itself on NOSCRIPT)
        self._streams: dict[str, tuple] = {}  # request id -> `_entry`
        self._running: dict[int, bytes] = {}  # shard -> this pod's running hash there
        self._cancels: dict[int, bytes] = {}  # shard -> its cancel keys' prefix
        # (shard, fenced, cancels) -> (packed running hash, packed arguments before the numbers)
        self._fixed: dict[tuple[int, bool, bool], tuple[bytes, bytes]] = {}
        # the step writes' own connection; a Redis Cluster routes by key: its pipeline then
        pool = getattr(r, "connection_pool", None)
        self._wire = _Wire(pool) if pool is not None and not redis_client.is_cluster(r) else None

    def running(self, request_id: str) -> str:
        return self.ks.running_key(self.worker_id, self.ks.request_shard(request_id))

    async def own(self, *reqs: GenerationRequest) -> None:
        by_key: dict[str, dict[str, str]] = {}
        for q in reqs:
            by_key.setdefault(self.running(q.request_id), {})[q.request_id] = q.to_json()
        pipe = self.r.pipeline(transaction=False)
        for key, fields in by_key.items():
            pipe.hset(key, mapping=fields)
        await pipe.execute()

    def can_own_and_ack(self, request_id: str, stream: str) -> bool:
        """Whether `own_and_ack` may take this request and entry: its running hash and the stream
        share a slot (a script touches keys of one slot on a Redis Cluster)."""
        return key_slot(self.running(request_id).encode()) == key_slot(stream.encode())

    async def own_and_ack(self, req: GenerationRequest, stream: str, group: str, entry_id: bytes) -> None:
        """`own(req)`, then ack and delete the stream entry it came from, in one round trip and
        atomically (only where `can_own_and_ack`): a pulled request costs one write less, and
        no crash can fall between the two. On one Redis it goes on the step writes' connection
        (`command`)."""
        keys, args = [self.running(req.request_id), stream], [req.request_id, req.to_json(), group, entry_id]
        if self._wire is None:  # a Redis Cluster: redis-py routes the script by its keys
            await self._own_ack(keys=keys, args=args)
            return
        cmd = ("EVALSHA", self._own_ack.sha, 2, *keys, *args)
        try:
            await self.command(*cmd)
        except NoScriptError:  # a restarted Redis without the script (nothing of it ran)
            await self.r.script_load(_OWN_AND_ACK)
            await self.command(*cmd)

    async def command(self, *args):
        """One command's raw reply, on the step writes' connection (`_Wire`, pipelined behind any
        write in flight) where there is one: no pool checkout, no redis-py packing; else (a Redis
        Cluster) on the client. Only commands that answer at once (never a blocking read)."""
        wire = self._wire
        if wire is None:
            return await self.r.execute_command(*args)
        return (await wire.call(_pack(*args), 1))[0]

    @property
    def wired(self) -> bool:
        """Whether `command` and `write` use a connection of their own (one Redis, not a Cluster)."""
        return self._wire is not None

    async def disown(self, request_id: str) -> None:
        await self.r.hdel(self.running(request_id), request_id)

    def _encode(self, items: list, fenced: bool) -> dict[int, _Call]:
        """The items by shard, in order (a request's items stay in one call, so in index order)."""
        calls: dict[int, _Call] = {}
        entry = self._entry
        for j, e in enumerate(items):
            ent = entry(e.request_id)
            call = calls.get(ent[0])
            if call is None:
                call = calls[ent[0]] = _Call()
            call.ents.append(ent)
            call.pos.append(j)
            if e.finish is None and e.logprobs is None and e.prompt_logprobs is None:
                call.nums += (e.index, e.token, 0, 0)
                continue
            fields = entry_fields(e.index, e.token, e.finish, e.error, e.logprobs, e.prompt_logprobs)
            del fields["i"], fields["t"]
            call.nums += (e.index, e.token, 1 if e.finish else 0, len(fields))
            for kv in fields.items():
                call.extras += kv
            if e.finish:
                self._streams.pop(e.request_id, None)  # its last entry: the cache holds running requests only
        return calls

    def add_batch(self, pipe, items: list, fenced: bool = True, cancels: bool = False) -> Placed:
        """Queue one script call per shard writing its items (`TokenEntry`s, or anything with the
        same attributes), in order (a request's items stay in one call, so in index order);
        `Placed.results` turns the replies into 1 (written) / 0 (fenced off) per item. Queue it
        first on `pipe`. Logprobs travel pre-encoded (`TokenLogprobs.encode`). `fenced=False`
        writes without the ownership check: only for tokens of a request whose finish this writer
        wrote while it owned it (no other pod can own it since), when Redis lost some of its
        earlier tokens and their rewrite would otherwise be refused. `cancels=True`: each written
        item whose request has a cancel key (`KeySpace.cancel_key`) comes back 2, not 1 (the
        decode pod's watch over its running requests, at no round trip of its own; a finishing
        item is not looked up). A plain token (no finish, error or logprobs) is its stream's key,
        its request id (both encoded once per request, `_entry`) and four numbers in one packed
        argument (`_PUBLISH_OWNED`). `write` sends the same commands without a pipeline."""
        # EVALSHA only: no SCRIPT EXISTS round trip per step (what `pipe.scripts` would add).
        # A Redis that lost the script (a restart) answers NOSCRIPT; `load` it and retry.
        calls = self._encode(items, fenced)
        for shard, call in calls.items():
            names = [self.running_of(shard)] + [x[1] for x in call.ents]
            # (execute_command: redis-py's cluster pipeline refuses its evalsha method, but routes
            # the command itself by its keys)
            pipe.execute_command("EVALSHA", self._script.sha, len(names), *names, self.ttl_s, self.maxlen,
                                 self.finished_ttl_s, "" if fenced else "1",
                                 self.cancel_prefix_of(shard) if cancels else "", _pack_numbers(call.nums),
                                 *[x[2] for x in call.ents], *call.extras)
        return Placed([c.pos for c in calls.values()], len(items))

    async def write(self, items: list, acks: list | tuple = (), fenced: bool = True, cancels: bool = False) -> list[int]:
        """`add_batch` and then XACK + XDEL of each (stream, group, entry id) in `acks`, written in
        one round trip; 1 / 2 / 0 per item (`Placed.results`). On one Redis (or Sentinel) the
        commands are packed here and go out on a connection of their own (`_Wire`, pipelined
        behind any write still in flight); on a Redis Cluster on a redis-py pipeline. A command's
        error (NoScriptError) is raised after all replies."""
        wire = self._wire
        if wire is None:
            pipe = self.r.pipeline(transaction=False)
            placed = self.add_batch(pipe, items, fenced, cancels)
            for stream, group, entry_id in acks:
                pipe.xack(stream, group, entry_id)
                pipe.xdel(stream, entry_id)
            return placed.results(await pipe.execute())
        calls = self._encode(items, fenced)
        parts = []
        for shard, call in calls.items():
            ents, blob = call.ents, _pack_numbers(call.nums)
            nk = len(ents) + 1
            parts.append(b"*%d\r\n$7\r\nEVALSHA\r\n$40\r\n%b\r\n$%d\r\n%d\r\n" % (
                10 + 2 * len(ents) + len(call.extras), self._sha, len(str(nk)), nk))
            running, head = self._fixed_of(shard, fenced, cancels)
            parts.append(running)
            parts += [x[3] for x in ents]
            parts.append(head)
            parts.append(b"$%d\r\n%b\r\n" % (len(blob), blob))
            parts += [x[4] for x in ents]
            if call.extras:
                parts += [_bulk(x) for x in call.extras]
        for stream, group, entry_id in acks:
            parts.append(_pack("XACK", stream, group, entry_id))
            parts.append(_pack("XDEL", stream, entry_id))
        replies = await wire.call(b"".join(parts), len(calls) + 2 * len(acks))
        return Placed([c.pos for c in calls.values()], len(items)).results(replies)

    def _fixed_of(self, shard: int, fenced: bool, cancels: bool) -> tuple[bytes, bytes]:
        """The packed running hash of `shard` (KEYS[1]) and the packed arguments before the
        numbers (`write`), made once."""
        key = (shard, fenced, cancels)
        got = self._fixed.get(key)
        if got is None:
            got = self._fixed[key] = (_bulk(self.running_of(shard)), b"".join([_bulk(x) for x in (
                self.ttl_s, self.maxlen, self.finished_ttl_s, "" if fenced else "1",
                self.cancel_prefix_of(shard) if cancels else "")]))
        return got

    def _entry(self, request_id: str) -> tuple:
        """(shard, token stream key, request id, both packed as RESP) of a request, the key and id
        encoded: computed once while it runs (bounded), so a step's command is packed without
        encoding them again."""
        got = self._streams.get(request_id)
        if got is None:
            if len(self._streams) >= STREAM_CACHE_MAX:
                self._streams.clear()
            key, rid = self.ks.token_stream(request_id).encode(), request_id.encode()
            got = self._streams[request_id] = (self.ks.request_shard(request_id), key, rid, _bulk(key), _bulk(rid))
        return got

    def stream_of(self, request_id: str) -> tuple[int, bytes, bytes]:
        """(shard, token stream key, request id) of a request, the last two encoded (`_entry`)."""
        return self._entry(request_id)[:3]

    def cancel_prefix_of(self, shard: int) -> bytes:
        got = self._cancels.get(shard)
        if got is None:
            got = self._cancels[shard] = self.ks.cancel_prefix(shard).encode()
        return got

    def running_of(self, shard: int) -> bytes:
        got = self._running.get(shard)
        if got is None:
            got = self._running[shard] = self.ks.running_key(self.worker_id, shard).encode()
        return got

    async def load(self) -> None:
        """(Re)load the fenced-write script into Redis (at start, and after a NOSCRIPT): every
        primary of a Redis Cluster."""
        await self.r.script_load(_PUBLISH_OWNED)


def _s(x) -> str:
    return x.decode() if isinstance(x, (bytes, bytearray)) else str(x)
