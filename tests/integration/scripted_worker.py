"""A scripted worker for the gateway's integration tests: it claims what the gateway admits (from
the prefill and the direct-to-decode streams, on real Redis), records each request, and answers
with the tokens `answer(request)` gives, as one finished token-stream write. The gateway's own
code runs for real; only the model is scripted, so the tests can say exactly what the output is."""
from __future__ import annotations

import threading
from typing import Callable

from tandem_core import keys
from tandem_core.bus import groups, token_stream
from tandem_core.types import GenerationRequest

KS = keys.KeySpace(1)  # a plain Redis: one key shard (a service builds its own from its settings)


async def serve_scripted(redis_url: str, pool: str, consumer: str, answer: Callable[[GenerationRequest], list[int]],
                         seen: list[GenerationRequest], stop: threading.Event) -> None:
    import redis.asyncio as aioredis

    r = aioredis.Redis.from_url(redis_url)
    await groups.ensure_groups(r, KS, pool)
    adm = [KS.admission_stream(pool, p, 0) for p in keys.PRIORITIES]
    while not stop.is_set():
        got = await groups.claim(r, adm, keys.PREFILL_GROUP, consumer, count=8, block_ms=None)
        got += await groups.claim(r, [KS.direct_stream(pool, 0)], keys.DECODE_GROUP, consumer, count=8, block_ms=50)
        for c in got:
            req = GenerationRequest.from_json(c.fields["req"])
            seen.append(req)
            pipe = r.pipeline(transaction=False)
            token_stream.add_tokens(pipe, KS, req.request_id, 0, answer(req), "stop", 60, 1000)
            await pipe.execute()
            await groups.ack(r, c.stream, keys.PREFILL_GROUP if c.stream in adm else keys.DECODE_GROUP, c.entry_id)
    await r.aclose()
