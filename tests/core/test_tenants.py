"""Tenant tables: parsed or refused with one line naming the table; who a request is; what
it may ask and what it costs."""

from __future__ import annotations

import pytest

from epd_trio._core.errors import BadRequest
from epd_trio._core.tenants import (
    DEFAULT_MAX_TOKENS,
    DEFAULT_TENANT,
    Tenant,
    TenantTable,
    effective_priority,
    parse_tenants,
    prompt_estimate,
    token_reservation,
    tokens_used,
    with_priority,
)

TABLES = {
    "interactive": {"keys": ["sk-int-1"], "priority": 0, "weight": 2, "max_inflight": 64,
                    "requests_per_minute": 600, "tokens_per_minute": 200000},
    "batch": {"keys": "sk-batch", "priority": 1},
}


def test_tables_parse_from_the_file_or_from_json_alike() -> None:
    from_file = parse_tenants(TABLES)
    from_json = parse_tenants('{"interactive": {"keys": ["sk-int-1"], "priority": 0, '
                              '"weight": 2, "max_inflight": 64, "requests_per_minute": 600, '
                              '"tokens_per_minute": 200000}, "batch": {"keys": "sk-batch", '
                              '"priority": 1}}')
    assert from_file == from_json
    assert from_file[0] == Tenant("interactive", ("sk-int-1",), 0, 2.0, 64, 600, 200000)
    assert from_file[1] == Tenant("batch", ("sk-batch",), 1)


@pytest.mark.parametrize(("raw", "line"), [
    ({"batch": {"weight": 0}}, "tenants.batch: weight must be a number from 0.01 to 1000"),
    ({"batch": {"priority": "high"}}, "tenants.batch: priority must be an integer"),
    ({"batch": {"priority": True}}, "tenants.batch: priority must be an integer"),
    ({"batch": {"requests_per_minute": 0}}, "tenants.batch: requests_per_minute must be a "
                                            "positive integer"),
    ({"batch": {"tokens_per_minte": 5}}, "tenants.batch: unknown key 'tokens_per_minte'"),
    ({"batch": {"keys": ["has space"]}}, "tenants.batch: keys must be a list"),
    ({"batch": 3}, "tenants.batch: expected a table"),
    ({"b a": {}}, "tenants.b a: a tenant's name"),
    ({"a": {"keys": ["sk-same-key"]}, "b": {"keys": ["sk-same-key"]}},
     "tenants.b: key sk-s... also belongs to tenants.a"),
    ("{nope", "expected a JSON object of tables"),
    ({}, "expected tables"),
])
def test_a_malformed_table_is_refused_with_one_line_naming_it(raw: object, line: str) -> None:
    with pytest.raises(ValueError) as caught:
        parse_tenants(raw)
    assert str(caught.value).startswith(line) and "\n" not in str(caught.value)


def test_a_request_is_its_keys_tenant_else_its_headers_else_default() -> None:
    table = TenantTable(parse_tenants({**TABLES, "bulk": {"priority": 2}}))
    assert table.resolve("sk-int-1", "bulk").name == "interactive"  # the key wins
    assert table.resolve(None, "bulk").name == "bulk"
    assert table.resolve("sk-unknown", " bulk ").name == "bulk"
    assert table.resolve(None, "nobody").name == DEFAULT_TENANT
    assert table.resolve(None, None).name == DEFAULT_TENANT
    assert sorted(table.keys) == ["sk-batch", "sk-int-1"]


def test_a_header_cannot_name_a_tenant_that_has_keys() -> None:
    """Else any client of a plain key could take that tenant's band and spend its limits."""
    table = TenantTable(parse_tenants(TABLES))
    assert table.resolve(None, "batch").name == DEFAULT_TENANT
    assert table.resolve("sk-plain", "interactive").name == DEFAULT_TENANT
    assert table.resolve("sk-batch", "interactive").name == "batch"


def test_default_takes_a_table_of_its_own() -> None:
    table = TenantTable(parse_tenants({"default": {"priority": 3, "max_inflight": 2}}))
    assert table.resolve(None, None) == Tenant(DEFAULT_TENANT, priority=3, max_inflight=2)


@pytest.mark.parametrize(("tenant_priority", "body", "effective"), [
    (0, {}, 0),
    (1, {"priority": 5}, 5),      # lowered: allowed
    (1, {"priority": -10}, 1),    # raised above the tenant's: the tenant's
    (1, {"priority": None}, 1),
])
def test_a_client_may_lower_its_priority_never_raise_it(
    tenant_priority: int, body: dict[str, object], effective: int,
) -> None:
    assert effective_priority(Tenant("t", priority=tenant_priority), body) == effective


@pytest.mark.parametrize("bad", ["1", 1.5, True])
def test_a_priority_that_is_no_integer_is_a_400(bad: object) -> None:
    with pytest.raises(BadRequest, match="'priority' must be an integer"):
        effective_priority(Tenant("t"), {"priority": bad})


def test_the_effective_priority_is_sent_only_when_not_zero() -> None:
    assert with_priority({"model": "m", "priority": -3}, 0) == {"model": "m"}
    assert with_priority({"model": "m"}, 2) == {"model": "m", "priority": 2}
    body = {"model": "m", "priority": 2}
    assert with_priority(body, 2) is body


def test_the_reservation_is_the_prompt_estimate_plus_the_answers_bound() -> None:
    chat = {"messages": [{"role": "user", "content": "x" * 40},
                         {"role": "user", "content": [{"type": "text", "text": "y" * 8},
                                                      {"type": "image_url"}]}]}
    assert prompt_estimate(chat) == 10 + 2 + 256
    assert token_reservation({**chat, "max_tokens": 100}) == 268 + 100
    assert token_reservation({**chat, "max_completion_tokens": 7, "n": 2}) == 268 + 14
    assert token_reservation(chat) == 268 + DEFAULT_MAX_TOKENS
    assert prompt_estimate({"prompt": [[1, 2, 3], "abcd"]}) == 4
    assert prompt_estimate({"prompt": [1, 2, 3]}) == 3


def test_a_finished_request_settles_its_usage_else_what_it_relayed() -> None:
    assert tokens_used(50, (40, 7), events=99) == 47
    assert tokens_used(50, None, events=12) == 62
    assert tokens_used(50, None, events=0) == 50
