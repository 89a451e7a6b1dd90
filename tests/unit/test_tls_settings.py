"""Issue 42: a partial TLS configuration of a pod's gRPC (some of `tls_cert_file`, `tls_key_file`,
`tls_ca_file` set, not all) is refused when the settings are read, naming what is missing, instead
of silently serving and dialing in plaintext."""
from __future__ import annotations

import pytest
from pydantic import ValidationError

from prefill_svc.settings import PrefillSettings
from tandem_core.settings import GrpcConfig


def test_all_or_none_of_the_tls_files():
    assert not GrpcConfig().tls
    assert GrpcConfig(tls_cert_file="c", tls_key_file="k", tls_ca_file="a").tls
    with pytest.raises(ValidationError, match="tls_ca_file"):
        GrpcConfig(tls_cert_file="c", tls_key_file="k")


def test_a_partial_tls_environment_stops_a_pod_at_start(monkeypatch):
    monkeypatch.setenv("TANDEM_PREFILL_GRPC__TLS_CERT_FILE", "/etc/tandem/tls/tls.crt")
    with pytest.raises(ValidationError, match="tls_key_file.*tls_ca_file|plaintext"):
        PrefillSettings()
