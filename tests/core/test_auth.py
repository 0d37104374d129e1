"""Key checks (pure) for client API keys and the admin key."""

from __future__ import annotations

import pytest

from epd_trio._core.auth import AdminKey, ClientKeys
from epd_trio._core.errors import AdminDisabled, AdminUnauthorized, Unauthorized


def test_client_keys_off_without_keys() -> None:
    keys = ClientKeys([])
    assert not keys.enabled
    keys.check(None)  # nothing required


@pytest.mark.parametrize("header", ["Bearer k1", "bearer k2", "  Bearer   k2  "])
def test_client_keys_accept_any_configured_key(header: str) -> None:
    ClientKeys(["k1", "k2"]).check(header)


@pytest.mark.parametrize(
    "header, fragment",
    [(None, "missing"), ("", "missing"), ("k1", "missing"), ("Basic k1", "missing"),
     ("Bearer ", "missing"), ("Bearer k3", "incorrect"), ("Bearer k1x", "incorrect"),
     ("Bearer K1", "incorrect")],
)
def test_client_keys_refuse(header: str | None, fragment: str) -> None:
    with pytest.raises(Unauthorized, match=fragment) as info:
        ClientKeys(["k1", "k2"]).check(header)
    payload = info.value.payload()["error"]
    assert info.value.status == 401 and info.value.headers == {"www-authenticate": "Bearer"}
    assert payload["type"] == "invalid_request_error" and payload["code"] == "invalid_api_key"


def test_admin_key() -> None:
    with pytest.raises(AdminDisabled) as disabled:
        AdminKey(None).check("anything", required=True)
    assert disabled.value.status == 403
    AdminKey(None).check(None, required=False)  # profiling stays open without an admin key
    key = AdminKey("s3cret")
    key.check("s3cret", required=True)
    for presented in (None, "", "s3cre", "s3cret "):
        for required in (True, False):
            with pytest.raises(AdminUnauthorized) as info:
                key.check(presented, required=required)
            assert info.value.status == 401
            assert info.value.payload()["error"]["code"] == "invalid_admin_key"
