"""Prefill service settings: environment `TANDEM_PREFILL_*` (nested blocks with `__`). The fields
every worker has come from `tandem_core.settings.WorkerSettings`; these are the prefill pod's own,
and the shared ones whose default differs here."""
from __future__ import annotations

from pydantic import PositiveFloat, PositiveInt
from pydantic_settings import SettingsConfigDict

from tandem_core.settings import GrpcConfig, WorkerSettings


class PrefillSettings(WorkerSettings):
    model_config = SettingsConfigDict(env_prefix="TANDEM_PREFILL_", env_nested_delimiter="__")

    grpc: GrpcConfig = GrpcConfig(port=50061)  # KV transfer + gRPC health
    kv_budget_bytes: PositiveInt = 256 * 1024 * 1024  # held KV above this stops claiming prompts
    kv_lease_s: PositiveFloat = 60.0  # KV not pulled within this is freed
    kv_chunk_bytes: PositiveInt = 1024 * 1024
    max_batch: PositiveInt = 8  # prompts claimed per read
    # One engine call prefills the waiting prompts of one length bucket together, up to this many
    # padded tokens (at least one prompt): 4 x 128, 2 x 256, a 512 alone (on CPU a batch of long prompts
    # is no faster per prompt: bench/burst.py; an accelerator wants far more). Never waits for company.
    prefill_batch_tokens: PositiveInt = 512
    ready_maxlen: PositiveInt = 10000
    # An admission entry whose request's deadline passed this long ago is acked unanswered: its
    # gateway gave up on it long since (a backlog left while every prefill pod was down).
    abandoned_after_s: PositiveFloat = 60.0
