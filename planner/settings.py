"""Planner settings: environment `TANDEM_PLANNER_*` (nested blocks with `__`)."""
from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field, PositiveFloat, PositiveInt, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from tandem_core.settings import RedisConfig


class SLOConfig(BaseModel):
    """What the planner sizes the two roles for: mean time to first token and mean gap between
    tokens, as the gateway measures them (its tandem_ttft_seconds / tandem_itl_seconds)."""

    ttft_s: PositiveFloat = 1.0
    itl_s: PositiveFloat = 0.05


class RoleBounds(BaseModel):
    """Replica bounds of one role, and the Kubernetes Deployment that runs it."""

    min_replicas: int = Field(default=1, ge=0)  # 0 only with allow_zero: never scaled to zero by accident
    max_replicas: PositiveInt = 8
    allow_zero: bool = False
    deployment: str = ""  # Deployment name (mode=kubernetes); the chart sets it

    @model_validator(mode="after")
    def _bounds(self) -> "RoleBounds":
        if self.min_replicas == 0 and not self.allow_zero:
            raise ValueError("min_replicas 0 scales a role to zero when idle: set allow_zero=true to mean it")
        if self.min_replicas > self.max_replicas:
            raise ValueError(f"min_replicas {self.min_replicas} > max_replicas {self.max_replicas}")
        return self


class KubernetesConfig(BaseModel):
    """mode=kubernetes: scale the Deployments through the scale subresource, while this replica
    holds the coordination.k8s.io Lease (one active planner)."""

    namespace: str = ""  # default: the pod's own (the service account's namespace file), else "default"
    lease_name: str = "tandem-planner"
    lease_duration_s: PositiveInt = 15
    identity: str = ""  # default: hostname-pid
    record_file: str = ""  # no cluster: append what would be sent here (JSON lines) instead of sending it


class PlannerSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="TANDEM_PLANNER_", env_nested_delimiter="__")

    redis: RedisConfig = RedisConfig()  # TANDEM_PLANNER_REDIS__URL
    host: str = "0.0.0.0"
    port: int = Field(default=9300, ge=0, le=65535)  # /metrics, /keda, /decision, /healthz
    pool: str = "default"
    profile_path: str = ""  # capacity profile JSON (bench/capacity.py); "" = the built-in model's, shipped
    slo: SLOConfig = SLOConfig()
    prefill: RoleBounds = RoleBounds()
    decode: RoleBounds = RoleBounds()
    # off: decide and publish (gauges, the KEDA endpoint); kubernetes: also scale the Deployments;
    # local: also write the decision to Redis for `tandem local --planner` to follow.
    mode: Literal["off", "kubernetes", "local"] = "off"
    kubernetes: KubernetesConfig = KubernetesConfig()
    interval_s: PositiveFloat = 30.0  # one observation and one decision per interval
    # The predictor (planner/predict.py): Holt's linear smoothing of the arrival rate and lengths,
    # plus margin_sigmas standard deviations of its own recent one-step errors.
    smoothing: float = Field(default=0.5, gt=0.0, le=1.0)
    trend_smoothing: float = Field(default=0.3, ge=0.0, le=1.0)
    margin_sigmas: float = Field(default=1.0, ge=0.0, le=10.0)
    max_utilization: float = Field(default=0.8, gt=0.0, le=1.0)  # of a pod's profiled capacity
    correction: bool = True  # scale the profile by the pods' measured speed (planner/correct.py)
    scale_up_cooldown_s: float = Field(default=60.0, ge=0.0)
    scale_down_cooldown_s: float = Field(default=300.0, ge=0.0)  # also: scale down to the max wanted over it
    log_level: str = "INFO"
