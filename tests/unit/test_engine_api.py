"""The services hold the engine through tandem_engine.api.ServingEngine: Engine provides every
member of it at run time. That the services use no member the Protocol does not declare is mypy's
to hold (`make check`: the services type their engine as ServingEngine; [tool.mypy] files)."""
from tandem_engine import load_engine
from tandem_engine.api import ServingEngine


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
