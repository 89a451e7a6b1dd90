"""One error hierarchy for every service; each error knows its gRPC code, HTTP status and
whether retrying can help. Transports map errors in one place each (gateway exception handler,
gRPC servicer helper) using these attributes.
"""
from __future__ import annotations


class TandemError(Exception):
    """Every error a caller sees. Its message says what is wrong and what to do next (retry, after
    how long, or which input or setting to change); `retry_after_s` travels as Retry-After."""

    grpc_code = "INTERNAL"
    http_status = 500
    retryable = False
    error_type = "internal_error"

    def __init__(self, message: str, *, param: str | None = None, retry_after_s: float | None = None):
        super().__init__(message)
        self.message = message
        self.param = param
        self.retry_after_s = retry_after_s


class InvalidRequest(TandemError):
    """The request is malformed: fix it, do not retry."""

    grpc_code = "INVALID_ARGUMENT"
    http_status = 400
    error_type = "invalid_request_error"


class PromptTooLong(InvalidRequest):
    """The prompt does not fit the limits (max_prompt_len, the context): shorten it or lower
    max_tokens."""


class ModelNotFound(TandemError):
    """The model named is not served here (or not found on disk): use the model id /v1/models
    lists, or give a preset name or a Llama checkpoint directory."""

    grpc_code = "NOT_FOUND"
    http_status = 404
    error_type = "model_not_found"


class Unauthenticated(TandemError):
    """No valid API key: send 'Authorization: Bearer <key>' with a key the gateway knows."""

    grpc_code = "UNAUTHENTICATED"
    http_status = 401
    error_type = "authentication_error"


class PermissionDenied(TandemError):
    """The caller may not use this at all as the gateway is configured (e.g. /admin/* while API
    keys are set and no admin key is): the message says which setting opens it."""

    grpc_code = "PERMISSION_DENIED"
    http_status = 403
    error_type = "permission_error"


class AdmissionRejected(TandemError):
    """The cluster is over its admission bound: retry later (Retry-After)."""

    grpc_code = "RESOURCE_EXHAUSTED"
    http_status = 429
    retryable = True
    error_type = "rate_limit_error"


class OutOfKVBlocks(AdmissionRejected):
    """A decode engine's KV block pool has too few free blocks for this prompt (paged KV): a
    capacity condition, not a bad request, so it is retryable (RESOURCE_EXHAUSTED, like any
    admission bound). A decode pod checks `kv_blocks_free()` before it claims a prompt and hands
    the request back (to another pod, or later) instead of failing it."""


class DeadlineExceeded(TandemError):
    """The request ran past its deadline and was cancelled everywhere: retry later or with a
    longer timeout."""

    grpc_code = "DEADLINE_EXCEEDED"
    http_status = 504
    retryable = True
    error_type = "timeout_error"


class KVTransferFailed(TandemError):
    """The KV pull failed (prefill pod gone, checksum mismatch): re-prefill."""

    grpc_code = "UNAVAILABLE"
    http_status = 503
    retryable = True
    error_type = "kv_transfer_error"


class KVSuperseded(KVTransferFailed):
    """The prefill pod holds KV under the request's id, but for another capability: a later
    prefill of the same request (it was resumed, or its admission entry prefilled again) replaced
    the KV this ready notice names. The notice is stale; the later prefill's own notice carries
    the request on, so this one is acked with no resume (a resume would run it twice and spend
    one of its attempts)."""


class ServiceUnavailable(TandemError):
    """Redis or the workers cannot take the request now (an outage, a predicted first token past
    the deadline): retry after `retry_after_s`."""

    grpc_code = "UNAVAILABLE"
    http_status = 503
    retryable = True
    error_type = "service_unavailable"


class WorkerFailed(TandemError):
    """A worker reported the request failed (its message says why): retry it; a request that
    fails again the same way is worth a bug report with its request id."""

    grpc_code = "INTERNAL"
    http_status = 500
    error_type = "worker_error"
