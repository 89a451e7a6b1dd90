"""One client's attachment to one request: the validated request plus what this relay alone holds.

`Prepared` (validation.py) is what the client asked for, checked, and never changes after the front
end completes it. What belongs to one relay of it lives here instead, built complete in one place
each:
1. `Admitter.submit` (admission.py), for a new request: the per-key limiter lease it holds and the
   id of its admission entry (the start of the queue-time metric).
2. `Streaming.reattach` (streaming.py), for a resume or a POST sent again: which attachment of a
   resumable request this is (`attach_no`, what the grace cancel compares against).
`Streaming.stream` then relays it and releases the lease once, when the relay ends.
"""
from __future__ import annotations

from dataclasses import dataclass

from gateway.limits import Lease
from gateway.validation import Prepared


@dataclass(frozen=True)
class Attachment:
    prep: Prepared
    lease: Lease | None = None  # the per-key limiter's lease, held while relaying (None: no limits, or a resume)
    entry_id: bytes | None = None  # the admission stream entry id, once enqueued (None on a resume)
    attach_no: int = 0  # which client attachment of a resumable request this relay serves

    @property
    def request_id(self) -> str:
        return self.prep.request.request_id

    def release(self, used_tokens: int) -> None:
        """Give the lease back (idempotent), refunding what the request did not use."""
        if self.lease is not None:
            self.lease.release(used_tokens)
