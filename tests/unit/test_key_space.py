"""The key space (tandem_core.keys.KeySpace): a value built from the settings, not process state.
Two of them with different shard counts live side by side in one process, and a key space names
every key exactly as the deployments that ran before it did (keys outlive an upgrade)."""
from __future__ import annotations

import dataclasses

import pytest

from tandem_core.keys import KeySpace
from tandem_core.settings import RedisConfig
from tandem_core.types import choice_ids


def test_two_key_spaces_live_side_by_side():
    one = KeySpace(1)
    before = [one.token_stream("req-42"), one.admission_stream("p", "high", 0), one.running_key("w", 0)]
    sixteen = KeySpace(16)
    assert sixteen.token_stream("req-42") == "tandem:{s9.20}:tok:req-42"
    # building the other changed nothing in this one (no module state between them)
    assert [one.token_stream("req-42"), one.admission_stream("p", "high", 0), one.running_key("w", 0)] == before
    assert before == ["tandem:{s0.0}:tok:req-42", "tandem:{s0.0}:p:adm:high", "tandem:{s0.0}:running:w"]
    assert {one.request_shard(f"r{i}") for i in range(64)} == {0}
    assert len({sixteen.request_shard(f"r{i}") for i in range(64)}) == 16
    assert list(one.all_shards()) == [0] and list(sixteen.all_shards()) == list(range(16))


def test_names_are_the_ones_deployments_already_use():
    """The same names the module-level builders gave (recorded from them at 16 shards): a request
    admitted before an upgrade is found after it."""
    ks = KeySpace(16)
    s = ks.request_shard("req-42")
    assert s == 9
    assert ks.running_key("w", s) == "tandem:{s9.20}:running:w"
    assert ks.admission_streams("p", "high")[:3] == [
        "tandem:{s0.10}:p:adm:high", "tandem:{s1.13}:p:adm:high", "tandem:{s2.23}:p:adm:high"]
    assert ks.request_shard(choice_ids("req-42", 2)[1]) == s  # a choice has its parent's shard


def test_built_from_the_settings_and_frozen():
    assert KeySpace(RedisConfig().shard_count()).shards == 1
    assert KeySpace(RedisConfig(cluster=True).shard_count()).shards == 16
    assert KeySpace(RedisConfig(cluster=True, shards=32).shard_count()).shards == 32
    ks = KeySpace(4)
    with pytest.raises(dataclasses.FrozenInstanceError):
        ks.shards = 8  # type: ignore[misc]
    assert KeySpace(4) == ks and hash(KeySpace(4)) == hash(ks)


@pytest.mark.parametrize("shards", [0, -1, 1025])
def test_a_shard_count_out_of_range_says_which_setting(shards):
    with pytest.raises(ValueError, match=r"redis\.shards must be 1\.\.1024"):
        KeySpace(shards)
