"""Wiring: the FastAPI app, its lifespan (Redis client, gRPC server on the same event loop) and
the one place where errors become HTTP responses.

`create_app(settings)` builds everything from the settings it is given; nothing reads the
environment here. The gRPC server (tandem.v1.Tandem, grpc.health.v1, reflection v1 and v1alpha)
starts with the app and stops with it, after the HTTP side has drained.
"""
from __future__ import annotations

import asyncio
import logging
from contextlib import asynccontextmanager
from typing import Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from redis.exceptions import RedisError
from starlette.exceptions import HTTPException as StarletteHTTPException

from gateway import grpc_api, load_publisher, openapi
from gateway.http_api import error_body, router
from gateway.metrics import CONTENT_TYPE
from gateway.responses import ResponsesBody
from gateway.schemas import ChatBody, CompletionBody, DetokenizeBody, TokenizeBody
from gateway.service import GatewayService, retry_after_header
from gateway.settings import GatewaySettings
from gateway.tokens import TokenMux
from tandem_core import grpc_util, metrics_http
from tandem_core.bus import conn, groups
from tandem_core.errors import TandemError
from tandem_core.redis_client import RedisConfigError

log = logging.getLogger(__name__)

REDIS_CLIENT_NAME = "tandem-gateway"  # every connection of a gateway, as CLIENT LIST shows it
# connections a gateway needs beside its token readers' blocking reads (one per key shard) for
# its per-request commands (admission, holds, cancels, resume reads) to flow
MIN_FREE_CONNECTIONS = 8


def _check_connection_bound(settings: GatewaySettings) -> None:
    """Every Redis command of a gateway shares one pool of `redis.max_connections` (per node on a
    Redis Cluster) and its token readers hold one each in a blocking read, so a bound that leaves
    too few for the rest would make every request wait for a connection."""
    shards, bound = settings.redis.shard_count(), settings.redis.max_connections
    if bound < shards + MIN_FREE_CONNECTIONS:
        raise RedisConfigError(
            f"redis.max_connections {bound} is too small for {shards} key shards: the gateway's token readers hold "
            f"{shards} connections (one per shard) and its requests need at least {MIN_FREE_CONNECTIONS} more; set "
            f"redis.max_connections (TANDEM_GATEWAY_REDIS__MAX_CONNECTIONS) to {shards + MIN_FREE_CONNECTIONS} or more")


def create_app(settings: GatewaySettings, service: GatewayService | None = None,
               on_ready: Callable[[int], None] | None = None) -> FastAPI:
    """The gateway's app; `on_ready(grpc_port)` is called once its lifespan has started (Redis,
    the token relay, the gRPC server): `python -m gateway` prints its listening line then."""
    svc = service or GatewayService(settings)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        svc.redis = conn.connect(settings.redis, client_name=REDIS_CLIENT_NAME)
        _check_connection_bound(settings)
        svc.mux = TokenMux(svc.redis, svc.keys, block_ms=settings.relay_block_ms,
                           socket_timeout_s=settings.redis.socket_timeout_s)
        try:
            await groups.ensure_groups(svc.redis, svc.keys, settings.pool)
        except (RedisError, OSError) as e:  # serve anyway: /readyz says not ready, requests get 503
            log.warning("Redis unreachable at startup (%s); continuing, /readyz will say so", e)
        # after the first command: redis-py's cluster client breaks connections when many tasks
        # (a reader per shard) make its very first commands at once (seen with redis-py 8.1)
        svc.mux.start()
        server, health = await _start_grpc(settings, svc)
        metrics_server = await _start_metrics(settings, svc)
        watch_stop = asyncio.Event()
        watch = asyncio.create_task(svc.readmit.watch(watch_stop))
        report = asyncio.create_task(load_publisher.publish_loop(svc, load_publisher.INTERVAL_S, watch_stop))
        if on_ready is not None:
            on_ready(svc.grpc_port)
        try:
            yield
        finally:
            watch_stop.set()
            watch.cancel()
            await asyncio.gather(watch, report, return_exceptions=True)
            await grpc_util.set_serving(health, [grpc_api.SERVICE_NAME], False)
            if metrics_server is not None:
                metrics_server.close()
            await server.stop(settings.shutdown_grace_s)
            await svc.streaming.drain()
            await svc.mux.stop()
            await svc.redis.aclose()
            log.info("gateway stopped")

    app = FastAPI(title="Tandem gateway", version="0.1.0", lifespan=lifespan)
    app.state.gateway = svc
    app.include_router(router)
    openapi.install(app, [CompletionBody, ChatBody, ResponsesBody, TokenizeBody, DetokenizeBody])
    _add_error_handlers(app)
    return app


async def _start_grpc(settings: GatewaySettings, svc: GatewayService):
    server = grpc_util.make_server(settings.grpc_max_message_bytes)
    grpc_api.add_to_server(server, svc)
    health = grpc_util.add_health(server, [grpc_api.SERVICE_NAME])
    grpc_util.add_reflection(server, [grpc_api.SERVICE_NAME])
    svc.grpc_port = grpc_util.bind(server, settings.grpc_host or settings.host, settings.grpc_port)
    await server.start()
    await grpc_util.set_serving(health, [grpc_api.SERVICE_NAME], True)
    return server, health


async def _start_metrics(settings: GatewaySettings, svc: GatewayService):
    """/metrics on `metrics_port` when set (tandem_core/metrics_http.py); the port it got in
    `svc.metrics_port`."""
    if not settings.metrics_port:
        return None

    async def render() -> bytes:
        await svc.report.refresh_load()
        return svc.metrics.render()

    server = await metrics_http.start(settings.host, settings.metrics_port, render, CONTENT_TYPE)
    svc.metrics_port = server.sockets[0].getsockname()[1]
    return server


def _error(status: int, message: str, etype: str, param: str | None = None, headers=None) -> JSONResponse:
    body = {"error": {"message": message, "type": etype, "param": param, "code": etype}}
    return JSONResponse(body, status_code=status, headers=headers)


_NOT_HERE = {"/v1/embeddings": "embeddings are not served: this server generates text",
             "/v1/audio": "audio is not served: this server generates text",
             "/v1/images": "images are not served: this server generates text"}


def served_routes(app: FastAPI) -> list[str]:
    """'METHOD /path' for every route of the API (the documentation pages left out)."""
    out = []
    for r in [*app.routes, *router.routes]:  # the API's own router (newer FastAPI nests it in app.routes)
        methods = sorted(m for m in getattr(r, "methods", None) or () if m != "HEAD")
        path = getattr(r, "path", "")
        if methods and path not in ("/docs", "/redoc", "/docs/oauth2-redirect"):
            out.extend(f"{m} {path}" for m in methods)
    return list(dict.fromkeys(out))


def _not_served(app: FastAPI, request: Request) -> str:
    path = request.url.path
    why = next((v for k, v in _NOT_HERE.items() if path == k or path.startswith(k + "/")), None)
    head = f"{why} ({request.method} {path[:200]})" if why else f"no route {request.method} {path[:200]}"
    return f"{head}; this server serves: {', '.join(served_routes(app))}"


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(TandemError)
    async def _tandem(request: Request, e: TandemError) -> JSONResponse:
        if e.http_status >= 500:
            log.warning("%s: %s path=%s", type(e).__name__, e.message, request.url.path)
        return JSONResponse({"error": error_body(e)}, status_code=e.http_status, headers=retry_after_header(e))

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, e: RequestValidationError) -> JSONResponse:
        err = (e.errors() or [{}])[0]
        field = ".".join(str(x) for x in err.get("loc", ()) if x != "body") or None
        return _error(400, f"invalid value for {field!r}: {err.get('msg')}", "invalid_request_error", field)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, e: StarletteHTTPException) -> JSONResponse:
        if e.status_code == 404 and e.detail == "Not Found":  # no route: say what is served
            return _error(404, _not_served(app, request), "not_found_error", request.url.path[:200])
        etype = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        return _error(e.status_code, str(e.detail), etype, headers=getattr(e, "headers", None))

    @app.exception_handler(Exception)
    async def _internal(request: Request, e: Exception) -> JSONResponse:
        log.exception("unhandled error path=%s", request.url.path)
        return _error(500, f"internal error: {type(e).__name__}", "internal_error")
