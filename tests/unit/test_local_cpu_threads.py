"""`tandem local --cpu-threads`: one XLA thread count for both roles, or one per role, and each
worker's environment carries its own role's (one each by default: every core for the prefill pod
was no faster in a quiet 16 x 512 burst, bench/RESULTS.md)."""
from __future__ import annotations

import pytest

from tandem import local


def engine_threads(argv: list[str]) -> dict[str, str]:
    a = local._parse(["--max-len", "256", *argv])
    c = local.Cluster(a)
    return {role: c._engine_env(f"TANDEM_{role.upper()}_", role)[f"TANDEM_{role.upper()}_ENGINE__CPU_THREADS"]
            for role in ("prefill", "decode")}


def test_the_default_gives_each_role_one_thread():
    assert engine_threads([]) == {"prefill": "1", "decode": "1"}


@pytest.mark.parametrize("spec, want", [
    ("2", {"prefill": "2", "decode": "2"}),
    ("1", {"prefill": "1", "decode": "1"}),
    ("prefill=2,decode=1", {"prefill": "2", "decode": "1"}),
    ("decode=0", {"prefill": "1", "decode": "0"}),  # a role left out gets 1
    (" prefill=3 , ", {"prefill": "3", "decode": "1"}),
])
def test_one_count_or_one_per_role(spec, want):
    assert engine_threads(["--cpu-threads", spec]) == want


@pytest.mark.parametrize("spec", ["gateway=2", "prefill=", "prefill=two", "-1", "prefill=-1"])
def test_a_bad_count_says_what_to_give(spec, capsys):
    with pytest.raises(SystemExit):
        local._parse(["--cpu-threads", spec])
    err = capsys.readouterr().err
    assert "--cpu-threads" in err and "ROLE=N" in err
