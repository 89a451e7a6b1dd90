"""`tandem redis-acl`: each role's Redis ACL user (tandem_core/bus/acl.py) as `ACL SETUSER` lines
for redis-cli (a managed Redis: Memorystore, ElastiCache; docs/redis-ha.md) or as ACL file lines."""
from __future__ import annotations

import argparse
import os
import sys

from tandem_core.bus import acl


def env_name(role: str) -> str:
    return f"TANDEM_ACL_{role.upper()}_PASSWORD"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="tandem redis-acl",
        description="Print the Redis ACL user of each Tandem role (only the commands and keys it needs). "
                    f"Passwords come from {env_name('<role>')} (e.g. {env_name('gateway')}); without one, "
                    "a placeholder <password-of-ROLE> to replace (never put passwords on a command line).")
    p.add_argument("roles", nargs="*", metavar="ROLE",
                   help=f"roles to print (default all: {', '.join(acl.ROLES)})")
    p.add_argument("--access-string", action="store_true",
                   help="one line a role: the user name and its rules without a password (an ElastiCache "
                        "user's --access-string, a Redis user made some other way)")
    p.add_argument("--aclfile", action="store_true",
                   help="ACL file lines (`user ... #sha256 ...`, passwords hashed; every password must be set)")
    args = p.parse_args(argv)
    roles = args.roles or list(acl.ROLES)
    unknown = [r for r in roles if r not in acl.ROLES]
    if unknown:
        p.error(f"unknown role {', '.join(unknown)}: one of {', '.join(acl.ROLES)}")
    if args.access_string:
        for r in roles:
            print(acl.ROLES[r].username, " ".join(acl.ROLES[r].rules()))
        return 0
    pw = {r: os.environ.get(env_name(r)) for r in roles}
    if args.aclfile:
        missing = [env_name(r) for r in roles if not pw[r]]
        if missing:
            print(f"tandem redis-acl --aclfile: set {', '.join(missing)}", file=sys.stderr)
            return 2
        for r in roles:
            print(acl.ROLES[r].acl_file_line(pw[r] or ""))
        return 0
    for line in acl.setuser_commands({r: pw[r] or f"<password-of-{r}>" for r in roles}):
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
