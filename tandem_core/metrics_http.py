"""`/metrics` on a port of its own (`metrics_port`), so a NetworkPolicy can keep it inside the
cluster while the API port faces a load balancer.

A deliberately small HTTP/1.1 server on the service's event loop (asyncio streams): it answers
`GET /metrics` (and HEAD) with the text `render()` gives, 404 to any other path, 405 to any other
method, and closes each connection after its answer (Prometheus and the endpoint picker open a new
one per scrape or keep none). It reads at most a request head of `MAX_HEAD` bytes.
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

log = logging.getLogger(__name__)

MAX_HEAD = 16 * 1024
READ_TIMEOUT_S = 10.0


async def start(host: str, port: int, render: Callable[[], Awaitable[bytes]], content_type: str) -> asyncio.Server:
    """Listen on host:port (0: a free port; `server.sockets[0].getsockname()[1]` says which)."""
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), READ_TIMEOUT_S)
            method, _, rest = head.split(b"\r\n", 1)[0].decode("latin-1").partition(" ")
            path = rest.split(" ", 1)[0].split("?", 1)[0]
            if path != "/metrics":
                status, body, ctype = "404 Not Found", b"only /metrics is served on this port\n", "text/plain"
            elif method not in ("GET", "HEAD"):
                status, body, ctype = "405 Method Not Allowed", b"GET /metrics\n", "text/plain"
            else:
                status, body, ctype = "200 OK", await render(), content_type
            writer.write((f"HTTP/1.1 {status}\r\nContent-Type: {ctype}\r\nContent-Length: {len(body)}\r\n"
                          "Connection: close\r\n\r\n").encode("latin-1"))
            if method != "HEAD":
                writer.write(body)
            await writer.drain()
        except (asyncio.TimeoutError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError):
            pass  # a scraper that went away or sent no request: nothing to answer
        except Exception:  # a render that failed: the scrape fails, the server goes on
            log.exception("metrics: scrape failed")
            writer.write(b"HTTP/1.1 500 Internal Server Error\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
        finally:
            writer.close()

    server = await asyncio.start_server(handle, host, port, limit=MAX_HEAD)
    return server
