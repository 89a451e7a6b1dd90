"""How a service process says that its configuration is wrong, so that nobody restarts it in vain.

A worker that cannot start because of what it was told (an unknown model or model family, a
missing weight, a setting out of range) exits once with `EXIT_CONFIG` (78, sysexits' EX_CONFIG)
after writing one line that says what is wrong and what to do, to stderr and, when
`TANDEM_TERMINATION_LOG` names a file, to that file too (Kubernetes reads a container's
`terminationMessagePath` the same way). `tandem local` reads it, reports it and stops instead of
restarting the worker; any other exit is a crash and is restarted.
No JAX, no I/O beyond that one write.
"""
from __future__ import annotations

import os
import sys
from typing import Callable

from pydantic import ValidationError

from tandem_core.errors import ModelNotFound

EXIT_CONFIG = 78  # sysexits.h EX_CONFIG
TERMINATION_LOG_ENV = "TANDEM_TERMINATION_LOG"


def config_errors() -> tuple[type[BaseException], ...]:
    """What counts as a configuration error: the model cannot be found or loaded as configured,
    or a setting does not validate."""
    errors: list[type[BaseException]] = [ModelNotFound, ValidationError]
    try:
        from pydantic_settings import SettingsError
    except ImportError:  # pragma: no cover - pydantic-settings is a dependency
        pass
    else:
        errors.append(SettingsError)
    return tuple(errors)


def describe(e: BaseException) -> str:
    text = " ".join(str(e).split()) if isinstance(e, ValidationError) else str(e)
    return f"{type(e).__name__}: {text}"


def run_service(name: str, main: Callable[[], int]) -> int:
    """`main()`'s exit code, or EXIT_CONFIG with one explaining line if it fails on its configuration."""
    try:
        return main()
    except config_errors() as e:
        line = (f"{name} cannot start with this configuration: {describe(e)}. Fix it and start again "
                f"(restarting as is will fail the same way).")
        print(line, file=sys.stderr, flush=True)
        path = os.environ.get(TERMINATION_LOG_ENV)
        if path:
            try:
                with open(path, "w", encoding="utf-8") as f:
                    f.write(line + "\n")
            except OSError:
                pass
        return EXIT_CONFIG
