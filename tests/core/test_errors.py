"""The error shape's ``param``: named by the raise, or by the quoted field a message opens with."""

from __future__ import annotations

import orjson
import pytest

from epd_trio._core.errors import BadRequest, ProxyError


@pytest.mark.parametrize(("error", "param"), [
    (BadRequest("'model' is required and must be a non-empty string"), "model"),
    (BadRequest("'dp_size' must be an integer >= 1: got 0"), "dp_size"),
    (BadRequest("'url' is required: the instance's base URL (http://host:port)"), "url"),
    (BadRequest("messages[0].role is required", param="messages[0].role"), "messages[0].role"),
    (BadRequest("request body must be a JSON object"), None),
    (BadRequest("cannot mix 'prefill_decode' with separate prefill/decode"), None),  # not opening
    (ProxyError("internal proxy error"), None),
])
def test_param_names_the_field_at_fault(error: ProxyError, param: str | None) -> None:
    assert orjson.loads(error.body())["error"]["param"] == param
