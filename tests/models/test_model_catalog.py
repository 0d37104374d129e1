"""A name resolved on the pools of now (``_models/catalog``), the ``/v1/models`` listing, the
answers read from ``/v1/models`` (``_models/cards``) and the tables (``_models/tables``)."""

from __future__ import annotations

import orjson
import pytest

from epd_trio._core.config import ConfigError, settings_from
from epd_trio._core.errors import BadRequest, ModelNotFound, NoInstance, error_reply
from epd_trio._core.roster import Card
from epd_trio._core.routing import Instance
from epd_trio._models.cards import NoAnswer, served_from
from epd_trio._models.catalog import Catalog
from epd_trio._models.pools import ANY_POOL, Pool
from epd_trio._models.tables import Alias, parse_tables

D0 = Instance("http://d0:1")


def pool(name: str, *cards: Card) -> Pool:
    return Pool(name, {"decode": (D0,)}, frozenset({"decode"}), cards)


CHAT = Alias("chat", (("A", 90.0), ("B", 10.0)))
SECRET = Alias("secret", (("B", 1.0),), hidden=True)


def test_a_name_finds_its_pool_then_an_alias_then_the_any_pool_else_vllms_404() -> None:
    catalog = Catalog({"A": pool("A"), "B": pool("B")}, {"chat": CHAT})
    assert catalog.find("A").model == "A"  # type: ignore[union-attr]
    assert catalog.find("chat") is CHAT
    with pytest.raises(ModelNotFound) as caught:
        catalog.find("nosuch")
    status, _, body = error_reply(caught.value)
    assert status == 404
    assert orjson.loads(body) == {"error": {
        "message": "The model `nosuch` does not exist.", "type": "NotFoundError",
        "param": "model", "code": 404}}
    anyone = Catalog({"A": pool("A"), ANY_POOL: pool(ANY_POOL)}, {})
    assert anyone.find("nosuch").model == ANY_POOL  # type: ignore[union-attr]
    with pytest.raises(ModelNotFound):  # "*" is no name a client can send
        Catalog({"A": pool("A")}, {}).find(ANY_POOL)


def test_a_tenants_list_hides_the_rest_with_the_same_404() -> None:
    catalog = Catalog({"A": pool("A"), "B": pool("B")}, {"chat": CHAT})
    assert catalog.find("chat", allowed={"chat"}) is CHAT
    with pytest.raises(ModelNotFound, match="`A` does not exist"):
        catalog.find("A", allowed={"chat"})


def test_no_model_in_the_body_means_the_one_model_else_a_400() -> None:
    assert Catalog({"A": pool("A")}, {"chat": CHAT}).default() == "A"
    assert Catalog({ANY_POOL: pool(ANY_POOL)}, {}).default() == ANY_POOL
    with pytest.raises(BadRequest) as caught:
        Catalog({"A": pool("A"), "B": pool("B")}, {}).default()
    assert caught.value.param == "model" and "A, B" in caught.value.message


def test_before_any_instance_answered_an_unknown_name_is_a_503_not_a_404() -> None:
    catalog = Catalog({}, {}, pending="none of the 2 instance(s) has said what it serves yet")
    with pytest.raises(NoInstance, match="no instance serves 'A' yet"):
        catalog.find("A")


def test_the_listing_shows_live_models_with_their_cards_and_visible_aliases() -> None:
    card = Card("A", root="/models/a", max_model_len=4096)
    catalog = Catalog({"A": pool("A", card), "B": pool("B")}, {"chat": CHAT, "secret": SECRET})
    listing = catalog.listing(lambda p: p.model != "B")
    assert listing["object"] == "list"
    assert [(c["id"], c["root"], c["parent"], c["max_model_len"]) for c in listing["data"]] == [
        ("A", "/models/a", None, 4096), ("chat", None, None, 4096)]
    only_chat = catalog.listing(lambda p: True, allowed={"chat"})
    assert [c["id"] for c in only_chat["data"]] == ["chat"]


@pytest.mark.parametrize(("status", "body", "expected"), [
    (200, {"object": "list", "data": [
        {"id": "a", "root": "/m", "parent": None, "max_model_len": 512},
        {"id": "b", "root": "/m", "parent": None},
        {"id": "sql", "root": "/lora", "parent": "a"},
        {"id": "a"}, {"no": "id"}, "junk"]},
     (Card("a", "/m", None, 512), Card("b", "/m"), Card("sql", "/lora", "a"))),
    (200, {"object": "list", "data": []}, ()),
    (404, {"detail": "Not Found"}, None),
])
def test_an_answer_lists_every_entry_or_says_any_name(status: int, body: object,
                                                      expected: object) -> None:
    assert served_from(status, orjson.dumps(body)) == expected


@pytest.mark.parametrize(("status", "body"), [
    (500, b"{}"), (200, b"not json"), (200, b'{"data": 3}'), (200, b"[]"), (503, b"")])
def test_anything_else_is_no_answer(status: int, body: bytes) -> None:
    with pytest.raises(NoAnswer):
        served_from(status, body)


def test_tables_are_typed_and_a_bad_one_is_named() -> None:
    settings = settings_from({}, {
        "models": {"A": {"decode": ["http://d0:1"], "decode_policy": "least_loaded",
                         "max_inflight": 4}},
        "aliases": {"chat": {"targets": {"A": 3, "B": 0}}, "all": {"targets": ["A", "B"]}}})
    tables = parse_tables(settings)
    assert tables.pools["A"].settings == {"decode_policy": "least_loaded"}
    assert tables.pools["A"].max_inflight == 4
    assert tables.aliases["chat"].targets == (("A", 3.0),)  # a weight of 0 is switched off
    assert tables.aliases["all"].weights == (1.0, 1.0)
    env = {"EPD_MODEL_ALIASES": '{"chat": {"targets": {"A": 1}, "hidden": true}}',
           "EPD_DECODE_URLS": "http://d:1"}
    assert parse_tables(settings_from(env)).aliases["chat"].hidden
    for file_values, where in [
        ({"models": {"A": {"decode": ["http://d:1"], "decode_policy": "nope"}}},
         'models."A".decode_policy'),
        ({"models": {"A": {"decoder": ["http://d:1"]}}}, 'models."A"'),
        ({"models": {"A": {"max_inflight": 3}}}, 'models."A"'),
        ({"aliases": {"chat": {"targets": {"A": -1}}}}, 'aliases."chat".targets'),
        ({"aliases": {"chat": {"targets": {"x": 1}}, "x": {"targets": ["A"]}}},
         'aliases."chat".targets'),
        ({"models": {"A": {"decode": ["http://d:1"]}}, "aliases": {"A": {"targets": ["B"]}}},
         'aliases."A"'),
    ]:
        with pytest.raises(ConfigError) as caught:
            parse_tables(settings_from({"EPD_DECODE_URLS": "http://d:1"}, file_values))
        assert str(caught.value).startswith(where), caught.value
    with pytest.raises(ConfigError, match="EPD_MODELS"):
        settings_from({"EPD_MODELS": '{"A": {"decode": "ftp://x"}}'})
