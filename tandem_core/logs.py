"""Logging setup shared by the services: one line per event, `key=value` pairs, the service and
worker id on every line so interleaved process output in `tandem local` stays readable."""
from __future__ import annotations

import logging
import sys


def setup_logging(service: str, level: str = "INFO", worker_id: str = "") -> None:
    tag = f"{service}:{worker_id}" if worker_id else service
    fmt = f"%(asctime)s %(levelname)s [{tag}] %(name)s: %(message)s"
    root = logging.getLogger()
    for h in list(root.handlers):
        root.removeHandler(h)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(fmt))
    root.addHandler(handler)
    root.setLevel(level.upper())
    # Third-party chatter stays at WARNING unless asked for DEBUG.
    for noisy in ("httpx", "uvicorn.access", "jax._src", "absl"):
        logging.getLogger(noisy).setLevel(logging.WARNING if level.upper() != "DEBUG" else logging.DEBUG)
