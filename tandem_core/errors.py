"""One error hierarchy for every service; each error knows its gRPC code, HTTP status and
whether retrying can help. Transports map errors in one place each (gateway exception handler,
gRPC servicer helper) using these attributes.
"""
from __future__ import annotations


class TandemError(Exception):
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
    pass


class ModelNotFound(TandemError):
    grpc_code = "NOT_FOUND"
    http_status = 404
    error_type = "model_not_found"


class Unauthenticated(TandemError):
    grpc_code = "UNAUTHENTICATED"
    http_status = 401
    error_type = "authentication_error"


class PermissionDenied(TandemError):
    grpc_code = "PERMISSION_DENIED"
    http_status = 403
    error_type = "permission_error"


class AdmissionRejected(TandemError):
    """The cluster is over its admission bound: retry later (Retry-After)."""

    grpc_code = "RESOURCE_EXHAUSTED"
    http_status = 429
    retryable = True
    error_type = "rate_limit_error"


class DeadlineExceeded(TandemError):
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


class KVNotFound(TandemError):
    grpc_code = "NOT_FOUND"
    http_status = 404
    error_type = "kv_not_found"


class ServiceUnavailable(TandemError):
    grpc_code = "UNAVAILABLE"
    http_status = 503
    retryable = True
    error_type = "service_unavailable"


class WorkerFailed(TandemError):
    """A worker reported the request failed (its message says why)."""

    grpc_code = "INTERNAL"
    http_status = 500
    error_type = "worker_error"
