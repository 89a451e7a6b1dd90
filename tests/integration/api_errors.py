"""The one check of an OpenAI-style error body, for the gateway's HTTP tests."""
from __future__ import annotations


def assert_api_error(resp, status: int, param: str | None, *words: str) -> None:
    """`resp` is an error with `status`, exactly OpenAI's four fields, naming `param`, and a
    message that contains each of `words`."""
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["param"] == param, err
    for w in words:
        assert w in err["message"], (w, err["message"])
