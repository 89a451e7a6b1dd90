"""The gateway's share of the planner's signals: every `INTERVAL_S` this replica
writes its cumulative load counts (requests admitted and their prompt tokens, requests finished
and their output tokens, TTFT and ITL sums and counts) to Redis (tandem_core/load_report.py).
A failed write is logged at DEBUG and retried next interval: the planner holds its replicas
while reports are missing, and a report never slows a request."""
from __future__ import annotations

import asyncio
import logging
import os
import uuid

from redis.exceptions import RedisError

from tandem_core import load_report

log = logging.getLogger(__name__)
INTERVAL_S = 2.0  # the planner's interval is tens of seconds: a few reports per interval


async def publish_loop(svc, interval_s: float, stop: asyncio.Event) -> None:
    gateway_id = f"gw-{os.uname().nodename}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
    ttl_s = max(10, int(interval_s * 5))
    while not stop.is_set():
        try:
            await load_report.publish(svc.redis, gateway_id, os.getpid(), svc.metrics.load_counts(), ttl_s)
        except (RedisError, OSError) as e:
            log.debug("load report not written: %s", e)
        except Exception:  # a bug: said, and the next report tried (a dead loop would report nothing, silently)
            log.exception("load report failed")
        try:
            await asyncio.wait_for(stop.wait(), timeout=interval_s)
        except asyncio.TimeoutError:
            pass
