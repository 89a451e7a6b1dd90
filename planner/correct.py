"""How much slower (or faster) the pods are than the capacity profile says, measured.

A profile is measured on one engine alone. Real pods share their hosts, pad prompts to their
bucket, copy new prompt blocks into the prefix cache, and relay tokens through Redis. So, as
Dynamo's planner does, the planner scales the profile by what it sees:
- prefill: the prefill pods' own recent seconds a prompt (their heartbeats' `prefill_ema_s`)
  over what the profile gives for the interval's mean prompt;
- decode: the gateways' mean inter-token gap over the profile's step time at the batch the pods
  ran (by Little's law: tokens/s per decode pod x seconds a step = requests per step). The gap is
  per token, so pods that emit several tokens a row per step (speculative decoding,
  decode_svc/speculate.py) show as faster than the profile by their tokens per step, less what
  their verify calls cost (bench/plan_model.py's `tokens_per_step` simulates it).
Each factor is an exponential average of those ratios, clamped to [1/LIMIT, LIMIT], updated only
in an interval that has the measurements; 1.0 until then. Pure: no clock, no I/O.
"""
from __future__ import annotations

from dataclasses import dataclass

from planner.profile import Profile

LIMIT = 5.0


@dataclass
class Corrections:
    enabled: bool = True
    smoothing: float = 0.5
    prefill: float = 1.0
    decode: float = 1.0

    def _mix(self, old: float, ratio: float) -> float:
        ratio = min(LIMIT, max(1.0 / LIMIT, ratio))
        return self.smoothing * ratio + (1 - self.smoothing) * old

    def observe(self, obs, profile: Profile, decode_pods: int) -> None:
        if not self.enabled:
            return
        isl = obs.prefill_prompt_tokens_mean or obs.prompt_tokens_mean
        if obs.prefill_seconds_seen and obs.prefilled_per_s and isl:
            self.prefill = self._mix(self.prefill, obs.prefill_seconds_seen / profile.prefill_seconds(isl))
        if obs.itl_mean_s and obs.decoded_tokens_per_s and decode_pods > 0:
            batch = obs.decoded_tokens_per_s / decode_pods * obs.itl_mean_s
            self.decode = self._mix(self.decode, obs.itl_mean_s / profile.decode_itl(batch))
