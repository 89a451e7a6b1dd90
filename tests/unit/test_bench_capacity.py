"""bench/capacity.py's pure parts: the profile document built from measured numbers (it
round-trips through planner.profile.load_profile; bad numbers are refused with a message naming
them), the capacities and the RESULTS section derived from it, the engine views the measuring
functions hand to bench/engine.py, and the shipped profile of the built-in model. Nothing is
timed, no socket is opened, no engine is loaded."""
from __future__ import annotations

import json
import math
import tomllib

import pytest

from bench import capacity as cap
from planner.profile import BUILTIN_PROFILE, FORMAT, load_profile, parse_profile

PREFILL = {16: 0.004, 64: 0.01, 512: 0.1}
DECODE = {1: 0.002, 2: 0.0025, 3: 0.004, 4: 0.004}


def build(**over) -> dict:
    kw = dict(model="builtin", machine="2 CPUs (test)", command="python bench/capacity.py --quick",
              prefill=PREFILL, decode=DECODE, slots=4, handoff_s=0.003, created="2026-01-01T00:00:00Z")
    kw.update(over)
    return cap.build_profile(**kw)


def test_the_document_has_the_format_fields():
    d = build()
    assert d["format"] == FORMAT and d["model"] == "builtin" and d["machine"] == "2 CPUs (test)"
    assert d["created"] == "2026-01-01T00:00:00Z" and d["command"] == "python bench/capacity.py --quick"
    assert d["prefill"] == {"points": [{"tokens": 16, "seconds": 0.004}, {"tokens": 64, "seconds": 0.01},
                                       {"tokens": 512, "seconds": 0.1}]}
    assert d["decode"]["slots"] == 4 and [p["batch"] for p in d["decode"]["points"]] == [1, 2, 3, 4]
    assert d["handoff_s"] == 0.003


def test_round_trip_through_load_profile(tmp_path):
    d = build(extra={"load_avg_1m": {"start": 1.5, "end": 2.0}, "engine": {"dtype": "float32"}})
    path = tmp_path / "p.json"
    path.write_text(json.dumps(d, indent=2))
    p = load_profile(path)
    assert p.model == "builtin" and p.slots == 4 and p.handoff_s == pytest.approx(0.003)
    assert p.prefill_points == tuple(sorted(PREFILL.items()))
    assert p.decode_points == tuple(sorted(DECODE.items()))
    assert p.prefill_seconds(40) == pytest.approx(0.007)
    assert p.decode_batch_for_itl(0.0039) == 2
    assert json.loads(path.read_text())["load_avg_1m"] == {"start": 1.5, "end": 2.0}


def test_unsorted_input_and_created_defaults_to_now():
    d = build(prefill={512: 0.1, 16: 0.004}, decode={2: 0.003, 1: 0.002}, created="")
    assert [p["tokens"] for p in d["prefill"]["points"]] == [16, 512]
    assert [p["batch"] for p in d["decode"]["points"]] == [1, 2]
    assert d["created"].endswith("Z") and d["created"][:2] == "20"


def test_handoff_zero_is_allowed():
    assert build(handoff_s=0)["handoff_s"] == 0.0


@pytest.mark.parametrize("over,msg", [
    ({"prefill": {}}, r"^prefill: no point measured"),
    ({"decode": {}}, r"^decode: no point measured"),
    ({"prefill": {16: float("nan")}}, r"^prefill at 16 tokens: nan is not a number of seconds > 0"),
    ({"prefill": {16: 0.0}}, r"^prefill at 16 tokens: 0\.0 is not a number of seconds > 0"),
    ({"prefill": {16: -1.0}}, r"^prefill at 16 tokens: -1\.0 is not"),
    ({"prefill": {16: None}}, r"^prefill at 16 tokens: None is not"),
    ({"prefill": {0: 0.1}}, r"^prefill tokens: 0 is not an integer >= 1"),
    ({"prefill": {16.0: 0.1}}, r"^prefill tokens: 16\.0 is not an integer >= 1"),
    ({"prefill": {True: 0.1}}, r"^prefill tokens: True is not an integer >= 1"),
    ({"decode": {1: float("inf")}}, r"^decode step at batch 1: inf is not a number of seconds > 0"),
    ({"decode": {0: 0.002}}, r"^decode batch: 0 is not an integer >= 1"),
    ({"decode": {5: 0.002}}, r"^decode batch 5 is past the 4 slots measured"),
    ({"slots": 0}, r"^decode slots: 0 is not an integer >= 1"),
    ({"slots": "8"}, r"^decode slots: '8' is not an integer >= 1"),
    ({"handoff_s": -0.001}, r"^handoff_s: -0\.001 is not a number of seconds >= 0"),
    ({"handoff_s": float("nan")}, r"^handoff_s: nan is not"),
    ({"model": ""}, r"^model: want the preset name"),
    ({"extra": {"format": "x"}}, r"^extra key 'format' would overwrite a field of the format"),
    ({"extra": {"handoff_s": 1}}, r"^extra key 'handoff_s'"),
])
def test_bad_numbers_are_refused_by_name(over, msg):
    with pytest.raises(cap.CapacityError, match=msg):
        build(**over)


def test_capacity_error_is_a_value_error():
    assert issubclass(cap.CapacityError, ValueError)


def test_what_is_built_is_what_the_reader_accepts():
    d = build()
    p = parse_profile(d)
    assert p.decode_itl(4) == pytest.approx(0.004)


def test_capacity_rows():
    pre, dec = cap.capacity_rows(build())
    assert pre[0] == pytest.approx([16, 4.0, 250.0, 4000.0])
    assert pre[-1] == pytest.approx([512, 100.0, 10.0, 5120.0])
    assert dec[0] == pytest.approx([1, 2.0, 500.0, 500.0])
    assert dec[3] == pytest.approx([4, 4.0, 1000.0, 250.0])


def test_handoff_total():
    assert cap.handoff_total({16: 0.002, 64: 0.004}, {16: 0.001, 64: 0.0015}, 64) == pytest.approx(0.0055)
    with pytest.raises(cap.CapacityError, match=r"--handoff-tokens 32: not a measured bucket \(measured: \[16, 64\]\)"):
        cap.handoff_total({16: 0.002, 64: 0.004}, {16: 0.001, 64: 0.0015}, 32)


def test_pull_reps_follows_kv_transfer():
    assert cap.pull_reps(3, [65536, 2 << 20]) == 9
    assert cap.pull_reps(12, [65536]) == 12
    assert cap.pull_reps(5, [64 << 20]) == 5


def test_parse_buckets():
    assert cap.parse_buckets("", 512) == (16, 32, 64, 128, 256, 512)
    assert cap.parse_buckets("", 100) == (16, 32, 64)
    assert cap.parse_buckets("", 8) == (8,)
    assert cap.parse_buckets("64, 16,64", 512) == (16, 64)
    for bad in ("a,b", "0,16", "16,1024", ","):
        with pytest.raises(cap.CapacityError, match=r"--buckets"):
            cap.parse_buckets(bad, 512)


def test_load_line():
    assert cap.load_line(1.234, 2.5) == "1-minute load average 1.23 at the start, 2.50 at the end"
    assert cap.load_line(None, None) == "load average unknown"


def full_doc() -> dict:
    extra = {"engine": {"model_name": "tandem-tiny-py", "params": 3950848, "dtype": "float32", "cpu_threads": 1},
             "load_avg_1m": {"start": 1.0, "end": 3.0},
             "method": {"prefill_reps": 15, "decode_rounds": 7, "decode_steps": 32, "prompt_tokens": 64,
                        "context": 178, "batch_buckets": [2, 4], "out": "planner/profiles/x.json"},
             "handoff_detail": {"tokens": 512, "pull_reps": 9, "insert_reps": 5, "note": cap.CLAIM_NOTE,
                                "points": [{"tokens": 16, "kv_bytes": 65536, "pull_s": 0.002, "insert_s": 0.001},
                                           {"tokens": 512, "kv_bytes": 2 << 20, "pull_s": 0.002, "insert_s": 0.001}]}}
    return build(extra=extra)


def test_report_has_the_tables_the_load_and_the_handoff():
    md = cap.report(full_doc(), nproc=2)
    assert md.startswith("## Capacity profile")
    assert "1-minute load average 1.00 at the start, 3.00 at the end (2 CPUs, shared" in md
    assert "| prompt tokens | seconds / prompt (ms) | prompts/s per pod" in md
    assert "| batch | ITL ms | tokens/s per pod | tokens/s per request |" in md
    assert "| 512           | 100" in md
    assert "median of 15 timed runs, in rounds over every bucket" in md and "median of 7 rounds of 32 steps" in md
    assert "`handoff_s` = 3.00 ms, at 512 tokens" in md and "ready-notice claim" in md
    assert "| 2,048" in md  # KV KiB of the 512-token prompt
    assert "model_name" not in md and "(tandem-tiny-py, 3.95M params); engine: dtype float32, cpu_threads 1." in md


def test_report_without_a_handoff_measurement():
    md = cap.report(build(handoff_s=0))
    assert "Not measured in this run (`handoff_s` = 0.0)" in md and "load average unknown" in md


class FakeEngine:
    """Records what the measuring views call; no JAX."""

    def __init__(self):
        self.info, self.calls = object(), []

    def prefill(self, ids, sampling):
        self.calls.append(("prefill", len(ids)))
        return "prefix"

    def export_prefix(self, prefix):
        self.calls.append(("export", prefix))

    def init_state(self):
        self.calls.append(("init",))
        return "state"

    def insert(self, prefix, state, slot, sampling):
        self.calls.append(("insert", slot))
        return state

    def free(self, state, slot):
        self.calls.append(("free", slot))
        return state

    def generate(self, state, rows=None):
        self.calls.append(("generate", rows))
        return state, "tokens"


def test_prefill_pod_view_exports_every_prompt():
    e = FakeEngine()
    pod = cap._PrefillPod(e)
    assert pod.info is e.info and pod.prefill([1, 2, 3], None) == "prefix"
    assert e.calls == [("prefill", 3), ("export", "prefix")]


def test_batch_view_steps_over_the_slots_in_use():
    e = FakeEngine()
    assert cap._Batch(e, 3).generate("state") == ("state", "tokens")
    assert e.calls == [("generate", 3)]


def test_occupy_refills_the_lowest_slots_and_frees_the_rest():
    e = FakeEngine()
    assert cap.occupy(e, "state", "prefix", 2, 5) == "state"
    assert e.calls == [("insert", 0), ("insert", 1), ("free", 2), ("free", 3), ("free", 4)]
    e.calls.clear()
    cap.occupy(e, "state", "prefix", 3, 1)
    assert e.calls == [("insert", 0), ("insert", 1), ("insert", 2)]


def test_parse_batches():
    assert cap.parse_batches("", 4) == (1, 2, 3, 4)
    assert cap.parse_batches("8,1, 2,4", 8) == (1, 2, 4, 8)
    for bad in ("x", "0,1", "9", ","):
        with pytest.raises(cap.CapacityError, match=r"--batches"):
            cap.parse_batches(bad, 8)


def test_help_explains(capsys):
    with pytest.raises(SystemExit) as ex:
        cap._parser().parse_args(["--help"])
    assert ex.value.code == 0
    out = capsys.readouterr().out
    for word in ("--quick", "--slots", "--out", "--model", "--dtype", "docs/planner.md", "builtin-cpu.json"):
        assert word in out
    a = cap._parser().parse_args([])
    assert (a.model, a.slots, a.max_len, a.cpu_threads, a.dtype) == ("builtin", 8, 512, 1, "float32")


def test_plans():
    assert cap.QUICK.prefill_reps < cap.FULL.prefill_reps and cap.QUICK.decode_rounds <= cap.FULL.decode_rounds
    # a round's steps fit max_len 512 after the 64-token prompt and the untimed step
    assert 64 + 1 + cap.FULL.decode_steps < 512


def test_the_shipped_builtin_profile():
    p = load_profile(BUILTIN_PROFILE)
    d = json.loads(BUILTIN_PROFILE.read_text())
    assert p.model == "builtin" and p.slots == 8
    assert [t for t, _ in p.prefill_points] == list(cap.DEFAULT_BUCKETS)
    assert [b for b, _ in p.decode_points] == list(range(1, 9))
    assert math.isfinite(p.handoff_s) and p.handoff_s > 0
    assert d["machine"] and d["created"] and d["command"].startswith("python bench/capacity.py")
    assert set(d["load_avg_1m"]) == {"start", "end"}
    assert d["engine"]["cpu_threads"] == 1 and d["engine"]["max_len"] == 512


def test_the_profile_ships_as_package_data():
    conf = tomllib.loads((BUILTIN_PROFILE.parents[2] / "pyproject.toml").read_text())
    st = conf["tool"]["setuptools"]
    assert "planner*" in st["packages"]["find"]["include"]
    assert "profiles/*.json" in st["package-data"]["planner"]
    for image in ("gateway", "worker-cpu", "worker-tpu"):  # the build context admits planner/ too
        ignore = BUILTIN_PROFILE.parents[2] / "docker" / f"{image}.Dockerfile.dockerignore"
        assert "!planner/" in ignore.read_text().split(), image


def test_prefill_from_another_profile(tmp_path):
    path = tmp_path / "prefill-pool.json"
    path.write_text(json.dumps(build(machine="v5e node", extra={"engine": {"tp": 8}})))
    got = cap.read_prefill_from(str(path), "builtin")
    assert got["points"] == PREFILL and got["machine"] == "v5e node" and got["engine"] == {"tp": 8}
    assert got["command"] == "python bench/capacity.py --quick" and got["path"] == str(path)
    with pytest.raises(cap.CapacityError, match=r"its model is 'builtin', this run measures 'llama'"):
        cap.read_prefill_from(str(path), "llama")
    src = {k: v for k, v in got.items() if k != "points"}
    md = cap.report(build(prefill=got["points"], extra={"prefill_from": src}))
    assert f"From `{path}`, measured on v5e node" in md


def test_dumps_puts_each_point_on_one_line():
    d = build(extra={"engine": {"prefill_buckets": [16, 64], "note": "a {brace}"}})
    text = cap.dumps(d)
    assert json.loads(text) == d and text.endswith("}\n")
    assert '{"tokens": 16, "seconds": 0.004}' in text and '{"batch": 4, "itl_s": 0.004}' in text
    assert '"prefill_buckets": [16, 64]' in text


def test_effective_cpu_threads():
    assert cap.effective_cpu_threads(1, "") == 1
    assert cap.effective_cpu_threads(1, "cpu") == 1
    assert cap.effective_cpu_threads(1, "tpu,cpu") == 1
    assert cap.effective_cpu_threads(1, "tpu") == 0
    assert cap.effective_cpu_threads(4, "cuda") == 0


def test_another_model_needs_its_own_out():
    with pytest.raises(SystemExit, match=r"--out: required for --model tiny"):
        cap.main(["--model", "tiny"])
    with pytest.raises(SystemExit, match=r"--batches '0'"):
        cap.main(["--batches", "0"])
    with pytest.raises(SystemExit, match=r"--handoff-tokens 100: not one of the buckets"):
        cap.main(["--handoff-tokens", "100"])
