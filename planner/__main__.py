"""`python -m planner` (`tandem planner`): sizes the prefill and decode pods of one pool to the
TTFT and ITL targets, from a measured capacity profile and the live load in Redis.

Settings come from the environment (TANDEM_PLANNER_*); see `--help`. SIGTERM/SIGINT: the loop
ends after its current tick and the HTTP server stops.
"""
from __future__ import annotations

import argparse
import sys

import uvicorn

from planner.app import create_app
from planner.settings import PlannerSettings
from tandem_core.logs import setup_logging

_EPILOG = """\
All settings come from environment variables (nested blocks use "__"):
  TANDEM_PLANNER_REDIS__URL              Redis URL (redis://127.0.0.1:6379/0)
  TANDEM_PLANNER_POOL                    worker pool to size (default)
  TANDEM_PLANNER_PROFILE_PATH            capacity profile JSON from bench/capacity.py ("": the built-in model's)
  TANDEM_PLANNER_SLO__TTFT_S / __ITL_S   targets: mean time to first token (1.0), mean inter-token gap (0.05)
  TANDEM_PLANNER_PREFILL__MIN_REPLICAS / __MAX_REPLICAS   bounds (1 / 8); likewise DECODE__
  TANDEM_PLANNER_MODE                    off: publish only (/metrics, /keda); local: tandem local follows;
                                         kubernetes: scale the Deployments (PREFILL__DEPLOYMENT, DECODE__DEPLOYMENT)
  TANDEM_PLANNER_KUBERNETES__RECORD_FILE no cluster: write the requests it would send here (JSON lines)
  TANDEM_PLANNER_INTERVAL_S              seconds between decisions (30)
  TANDEM_PLANNER_MARGIN_SIGMAS           safety margin, in standard deviations of recent prediction errors (1)
  TANDEM_PLANNER_MAX_UTILIZATION         never plan a pod past this fraction of its profiled capacity (0.8)
  TANDEM_PLANNER_CORRECTION              scale the profile by the pods' measured speed (true)
  TANDEM_PLANNER_SCALE_UP_COOLDOWN_S / _SCALE_DOWN_COOLDOWN_S   (60 / 300)
  TANDEM_PLANNER_HOST / _PORT            HTTP bind address (0.0.0.0:9300)
  TANDEM_PLANNER_LOG_LEVEL               DEBUG/INFO/WARNING (INFO)
"""


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="tandem planner",
        description="Tandem planner: predicts the next interval's load and sets the prefill and decode "
        "replicas that meet the TTFT and ITL targets, from a measured capacity profile (docs/planner.md).",
        epilog=_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.parse_args(argv)
    s = PlannerSettings()
    setup_logging("planner", s.log_level)
    uvicorn.run(create_app(s), host=s.host, port=s.port, log_level="warning", lifespan="on")
    return 0


if __name__ == "__main__":
    sys.exit(main())
