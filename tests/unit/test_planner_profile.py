"""planner/profile.py: interpolation between measured points, extrapolation past the last prefill
point (never past decode.slots), the largest batch meeting an ITL target, and one clear error per
malformed field. Pure: no engine, no files but tmp_path."""
from __future__ import annotations

import copy
import json

import pytest

from planner.profile import BUILTIN_PROFILE, FORMAT, Profile, ProfileError, load_profile, parse_profile


def doc(**over) -> dict:
    d = {"format": FORMAT, "model": "toy", "machine": "test", "created": "2026-01-01T00:00:00Z",
         "prefill": {"points": [{"tokens": 16, "seconds": 0.01}, {"tokens": 64, "seconds": 0.02},
                                {"tokens": 256, "seconds": 0.08}]},
         "decode": {"slots": 8, "points": [{"batch": 1, "itl_s": 0.004}, {"batch": 4, "itl_s": 0.01},
                                           {"batch": 8, "itl_s": 0.02}]},
         "handoff_s": 0.005}
    d.update(over)
    return d


def prof(**over) -> Profile:
    return parse_profile(doc(**over), "test")


# ---------------------------------------------------------------------------------------------
# reading numbers off a profile


def test_parsed_fields():
    p = prof()
    assert p.model == "toy" and p.slots == 8 and p.handoff_s == 0.005 and p.source == "test"
    assert p.prefill_points == ((16, 0.01), (64, 0.02), (256, 0.08))
    assert p.decode_points == ((1, 0.004), (4, 0.01), (8, 0.02))


def test_points_are_sorted_whatever_the_file_order():
    d = doc()
    d["prefill"]["points"].reverse()
    d["decode"]["points"].reverse()
    p = parse_profile(d)
    assert [t for t, _ in p.prefill_points] == [16, 64, 256]
    assert [b for b, _ in p.decode_points] == [1, 4, 8]


def test_prefill_interpolates_between_points():
    p = prof()
    assert p.prefill_seconds(16) == pytest.approx(0.01)
    assert p.prefill_seconds(64) == pytest.approx(0.02)
    assert p.prefill_seconds(40) == pytest.approx(0.015)  # halfway 16..64
    assert p.prefill_seconds(160) == pytest.approx(0.05)  # halfway 64..256


def test_prefill_below_the_first_point_costs_the_first_point():
    p = prof()
    assert p.prefill_seconds(8) == pytest.approx(0.01)
    assert p.prefill_seconds(0) == pytest.approx(0.01)
    assert p.prefill_seconds(-5) == pytest.approx(0.01)


def test_prefill_extrapolates_in_proportion_past_the_last_point():
    p = prof()
    assert p.prefill_seconds(512) == pytest.approx(0.16)
    assert p.prefill_seconds(1024) == pytest.approx(0.32)
    assert p.prefill_seconds(300.5) == pytest.approx(0.08 * 300.5 / 256)


def test_prefill_with_a_single_point():
    p = prof(prefill={"points": [{"tokens": 100, "seconds": 0.5}]})
    assert p.prefill_seconds(10) == pytest.approx(0.5)
    assert p.prefill_seconds(200) == pytest.approx(1.0)


def test_decode_interpolates_and_clamps_to_one_and_slots():
    p = prof()
    assert p.decode_itl(1) == pytest.approx(0.004)
    assert p.decode_itl(2) == pytest.approx(0.006)  # a third of the way 1..4
    assert p.decode_itl(6) == pytest.approx(0.015)  # halfway 4..8
    assert p.decode_itl(0) == pytest.approx(0.004)
    assert p.decode_itl(0.5) == pytest.approx(0.004)
    assert p.decode_itl(8) == pytest.approx(0.02)
    assert p.decode_itl(100) == pytest.approx(0.02)  # never extrapolated past slots


def test_decode_past_the_last_point_below_slots_holds_the_last_point():
    p = prof(decode={"slots": 16, "points": [{"batch": 2, "itl_s": 0.01}, {"batch": 4, "itl_s": 0.02}]})
    assert p.decode_itl(1) == pytest.approx(0.01)  # below the first point: the first point
    assert p.decode_itl(3) == pytest.approx(0.015)
    assert p.decode_itl(12) == pytest.approx(0.02)
    assert p.decode_batch_for_itl(0.05) == 16


def test_decode_batch_for_itl():
    p = prof()
    assert p.decode_batch_for_itl(1.0) == 8  # every batch meets it: all the slots
    assert p.decode_batch_for_itl(0.02) == 8  # exactly the slots' step time counts as meeting it
    assert p.decode_batch_for_itl(0.0199) == 7  # itl(7) = 0.0175
    assert p.decode_batch_for_itl(0.01) == 4
    assert p.decode_batch_for_itl(0.006) == 2
    assert p.decode_batch_for_itl(0.004) == 1
    assert p.decode_batch_for_itl(0.0039) == 0  # not even one request meets it


def test_decode_batch_for_itl_with_a_non_monotonic_profile_takes_the_largest():
    p = prof(decode={"slots": 3, "points": [{"batch": 1, "itl_s": 0.01}, {"batch": 2, "itl_s": 0.03},
                                            {"batch": 3, "itl_s": 0.02}]})
    assert p.decode_batch_for_itl(0.025) == 3


# ---------------------------------------------------------------------------------------------
# malformed documents: each field's own message


def without(d: dict, *path: str) -> dict:
    d = copy.deepcopy(d)
    target = d
    for k in path[:-1]:
        target = target[k]
    del target[path[-1]]
    return d


@pytest.mark.parametrize("bad,msg", [
    ([], r"profile: want a JSON object, got list"),
    ("x", r"profile: want a JSON object, got str"),
    (without(doc(), "format"), r"format None, want 'tandem-capacity-profile/v1' \(make one with python bench/capacity.py\)"),
    (doc(format="tandem-capacity-profile/v0"), r"format 'tandem-capacity-profile/v0'"),
    (without(doc(), "prefill"), r"^prefill: missing"),
    (doc(prefill=[1, 2]), r"^prefill: missing"),
    (without(doc(), "decode"), r"^decode: missing"),
    (doc(decode="fast"), r"^decode: missing"),
])
def test_document_level_errors(bad, msg):
    with pytest.raises(ProfileError, match=msg):
        parse_profile(bad)


def test_the_source_names_the_file_in_document_errors():
    with pytest.raises(ProfileError, match=r"^/x/p.json: want a JSON object"):
        parse_profile(3, "/x/p.json")


@pytest.mark.parametrize("slots", [None, 0, -1, 2.0, True, "8"])
def test_bad_slots(slots):
    d = doc()
    d["decode"]["slots"] = slots
    with pytest.raises(ProfileError, match=r"^decode\.slots: want an integer >= 1, got " + repr(slots).replace(".", r"\.")):
        parse_profile(d)


def test_missing_slots():
    with pytest.raises(ProfileError, match=r"decode\.slots: want an integer >= 1, got None"):
        parse_profile(without(doc(), "decode", "slots"))


@pytest.mark.parametrize("section,where", [("prefill", "prefill.points"), ("decode", "decode.points")])
@pytest.mark.parametrize("points", [None, [], {}, "x"])
def test_points_not_a_non_empty_list(section, where, points):
    d = doc()
    d[section]["points"] = points
    with pytest.raises(ProfileError, match=rf"^{where}: want a non-empty list"):
        parse_profile(d)


@pytest.mark.parametrize("point", [5, "p", {"tokens": 16}, {"seconds": 0.1}, {"tok": 16, "seconds": 0.1}])
def test_a_prefill_point_without_its_keys(point):
    d = doc()
    d["prefill"]["points"][1] = point
    with pytest.raises(ProfileError, match=r"^prefill\.points\[1\]: want \{'tokens': int, 'seconds': seconds\}, got"):
        parse_profile(d)


def test_a_decode_point_without_its_keys():
    d = doc()
    d["decode"]["points"][0] = {"batch": 1, "itl": 0.004}
    with pytest.raises(ProfileError, match=r"^decode\.points\[0\]: want \{'batch': int, 'itl_s': seconds\}"):
        parse_profile(d)


@pytest.mark.parametrize("x", [0, -16, 16.0, True, "16", None])
def test_bad_token_count(x):
    d = doc()
    d["prefill"]["points"][2]["tokens"] = x
    with pytest.raises(ProfileError, match=r"^prefill\.points\[2\]\.tokens: want an integer >= 1, got "):
        parse_profile(d)


@pytest.mark.parametrize("x", [0, 1.5, False])
def test_bad_batch(x):
    d = doc()
    d["decode"]["points"][0]["batch"] = x
    with pytest.raises(ProfileError, match=r"^decode\.points\[0\]\.batch: want an integer >= 1, got "):
        parse_profile(d)


@pytest.mark.parametrize("y", [0, 0.0, -0.1, float("nan"), float("inf"), True, "0.1", None])
def test_bad_seconds(y):
    d = doc()
    d["prefill"]["points"][0]["seconds"] = y
    with pytest.raises(ProfileError, match=r"^prefill\.points\[0\]\.seconds: want seconds > 0, got "):
        parse_profile(d)


@pytest.mark.parametrize("y", [0, -1, float("nan")])
def test_bad_itl(y):
    d = doc()
    d["decode"]["points"][1]["itl_s"] = y
    with pytest.raises(ProfileError, match=r"^decode\.points\[1\]\.itl_s: want seconds > 0, got "):
        parse_profile(d)


def test_two_points_at_one_length():
    d = doc()
    d["prefill"]["points"][1]["tokens"] = 16
    with pytest.raises(ProfileError, match=r"^prefill\.points: two points share one tokens"):
        parse_profile(d)
    d = doc()
    d["decode"]["points"][1]["batch"] = 8
    with pytest.raises(ProfileError, match=r"^decode\.points: two points share one batch"):
        parse_profile(d)


def test_a_batch_past_the_slots():
    d = doc()
    d["decode"]["slots"] = 4
    with pytest.raises(ProfileError, match=r"^decode\.points: batch 8 is past decode\.slots 4"):
        parse_profile(d)


@pytest.mark.parametrize("h", [-0.001, float("nan"), float("inf"), True, "0.01", None])
def test_bad_handoff(h):
    with pytest.raises(ProfileError, match=r"^handoff_s: want seconds >= 0, got "):
        parse_profile(doc(handoff_s=h))


def test_handoff_may_be_zero_or_missing():
    assert prof(handoff_s=0).handoff_s == 0.0
    assert parse_profile(without(doc(), "handoff_s")).handoff_s == 0.0


def test_extra_keys_are_ignored_and_model_is_optional():
    p = parse_profile(without(doc(engine={"dtype": "float32"}, load_avg_1m={"start": 1.0}), "model"))
    assert p.model == ""


# ---------------------------------------------------------------------------------------------
# files


def test_load_profile_round_trip(tmp_path):
    path = tmp_path / "p.json"
    path.write_text(json.dumps(doc()))
    p = load_profile(path)
    assert p == parse_profile(doc(), str(path))
    assert p.source == str(path) and load_profile(str(path)) == p


def test_load_profile_missing_file(tmp_path):
    with pytest.raises(ProfileError, match=r"capacity profile .*nope\.json: no such file \(make one with "
                       r"python bench/capacity.py --out PATH"):
        load_profile(tmp_path / "nope.json")


def test_load_profile_not_json(tmp_path):
    path = tmp_path / "p.json"
    path.write_text("{not json")
    with pytest.raises(ProfileError, match=r"capacity profile .*p\.json: not JSON \("):
        load_profile(path)


def test_load_profile_field_errors_name_the_file(tmp_path):
    path = tmp_path / "p.json"
    path.write_text(json.dumps(doc(format="other")))
    with pytest.raises(ProfileError, match=rf"^{path}: format 'other'"):
        load_profile(path)


def test_default_is_the_shipped_builtin_profile():
    assert BUILTIN_PROFILE.name == "builtin-cpu.json" and BUILTIN_PROFILE.parent.name == "profiles"
    p = load_profile()
    assert p.source == str(BUILTIN_PROFILE) and p.model == "builtin"
    assert p == load_profile("")
