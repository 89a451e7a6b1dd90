"""`tandem decode` / `python -m decode_svc`: run one decode pod."""
from __future__ import annotations

import argparse
import asyncio
import sys

HELP = """Run a Tandem decode worker: it owns a fixed number of slots, claims ready prefill results
from Redis only for free slots, pulls their KV over gRPC, runs generate steps back to back
(continuous batching, pipelined) and publishes each step's tokens to Redis.

All settings come from environment variables (prefix TANDEM_DECODE_, nested with __):
  TANDEM_DECODE_REDIS__URL        redis://host:port/0 (rediss:// for TLS)
  TANDEM_DECODE_ENGINE__MODEL     preset name (builtin, tiny, small-100m) or HF Llama directory
  TANDEM_DECODE_ENGINE__MAX_LEN   positions per sequence (must match prefill)
  TANDEM_DECODE_SLOTS             decode batch size (sequence rows over the KV pool)
  TANDEM_DECODE_ENGINE__KV_BLOCKS blocks in the KV pool (0: slots x max_len positions); the pod
                                  claims only while the blocks for the prompt plus a reserve are free
  TANDEM_DECODE_GRPC__PORT        grpc.health.v1 port (0 = free port)
  TANDEM_DECODE_PULL_TIMEOUT_S    deadline of one KV pull
See decode_svc/settings.py for every field."""


def main(argv: list[str] | None = None) -> int:
    argparse.ArgumentParser(prog="tandem decode", description=HELP,
                            formatter_class=argparse.RawDescriptionHelpFormatter).parse_args(argv)
    from tandem_core.exits import run_service

    return run_service("tandem decode", _serve)  # a configuration error: one line, exit 78, no restart


def _serve() -> int:
    from decode_svc.settings import DecodeSettings
    from tandem_core.logs import setup_logging

    settings = DecodeSettings()  # before the engine's imports: a bad setting fails at once
    from decode_svc.app import serve
    setup_logging("decode", settings.log_level, settings.worker_id)
    with asyncio.Runner(loop_factory=_loop_factory()) as runner:
        return runner.run(serve(settings))


def _loop_factory():
    """uvloop (libuv) when installed: the decode pod's event loop runs a Redis round trip per step,
    the claims, the KV pulls and the cancel polls, and the pure-Python loop's own overhead (a
    selector call, a getpid per get_running_loop) was the largest item of its host CPU per token."""
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop


if __name__ == "__main__":
    sys.exit(main())
