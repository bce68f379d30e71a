"""What the Ray Serve backend puts in each leg (`kvpush.integrations.ray.legs`), read back
by the parsers the vLLM connector uses (`kvpush.transfer_params`). No Ray here: the
backend itself runs in tests/test_ray_serve.py, under Ray Serve LLM."""

from __future__ import annotations

import pytest

from kvpush.errors import ConfigError
from kvpush.integrations.ray.legs import (
    METADATA_KEY,
    LegPairs,
    ReplicaSideChannel,
    decode_leg,
    prefill_leg,
    replica_port,
)
from kvpush.transfer_params import (
    parse_remote_decode,
    parse_remote_prefill,
    wants_remote_decode,
    wants_remote_prefill,
)

PREFILL = ReplicaSideChannel("kvpush-10.0.0.1-25000", "10.0.0.1", 25000, tp_size=2, block_size=16)
DECODE = ReplicaSideChannel("kvpush-10.0.0.2-27001", "10.0.0.2", 27001, tp_size=1)


def test_a_prefill_replicas_metadata_names_it_back() -> None:
    published = PREFILL.metadata()
    assert list(published) == [METADATA_KEY]
    assert ReplicaSideChannel.from_metadata(published) == PREFILL


@pytest.mark.parametrize(
    ("peer", "says"),
    [
        (None, "published no kvpush side channel"),
        ({"mori_zmq_address": "host:1"}, "kv_connector must be KvpushConnector"),
        ({METADATA_KEY: {"engine_id": "e", "host": "h", "port": 0}}, "port must be in 1..65535"),
        ({METADATA_KEY: {"engine_id": "e", "port": 5}}, "host must be a non-empty string"),
        ({METADATA_KEY: {"engine_id": "e", "host": "h", "port": 5, "tp_size": 0}}, "tp_size"),
    ],
)
def test_a_peer_without_a_usable_side_channel_is_refused_saying_why(
    peer: dict[str, object] | None, says: str
) -> None:
    with pytest.raises(ConfigError, match=says):
        ReplicaSideChannel.from_metadata(peer)


def test_the_prefill_leg_pushes_to_this_decode_only_split_for_its_tp() -> None:
    params = prefill_leg("t-1", DECODE)
    assert wants_remote_decode(params) and not wants_remote_prefill(params)
    read = parse_remote_decode(params, require_transfer_id=True)
    assert read.transfer_id == "t-1"
    assert read.decode_server() == ("10.0.0.2", 27001)
    assert read.decode_tp_size == 1


def test_the_decode_leg_names_the_picked_prefill() -> None:
    params = decode_leg("t-1", PREFILL, DECODE)
    assert wants_remote_prefill(params) and not wants_remote_decode(params)
    read = parse_remote_prefill(params)
    assert read.transfer_id == "t-1"
    assert (read.remote_host, read.remote_port) == ("10.0.0.1", 25000)
    assert read.remote_engine_id == PREFILL.engine_id
    assert (read.tp_size, read.decode_tp_size, read.block_size) == (2, 1, 16)


def test_ipv6_hosts_travel_bare() -> None:
    prefill = ReplicaSideChannel("p", "[fd00::1]", 25000)
    decode = ReplicaSideChannel("d", "fd00::2", 27000)
    assert parse_remote_prefill(decode_leg("t", prefill, decode)).remote_host == "fd00::1"
    assert parse_remote_decode(prefill_leg("t", decode)).decode_host == "fd00::2"


def test_each_decode_leg_takes_the_id_its_own_prefill_leg_was_given() -> None:
    pairs = LegPairs()
    first, second = object(), object()
    pairs.give(first, "t-1")
    pairs.give(second, "t-2")
    assert pairs.take(second) == "t-2"
    assert pairs.take(first) == "t-1"
    assert len(pairs) == 0
    with pytest.raises(ConfigError, match="prefill leg this backend did not shape first"):
        pairs.take(first)


def test_ids_never_taken_are_dropped_oldest_first() -> None:
    pairs = LegPairs(limit=2)
    requests = [object() for _ in range(3)]
    for n, request in enumerate(requests):
        pairs.give(request, f"t-{n}")
    assert len(pairs) == 2
    with pytest.raises(ConfigError):
        pairs.take(requests[0])
    assert pairs.take(requests[2]) == "t-2"


def test_a_port_past_the_range_names_the_setting() -> None:
    assert replica_port(25000, 3) == 25003
    with pytest.raises(ConfigError, match="KVPUSH_SIDE_CHANNEL_PORT_BASE"):
        replica_port(65530, 8)
