"""`tandem prefill` / `python -m prefill_svc`: run one prefill pod."""
from __future__ import annotations

import argparse
import asyncio
import sys

HELP = """Run a Tandem prefill worker: it claims prompts from the Redis admission streams while its
held-KV budget has room, runs prefill (JAX), publishes the first token and a ready notice, and
serves the KV to decode pods over gRPC.

All settings come from environment variables (prefix TANDEM_PREFILL_, nested with __):
  TANDEM_PREFILL_REDIS__URL            redis://host:port/0 (rediss:// for TLS)
  TANDEM_PREFILL_ENGINE__MODEL         preset name (builtin, tiny, small-100m) or HF Llama directory
  TANDEM_PREFILL_ENGINE__MAX_LEN       positions per sequence (must match decode)
  TANDEM_PREFILL_GRPC__PORT            KV transfer + grpc.health.v1 port (0 = free port)
  TANDEM_PREFILL_GRPC__ADVERTISE_HOST  address decode pods use to reach this pod
  TANDEM_PREFILL_KV_BUDGET_BYTES       held KV bound; above it no prompts are claimed
  TANDEM_PREFILL_KV_LEASE_S            KV not pulled within this is freed
See prefill_svc/settings.py for every field."""


def main(argv: list[str] | None = None) -> int:
    argparse.ArgumentParser(prog="tandem prefill", description=HELP,
                            formatter_class=argparse.RawDescriptionHelpFormatter).parse_args(argv)
    from tandem_core.exits import run_service

    return run_service("tandem prefill", _serve)  # a configuration error: one line, exit 78, no restart


def _serve() -> int:
    from prefill_svc.settings import PrefillSettings
    from tandem_core.logs import setup_logging

    settings = PrefillSettings()  # before the engine's imports: a bad setting fails at once
    from prefill_svc.app import serve
    setup_logging("prefill", settings.log_level, settings.worker_id)
    return asyncio.run(serve(settings))


if __name__ == "__main__":
    sys.exit(main())
