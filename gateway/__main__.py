"""`python -m gateway`: the Tandem gateway (OpenAI-compatible HTTP + gRPC on one event loop).

All settings come from the environment (TANDEM_GATEWAY_*); see `--help`. SIGTERM/SIGINT: uvicorn
stops accepting, lets open streams finish for up to `shutdown_grace_s`, then the lifespan stops
the gRPC server (with the same grace) and closes Redis; a second SIGINT forces the stop.

uvicorn is started the supported way: `Server.serve` on our event loop, on a socket we bind
(`Config.bind_socket`, so the port is known before serving), with uvicorn's own signal handling.
It puts back the handlers it found when it stops and raises the signal again for them; ours
(`_after_uvicorn`) only log it, so a graceful stop exits 0.
"""
from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys

import uvicorn

from gateway.app import create_app
from gateway.settings import GatewaySettings
from tandem_core.logs import setup_logging

log = logging.getLogger("gateway")

_EPILOG = """\
All settings come from environment variables (nested blocks use "__"):
  TANDEM_GATEWAY_REDIS__URL            Redis URL (redis://127.0.0.1:6379/0; rediss:// for TLS)
  TANDEM_GATEWAY_HOST / _PORT          HTTP bind address (127.0.0.1:8000)
  TANDEM_GATEWAY_GRPC_HOST / _GRPC_PORT gRPC bind address (host defaults to HOST; port 50051)
  TANDEM_GATEWAY_METRICS_PORT          /metrics on a port of its own (0: on the HTTP port)
  TANDEM_GATEWAY_MODEL                 preset name or Hugging Face directory (builtin)
  TANDEM_GATEWAY_SERVED_MODEL_NAME     name clients send (default: the model's name)
  TANDEM_GATEWAY_POOL                  worker pool to enqueue to (default)
  TANDEM_GATEWAY_MAX_CONTEXT_LEN       prompt + max_tokens limit (512, = workers' max_len)
  TANDEM_GATEWAY_MAX_PROMPT_LEN        prompt token limit (512, = largest prefill bucket)
  TANDEM_GATEWAY_MAX_TOKENS_LIMIT      max_tokens limit; also a chat's when omitted (4096)
  TANDEM_GATEWAY_DEFAULT_MAX_TOKENS    completions' max_tokens when omitted (16)
  TANDEM_GATEWAY_MAX_N                 choices per request, `n` (8)
  TANDEM_GATEWAY_MAX_LOGIT_BIAS        logit_bias entries per request (64, at most 64)
  TANDEM_GATEWAY_REQUEST_TIMEOUT_S     whole-request deadline (300)
  TANDEM_GATEWAY_FIRST_TOKEN_TIMEOUT_S first-token deadline (120)
  TANDEM_GATEWAY_ADMISSION_MAX_BACKLOG above this backlog: 429 + Retry-After (8192)
  TANDEM_GATEWAY_API_KEYS              JSON list of accepted bearer keys (empty: no auth)
  TANDEM_GATEWAY_ADMIN_KEY             bearer key for /admin/* (empty: open without API keys, 403 with them)
  TANDEM_GATEWAY_SHUTDOWN_GRACE_S      time open streams get on SIGTERM (30)
  TANDEM_GATEWAY_RESUME_GRACE_S        "resumable" requests: time a dropped client has to resume (30)
  TANDEM_GATEWAY_MAX_CONCURRENT_REQUESTS_PER_KEY  per API key and replica (0: no limit)
  TANDEM_GATEWAY_TOKENS_PER_MINUTE_PER_KEY        prompt + max_tokens per key and replica (0: no limit)
  TANDEM_GATEWAY_PREFIX_ROUTING        send prompts to the prefill pod likeliest to hold their prefix (true)
  TANDEM_GATEWAY_PREFIX_BLOCK_SIZE     tokens per prefix block; must equal the pods' prefix_cache.block_size (16)
  TANDEM_GATEWAY_PREFIX_ROUTE_MAX_BACKLOG  a pod's own queue this long: shared queue instead (4)
  TANDEM_GATEWAY_PREFIX_INDEX_ENTRIES  block -> pod entries the router remembers, LRU (100000)
  TANDEM_GATEWAY_LOG_LEVEL             DEBUG/INFO/WARNING (INFO)
"""


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m gateway",
        description="Tandem gateway: OpenAI-compatible /v1/completions and /v1/chat/completions (SSE) and "
        "gRPC tandem.v1.Tandem, "
        "relaying tokens from prefill/decode workers through Redis.",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    return p.parse_args(argv)


async def serve(settings: GatewaySettings) -> int:
    ready = False

    def on_ready(grpc_port: int) -> None:  # the lifespan has started: Redis, the token relay, gRPC
        nonlocal ready
        ready = True
        msg = f"gateway listening http={settings.host}:{http_port} grpc={settings.grpc_host or settings.host}:{grpc_port}"
        log.info(msg)
        print(msg, flush=True)

    config = uvicorn.Config(
        create_app(settings, on_ready=on_ready), host=settings.host, port=settings.port,
        log_level=settings.log_level.lower(),
        timeout_graceful_shutdown=max(1, int(settings.shutdown_grace_s)), loop="none", http=_http_impl(),
        timeout_keep_alive=max(1, int(settings.http_keep_alive_s)),
        log_config=None,
        access_log=settings.log_level.upper() == "DEBUG",
    )
    sock = config.bind_socket()  # ours: the HTTP port (0: any free one) is known before serving
    sock.listen(config.backlog)  # connections from the moment we say we listen wait in the backlog
    http_port = sock.getsockname()[1]
    for sig in (signal.SIGTERM, signal.SIGINT):  # what uvicorn raises again once it has stopped
        signal.signal(sig, _after_uvicorn)
    try:
        await uvicorn.Server(config).serve(sockets=[sock])
    finally:
        sock.close()
    return 0 if ready else 1


def _http_impl() -> str:
    """httptools (C HTTP parser) when installed, else uvicorn's pure-Python h11."""
    try:
        import httptools  # noqa: F401
    except ImportError:
        return "h11"
    return "httptools"


def _loop_factory():
    """uvloop (libuv) when installed: the relay path is dominated by event-loop work per token."""
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop


def _after_uvicorn(sig: int, _frame) -> None:
    log.info("%s: gateway stopped", signal.Signals(sig).name)


def main(argv: list[str] | None = None) -> int:
    parse_args(argv)
    from tandem_core.exits import run_service

    return run_service("tandem gateway", _serve)  # a configuration error: one line, exit 78, no restart


def _serve() -> int:
    settings = GatewaySettings()
    setup_logging("gateway", settings.log_level)
    with asyncio.Runner(loop_factory=_loop_factory()) as runner:
        return runner.run(serve(settings))


if __name__ == "__main__":
    sys.exit(main())
