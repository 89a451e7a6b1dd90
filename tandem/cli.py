"""The `tandem` command: `tandem local` runs a whole cluster on this machine; `tandem prefill`,
`tandem decode`, `tandem gateway` and `tandem planner` run one service each (what the Helm chart starts)."""
from __future__ import annotations

import sys

USAGE = """usage: tandem {local,prefill,decode,gateway,planner,fit,redis-acl} [--help]

  local     start a local cluster: embedded (or external) Redis, prefill and decode workers, gateway
  prefill   run one prefill worker (settings from TANDEM_PREFILL_* environment variables)
  decode    run one decode worker (settings from TANDEM_DECODE_* environment variables)
  gateway   run the HTTP/gRPC gateway (settings from TANDEM_GATEWAY_* environment variables)
  planner   size prefill and decode pods to TTFT/ITL targets (settings from TANDEM_PLANNER_*)
  fit       compile the serving steps for a TPU slice (no TPU needed) and report HBM per chip and speed
  redis-acl print each role's Redis ACL user (ACL SETUSER lines, or ACL file lines) for a managed Redis

`tandem COMMAND --help` explains each one."""


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(USAGE)
        return 0 if argv else 2
    cmd, rest = argv[0], argv[1:]
    if cmd == "local":
        from tandem.local import main as run
    elif cmd == "prefill":
        from prefill_svc.__main__ import main as run
    elif cmd == "decode":
        from decode_svc.__main__ import main as run
    elif cmd == "gateway":
        from gateway.__main__ import main as run
    elif cmd == "planner":
        from planner.__main__ import main as run
    elif cmd == "fit":
        from tandem.fit import main as run
    elif cmd == "redis-acl":
        from tandem.redis_acl import main as run
    else:
        print(f"tandem: unknown command {cmd!r}\n\n{USAGE}", file=sys.stderr)
        return 2
    return run(rest)


if __name__ == "__main__":
    sys.exit(main())
