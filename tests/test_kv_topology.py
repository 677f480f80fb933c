"""TP topology: exhaustive checks over small (s, t, num_kv_heads) grids."""

from __future__ import annotations

import itertools

import pytest
import torch

from vllm_kvbridge.connectors.keys import kv_key, parse_key
from vllm_kvbridge.errors import ConfigError, KVBridgeError
from vllm_kvbridge.kv.topology import HeadRange, TPTopology, merge_head_parts, rank_heads

TPS = (1, 2, 4, 8)
HEADS = (1, 2, 4, 8, 16)


def _valid(s: int, t: int, h: int) -> bool:
    fits = all(h % x == 0 or x % h == 0 for x in (s, t))
    return fits and (s % t == 0 or t % s == 0)


@pytest.mark.parametrize(("s", "t", "h"), list(itertools.product(TPS, TPS, HEADS)))
def test_routes_cover_every_receiver_exactly(s: int, t: int, h: int) -> None:
    if not _valid(s, t, h):
        with pytest.raises(ConfigError):
            TPTopology(s, t, h)
        return
    topo = TPTopology(s, t, h)
    # Simulate: a full cache of h heads, each sender rank holds its slice; every receiver
    # rank must rebuild exactly its own slice from the routes (head ids as data).
    full = torch.arange(h).view(1, h, 1).float()
    for j in range(t):
        parts = []
        for route in topo.routes_to(j):
            held = topo.sender_heads(route.from_rank)
            sender_local = full[:, held.start : held.end]
            sent = sender_local[:, route.src_heads.start : route.src_heads.end]
            assert route.global_heads.size == route.src_heads.size == route.dst_heads.size
            parts.append((route.dst_heads, sent))
        want = topo.receiver_heads(j)
        merged = merge_head_parts(parts, want.size)
        assert torch.equal(merged, full[:, want.start : want.end]), (s, t, h, j)
    # only needed heads travel: total heads sent == total heads the receivers hold
    assert sum(r.src_heads.size for r in topo.routes) == sum(topo.receiver_heads(j).size for j in range(t))
    # every route belongs to exactly one sender's list
    assert sorted(map(id, topo.routes)) == sorted(id(r) for i in range(s) for r in topo.routes_from(i))


def test_gqa_replication_spreads_over_replicas() -> None:
    # 2 KV heads on TP 4: ranks 0,1 hold head 0, ranks 2,3 head 1 (vLLM's replication).
    assert [rank_heads(r, 4, 2) for r in range(4)] == [
        HeadRange(0, 1),
        HeadRange(0, 1),
        HeadRange(1, 2),
        HeadRange(1, 2),
    ]
    topo = TPTopology(4, 1, 2)
    routes = topo.routes_to(0)
    assert [(r.from_rank, r.global_heads) for r in routes] == [(0, HeadRange(0, 1)), (2, HeadRange(1, 2))]
    assert topo.routes_from(1) == () and topo.routes_from(3) == ()
    # s == t with replication: each receiver reads from its own rank
    same = TPTopology(4, 4, 2)
    assert [(r.from_rank, r.to_rank) for r in same.routes] == [(0, 0), (1, 1), (2, 2), (3, 3)]
    one = TPTopology(1, 8, 1)
    assert all(r.from_rank == 0 and r.src_heads == HeadRange(0, 1) for r in one.routes)


def test_slicing_and_merging_ranges() -> None:
    topo = TPTopology(1, 4, 8)  # sender slices
    assert [(r.src_heads.start, r.src_heads.end) for r in topo.routes] == [(0, 2), (2, 4), (4, 6), (6, 8)]
    topo = TPTopology(4, 2, 8)  # receiver merges
    assert [(r.from_rank, r.to_rank, r.dst_heads.start) for r in topo.routes] == [
        (0, 0, 0),
        (1, 0, 2),
        (2, 1, 0),
        (3, 1, 2),
    ]


def test_route_keys_are_rank_aware() -> None:
    topo = TPTopology(2, 4, 4)
    keys = {r.key("req-1", 0, 1) for r in topo.routes}
    assert len(keys) == len(topo.routes)
    route = topo.routes_to(3)[0]
    assert route.key("req-1", 0, 1) == kv_key("req-1", 0, 1, from_rank=1, to_rank=3)
    parsed = parse_key(route.key("req-1", 0, 1, purpose="cfg0"))
    assert (parsed["srank"], parsed["drank"], parsed["purpose"]) == (1, 3, "cfg0")


@pytest.mark.parametrize(
    ("s", "t", "h", "match"),
    [
        (2, 3, 6, "divide one another"),
        (3, 1, 4, "one must divide the other"),
        (0, 1, 4, "positive int"),
        (1, 1, 0, "num_kv_heads"),
    ],
)
def test_invalid_topologies(s: int, t: int, h: int, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        TPTopology(s, t, h)


def test_rank_bounds_and_merge_errors() -> None:
    topo = TPTopology(2, 2, 4)
    with pytest.raises(ConfigError):
        topo.routes_to(2)
    with pytest.raises(ConfigError):
        topo.routes_from(-1)
    with pytest.raises(ConfigError):
        rank_heads(2, 2, 4)
    with pytest.raises(ConfigError):
        topo.local_heads(0, side="both")
    assert topo.local_heads(1, side="receiver") == 2
    t = torch.zeros(1, 2, 1)
    with pytest.raises(KVBridgeError, match="gap or overlap"):
        merge_head_parts([(HeadRange(0, 2), t), (HeadRange(1, 3), t)], 3)
    with pytest.raises(KVBridgeError, match="cover"):
        merge_head_parts([(HeadRange(0, 2), t)], 4)
    with pytest.raises(KVBridgeError, match="has 2 heads"):
        merge_head_parts([(HeadRange(0, 1), t)], 1)
    with pytest.raises(KVBridgeError, match="no head parts"):
        merge_head_parts([], 1)
    with pytest.raises(ConfigError):
        HeadRange(2, 2)
