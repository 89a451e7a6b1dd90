"""The services hold the engine through tandem_engine.api.ServingEngine: Engine provides every
member of it, and the services' source uses no member of the engine that it does not declare."""
import pathlib
import re

import pytest

from tandem_engine import load_engine
from tandem_engine.api import ServingEngine

ROOT = pathlib.Path(__file__).resolve().parents[2]
# `engine.<name>` and `self.engine.<name>` (not `settings.engine.<name>`, the settings block)
_USE = re.compile(r"(?:(?<![\w.])|(?<=self\.))engine\.(\w+)")


def _protocol_members() -> set[str]:
    return {n for n in ServingEngine.__protocol_attrs__} if hasattr(ServingEngine, "__protocol_attrs__") else \
        {n for n in dir(ServingEngine) if not n.startswith("_")} | set(ServingEngine.__annotations__)


def test_the_engine_provides_every_member_of_the_protocol():
    e = load_engine("tiny", slots=2, max_len=64, prefill_buckets=(16,))
    assert isinstance(e, ServingEngine)
    for name in _protocol_members():
        assert hasattr(e, name), name


def test_something_without_the_members_is_not_an_engine():
    class Half:
        info = None

        def prefill(self, *a, **k):
            return None

    assert not isinstance(Half(), ServingEngine)


@pytest.mark.parametrize("where", ["decode_svc", "prefill_svc", "tandem_engine/prefix_cache.py"])
def test_services_use_only_what_the_protocol_declares(where):
    members = _protocol_members()
    path = ROOT / where
    files = [path] if path.is_file() else sorted(path.rglob("*.py"))
    used = {(f.relative_to(ROOT).as_posix(), m.group(1)) for f in files for m in _USE.finditer(f.read_text())}
    assert used, f"no engine use found in {where}: the pattern no longer matches the code"
    undeclared = sorted(f"{f}: engine.{name}" for f, name in used if name not in members)
    assert not undeclared, "used but not in tandem_engine.api.ServingEngine: " + ", ".join(undeclared)
