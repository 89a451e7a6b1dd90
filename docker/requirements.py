"""Print the requirements `pip install ".[extras]"` would install for the project, one a line,
read from pyproject.toml alone (extras that name the project itself, tandem-serve[...], are
expanded), followed by any extra requirement given after the spec (a pin such as jax==0.10.2).

The images install these first, from pyproject.toml and this file only, then copy the source and
`pip install --no-deps .`: a change to the code reuses the dependencies' layer.

    python requirements.py ".[worker,tpu]" "jax==0.10.2" > requirements.txt

`--check-libtpu` (the TPU image's build, once installed): fails unless the installed libtpu is
the version the installed jax pins in its own tpu extra and jaxlib is jax's version.

    python requirements.py --check-libtpu
"""
from __future__ import annotations

import re
import sys
import tomllib
from pathlib import Path

SELF = "tandem-serve"


def requirements(pyproject: dict, extras: list[str]) -> list[str]:
    project = pyproject["project"]
    out: list[str] = list(project["dependencies"])
    todo, seen = list(extras), set()
    while todo:
        extra = todo.pop(0)
        if extra in seen:
            continue
        seen.add(extra)
        for req in project["optional-dependencies"][extra]:
            m = re.fullmatch(rf"{SELF}\[([a-z0-9,-]+)\]", req.replace(" ", ""))
            if m:
                todo += m.group(1).split(",")
            elif req not in out:
                out.append(req)
    return out


def check_libtpu() -> int:
    from importlib.metadata import requires, version

    try:
        from packaging.requirements import Requirement
    except ImportError:  # not a dependency of the image: pip's own copy (the build stage has pip)
        from pip._vendor.packaging.requirements import Requirement

    jax = version("jax")
    pins = [r for r in map(Requirement, requires("jax") or [])
            if r.name == "libtpu" and r.marker is not None and r.marker.evaluate({"extra": "tpu"})]
    libtpu, jaxlib = version("libtpu"), version("jaxlib")
    ok = bool(pins) and all(libtpu in p.specifier for p in pins) and jaxlib == jax
    print(f"jax {jax}: jaxlib {jaxlib}, libtpu {libtpu} (jax[tpu] pins {[str(p.specifier) for p in pins]})"
          + ("" if ok else ": MISMATCH"))
    return 0 if ok else 1


def main(argv: list[str]) -> int:
    if argv == ["--check-libtpu"]:
        return check_libtpu()
    if not argv or not re.fullmatch(r"\.\[[a-z0-9,-]+\]", argv[0]):
        print(__doc__, file=sys.stderr)
        return 2
    pyproject = tomllib.loads(Path("pyproject.toml").read_text())  # the working directory's
    for line in requirements(pyproject, argv[0][2:-1].split(",")) + argv[1:]:
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
