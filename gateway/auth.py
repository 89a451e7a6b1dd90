"""Who may call the gateway: API keys (each the identity of its limiter lease and of the resume
check) and the admin key of /admin/*. Keys compare in constant time."""
from __future__ import annotations

import hmac

from tandem_core.errors import PermissionDenied, Unauthenticated

ANONYMOUS = "anonymous"  # the one limiter key when no api_keys are configured


class Auth:
    def __init__(self, settings) -> None:  # GatewaySettings: api_keys, admin_key, read per call
        self.settings = settings

    def check_api_key(self, authorization: str | None) -> str:
        """The caller's key (the limiter's and the resume check's identity), or Unauthenticated."""
        if not self.settings.api_keys:
            return ANONYMOUS
        if not bearer_ok(authorization, self.settings.api_keys):
            raise Unauthenticated("missing or invalid API key: send 'Authorization: Bearer <key>'")
        return authorization.partition(" ")[2].strip()

    def check_admin_key(self, authorization: str | None) -> None:
        """The admin key when one is set. With API keys but no admin key, /admin/* is refused to
        everyone (403): an API key is a client's, not an operator's, so it never opens the admin
        routes. With neither, open (a development gateway)."""
        if not self.settings.admin_key:
            if self.settings.api_keys:
                raise PermissionDenied("the admin routes are off: API keys are set but no admin key; set "
                                       "admin_key (TANDEM_GATEWAY_ADMIN_KEY; the chart: gateway.auth.adminKey or "
                                       "the admin-key of gateway.auth.existingSecret) and send it as "
                                       "'Authorization: Bearer <admin key>'")
        elif not bearer_ok(authorization, [self.settings.admin_key]):
            raise Unauthenticated("missing or invalid admin key: send 'Authorization: Bearer <admin key>'")


def bearer_ok(authorization: str | None, allowed: list[str]) -> bool:
    if not authorization:
        return False
    scheme, _, token = authorization.partition(" ")
    if scheme.lower() != "bearer" or not token:
        return False
    token = token.strip().encode()
    return any(hmac.compare_digest(token, k.encode()) for k in allowed)
