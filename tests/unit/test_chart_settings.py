"""The chart's values are the services' settings: every TANDEM_* variable the chart renders is a
field of that service's pydantic settings class (nested blocks joined with `__`), every field is
set, the class parses the rendered environment back into the chart's values, and values that
cannot work fail at install with the chart's own message. Rendering helpers live in test_chart.py.
"""
from __future__ import annotations

import json
import os
from typing import Any

import helm_python as helm
import pytest
import yaml

from tests.unit.test_chart import (
    CHART, DEFAULT_OVERRIDES, PROFILES, RELEASE, RUNTIME_ENV, SERVICES, Rendered, components, env_name,
    field_default, flatten, render, rendered, settings_fields, settings_schema,
)
WORKERS = ("prefill", "decode")


@pytest.mark.parametrize("profile,component", [(p, c) for p in PROFILES for c in components(p)])
def test_env_is_exactly_the_settings_class(profile, component, monkeypatch):
    """Every TANDEM_* variable is a field of the service's settings class (nested with `__`), every
    field is set, and the class parses the rendered environment back into the chart's values."""
    cls, prefix, owned = SERVICES[component]
    r = rendered(profile)
    env = r.container_env(component)
    fields = settings_fields(cls)
    by_env = {env_name(prefix, path): path for path in fields}

    tandem_vars = {k for k in env if k.startswith("TANDEM_")}
    assert all(k.startswith(prefix) for k in tandem_vars), f"{component} got another service's settings"
    unknown = tandem_vars - set(by_env)
    assert not unknown, f"{component}: not fields of {cls.__name__}: {sorted(unknown)}"
    extra_env = {e["name"] for e in r.values[component].get("extraEnv", [])}
    assert set(env) - tandem_vars <= RUNTIME_ENV | extra_env

    # Every field is set, except the optional secrets the chart leaves at their default when the
    # feature is off (no Redis password; gateway auth disabled; grpcTLS off).
    optional = {"redis.password", "redis.username"} | ({"api_keys", "admin_key"} if component == "gateway" else set())
    if component in WORKERS and not r.values["grpcTLS"]["enabled"]:
        optional |= {"grpc.tls_cert_file", "grpc.tls_key_file", "grpc.tls_ca_file", "grpc.tls_server_name"}
    missing = {by_env_name for by_env_name, path in by_env.items() if by_env_name not in env and path not in optional}
    assert not missing, f"{component}: settings not set by the chart: {sorted(missing)}"
    required = {env_name(prefix, p) for p, info in fields.items() if info.is_required()}
    assert required <= set(env)
    # Chart-owned settings come from Secrets / the downward API, never from a literal value.
    assert env[env_name(prefix, "redis.url")]["value"].startswith(("redis://", "rediss://"))
    if component in WORKERS:
        assert env[prefix + "WORKER_ID"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
        assert env[prefix + "GRPC__ADVERTISE_HOST"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    for name in (env_name(prefix, "redis.password"), prefix + "API_KEYS", prefix + "ADMIN_KEY"):
        if name in env:
            assert "secretKeyRef" in env[name]["valueFrom"], name

    # Round trip: build the settings object from the rendered environment.
    fake = {"metadata.name": "pod-abc", "status.podIP": "10.8.0.7"}
    for k in [k for k in os.environ if k.startswith("TANDEM_")]:
        monkeypatch.delenv(k)
    for name, e in env.items():
        if not name.startswith("TANDEM_"):
            continue
        if "value" in e:
            monkeypatch.setenv(name, e["value"])
        elif "fieldRef" in e["valueFrom"]:
            monkeypatch.setenv(name, fake[e["valueFrom"]["fieldRef"]["fieldPath"]])
        else:
            monkeypatch.setenv(name, '["k1"]' if name.endswith("API_KEYS") else "s3cret")
    built = cls()
    for path, want in flatten(r.values[component]["settings"]).items():
        got = _get(built, path)
        assert got == want, f"{component}.settings.{path}: chart {want!r} -> service parsed {got!r}"
    if component in WORKERS:
        assert built.worker_id == "pod-abc" and built.grpc.advertise_host == "10.8.0.7"


def _get(obj: Any, path: str) -> Any:
    for part in path.split("."):
        obj = getattr(obj, part)
    return obj


@pytest.mark.parametrize("component", SERVICES)
def test_values_mirror_settings_one_to_one(component):
    """values.yaml `settings:` holds every field except the chart-owned ones, with the code's
    defaults (unless listed in DEFAULT_OVERRIDES), and the schema mirrors the same fields."""
    cls, _, owned = SERVICES[component]
    fields = set(settings_fields(cls))
    defaults = yaml.safe_load((CHART / "values.yaml").read_text())[component]["settings"]
    assert set(flatten(defaults)) == fields - owned
    for path, value in flatten(defaults).items():
        want = DEFAULT_OVERRIDES.get((component, path), field_default(cls, path))
        assert value == want, f"values.yaml {component}.settings.{path} = {value!r}, code default {want!r}"
    schema = json.loads((CHART / "values.schema.json").read_text())
    block = schema["properties"][component]["properties"]["settings"]
    assert set(flatten(_schema_props(block))) == fields - owned


def _schema_props(block: dict) -> dict:
    return {k: _schema_props(v) if "properties" in v else True for k, v in block["properties"].items()}


def test_schema_settings_are_generated_from_the_classes():
    schema = json.loads((CHART / "values.schema.json").read_text())
    for component, (cls, _, owned) in SERVICES.items():
        assert schema["properties"][component]["properties"]["settings"] == settings_schema(cls, owned), (
            f"{component}: values.schema.json is stale; run `python tests/unit/test_chart.py --write-schema`")


# Bad values fail at install with the chart's own message
# ------------------------------------------------------------------------------------------------

BAD_VALUES = [
    ("topology-chips", {"prefill": {"tpu": {"enabled": True, "topology": "2x4", "chips": 4}}},
     "prefill.tpu.chips=4 does not match prefill.tpu.topology=2x4, which has 8 chips"),
    ("multi-host", {"decode": {"tpu": {"enabled": True, "accelerator": "tpu-v6e-slice", "topology": "4x4", "chips": 16}}},
     "multi-host slice"),
    ("no-redis", {"redis": {"enabled": False}}, "no Redis configured"),
    ("two-redis", {"externalRedis": {"url": "redis://10.0.0.3:6379/0"}}, "use one Redis"),
    ("password-in-url", {"redis": {"enabled": False}, "externalRedis": {"url": "rediss://:pw@10.0.0.3:6378/0"}},
     "must not carry credentials"),
    ("ca-without-tls", {"redis": {"enabled": False}, "externalRedis": {"url": "redis://10.0.0.3:6379", "tls": {"caSecret": "ca"}}},
     "is not rediss://"),
    ("hpa-and-keda", {"decode": {"autoscaling": {"enabled": True}, "keda": {"enabled": True}}}, "enable one of them"),
    ("context-len", {"gateway": {"settings": {"max_context_len": 1024}}}, "max_context_len (1024) must equal"),
    ("prompt-len", {"gateway": {"settings": {"max_prompt_len": 256}}}, "largest prefill bucket"),
    ("pool", {"decode": {"settings": {"pool": "other"}}}, "settings.pool must be equal"),
    ("dtype", {"decode": {"settings": {"engine": {"dtype": "bfloat16"}}}}, "engine.dtype must match"),
    ("model", {"decode": {"settings": {"engine": {"model": "/models/x"}}}}, "must name the same model"),
    ("quantize", {"decode": {"settings": {"engine": {"quantize": "int8"}}}}, "engine.quantize must match"),
    ("liveness", {"prefill": {"probes": {"liveness": {"periodSeconds": 5, "failureThreshold": 2}}}}, "liveness window"),
    ("grpc-tls-no-health-port", {"decode": {"settings": {"grpc": {"health_port": 0}}}},
     "grpcTLS.enabled needs decode.settings.grpc.health_port"),
    ("grpc-tls-health-port-is-the-tls-port", {"prefill": {"settings": {"grpc": {"health_port": 50061}}}},
     "prefill.settings.grpc.health_port must differ"),
    ("metrics-port-clash", {"gateway": {"settings": {"metrics_port": 8000}}}, "metrics_port must differ"),
    ("grpc-tls-cert-manager", {"grpcTLS": {"certManager": {"enabled": "yes"}}}, "/grpcTLS/certManager/enabled"),
    # values.schema.json: Helm names the offending path.
    ("settings-typo", {"prefill": {"settings": {"kv_budget": 1}}}, "/prefill/settings"),
    ("bad-dtype", {"prefill": {"settings": {"engine": {"dtype": "fp8"}}}}, "/prefill/settings/engine/dtype"),
    ("bad-quantize", {"prefill": {"settings": {"engine": {"quantize": "int4"}}}}, "/prefill/settings/engine/quantize"),
    ("bad-topology", {"prefill": {"tpu": {"topology": "2by4"}}}, "/prefill/tpu/topology"),
    ("port-zero", {"decode": {"settings": {"grpc": {"port": 0}}}}, "/decode/settings/grpc/port"),
    ("negative-budget", {"prefill": {"settings": {"kv_budget_bytes": -1}}}, "/prefill/settings/kv_budget_bytes"),
    ("settings-via-extraEnv", {"gateway": {"extraEnv": [{"name": "TANDEM_GATEWAY_PORT", "value": "1"}]}}, "/gateway/extraEnv/0/name"),
    ("unknown-top-level", {"gatway": {}}, "gatway"),
    ("eviction", {"redis": {"maxmemoryPolicy": "allkeys-lru"}}, "/redis/maxmemoryPolicy"),
]


@pytest.mark.parametrize("values,message", [pytest.param(v, m, id=i) for i, v, m in BAD_VALUES])
def test_bad_values_fail_with_a_clear_message(values, message):
    with pytest.raises(helm.HelmError) as err:
        render(values)
    assert message in str(err.value)


def test_int8_weights_reach_both_worker_pools():
    """`engine.quantize: int8` set alike on prefill and decode renders, and each pod gets it."""
    r = Rendered({w: {"settings": {"engine": {"quantize": "int8"}}} for w in WORKERS})
    assert r.container_env("prefill")["TANDEM_PREFILL_ENGINE__QUANTIZE"]["value"] == "int8"
    assert r.container_env("decode")["TANDEM_DECODE_ENGINE__QUANTIZE"]["value"] == "int8"


def test_good_variants_render():
    """Edge cases that must keep working: a 3-D v5p topology, one pool on TPU and one on CPU,
    a custom pool name (KEDA stream names follow it), and integers Helm keeps as floats."""
    r = Rendered({
        "prefill": {"tpu": {"enabled": True, "accelerator": "tpu-v5p-slice", "topology": "2x2x1", "chips": 4},
                    "settings": {"pool": "chat", "kv_budget_bytes": 34359738368}, "keda": {"enabled": True}},
        "decode": {"settings": {"pool": "chat"}},
        "gateway": {"settings": {"pool": "chat"}},
    })
    env = r.container_env("prefill")
    assert env["TANDEM_PREFILL_KV_BUDGET_BYTES"]["value"] == "34359738368"
    assert r.component("prefill")["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]["google.com/tpu"] == 4
    assert "google.com/tpu" not in json.dumps(r.component("decode"))
    so = r.get("ScaledObject", f"{RELEASE}-tandem-prefill")
    assert {t["metadata"]["stream"] for t in so["spec"]["triggers"]} == {"tandem:{s0.0}:chat:adm:high", "tandem:{s0.0}:chat:adm:normal"}


# ------------------------------------------------------------------------------------------------
