"""Transfer keys: safe characters, unambiguous, stable."""

from __future__ import annotations

import re

import pytest
from hypothesis import given
from hypothesis import strategies as st

from vllm_kvbridge.connectors.keys import (
    TransferKey,
    edge_name,
    encode_request_id,
    kv_key,
    parse_key,
    payload_key,
)
from vllm_kvbridge.errors import ConfigError

SAFE = re.compile(r"[A-Za-z0-9_.-]+")


def test_safe_ids_stay_readable() -> None:
    assert encode_request_id("req-42_a") == "ireq-42_a"
    assert kv_key("req-42", 0, 1) == "kvb.0-1.kv.ireq-42.cn.r0-0"


def test_unsafe_ids_are_hashed_and_stable() -> None:
    a = encode_request_id("../../etc/passwd")
    assert a.startswith("h") and len(a) == 33
    assert a == encode_request_id("../../etc/passwd")
    assert SAFE.fullmatch(kv_key("../../etc/passwd", 0, 1))


def test_hashed_and_readable_ids_cannot_collide() -> None:
    # A safe id that looks like a hash still gets the "i" prefix.
    fake = "h" + "0" * 32
    assert encode_request_id(fake) == "i" + fake


@given(st.text(min_size=1, max_size=200))
def test_every_request_id_gives_a_safe_bounded_key(rid: str) -> None:
    key = payload_key(rid, "thinker", "talker", chunk=3, from_rank=1, to_rank=2)
    assert SAFE.fullmatch(key)
    assert len(key) < 160
    parts = parse_key(key)
    assert parts["chunk"] == 3 and parts["srank"] == 1 and parts["drank"] == 2
    assert parts["rid"] == encode_request_id(rid)


@given(st.text(min_size=1, max_size=40), st.text(min_size=1, max_size=40))
def test_distinct_ids_give_distinct_keys(a: str, b: str) -> None:
    if a != b:
        assert kv_key(a, 0, 1) != kv_key(b, 0, 1)


def test_fields_are_distinguished() -> None:
    keys = {
        kv_key("r", 0, 1),
        kv_key("r", 0, 1, purpose="cfg_neg"),
        kv_key("r", 0, 1, from_rank=1),
        kv_key("r", 0, 1, to_rank=1),
        kv_key("r", 1, 0),
        payload_key("r", 0, 1),
        payload_key("r", 0, 1, chunk=0),
    }
    assert len(keys) == 7


@pytest.mark.parametrize(
    "kwargs",
    [
        {"request_id": ""},
        {"request_id": "r", "from_stage": "a.b"},
        {"request_id": "r", "purpose": "kv.x"},
        {"request_id": "r", "chunk": -1},
        {"request_id": "r", "from_rank": -1},
    ],
)
def test_bad_parts_are_refused(kwargs: dict) -> None:
    parts = {"request_id": "r", "from_stage": 0, "to_stage": 1, **kwargs}
    with pytest.raises(ConfigError):
        TransferKey(**parts).encode()


def test_parse_rejects_foreign_strings() -> None:
    with pytest.raises(ConfigError, match="not a kvbridge transfer key"):
        parse_key("kvb.0-1.kv")


# -- stage names that contain the separator (issue 11, case 6) ----------------------------
def test_edges_whose_names_share_a_dash_do_not_collide() -> None:
    # Both were "kvb.a-b-c.kv.ir1.cn.r0-0" when the edge was joined with a bare "-".
    assert kv_key("r1", "a-b", "c") != kv_key("r1", "a", "b-c")
    assert payload_key("r1", "a-b", "c", chunk=0) != payload_key("r1", "a", "b-c", chunk=0)


def test_numeric_edges_stay_readable() -> None:
    assert edge_name(0, 1) == "0-1"
    assert edge_name("thinker", "talker") == "thinker-talker"


STAGE = st.text(alphabet="ab-_0", min_size=1, max_size=32)


@given(STAGE, STAGE, STAGE, STAGE)
def test_distinct_edges_give_distinct_keys_and_parse_back(a: str, b: str, c: str, d: str) -> None:
    if (a, b) != (c, d):
        assert kv_key("r", a, b) != kv_key("r", c, d)
        assert edge_name(a, b) != edge_name(c, d)
    parts = parse_key(kv_key("r", a, b))
    assert (parts["src"], parts["dst"]) == (a, b)
    assert SAFE.fullmatch(edge_name(a, b))
