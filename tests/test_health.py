"""The `/health` contract (`kvpush.health`): what a server or proxy answers decodes into
the structs the proxy and the doctor read, a body that is not kvpush's reads as nothing
known, and a malformed one is refused saying which field and what was expected. The
servers' real answers are read in tests/test_serving_pd.py and tests/test_cli_doctor.py."""

from __future__ import annotations

import pytest

from kvpush.health import (
    BackendHealth,
    MalformedHealth,
    ProxyHealth,
    ServerHealth,
    decode_proxy_health,
    decode_server_health,
    encode,
)


def test_a_server_health_round_trips_and_leaves_out_what_it_does_not_know() -> None:
    health = ServerHealth(
        status="ok", role="prefill", side_channel_host="::1", side_channel_port=5600
    )
    wire = encode(health)
    assert wire == (
        b'{"status":"ok","role":"prefill","side_channel_host":"::1","side_channel_port":5600}'
    )
    decoded = decode_server_health(wire)
    assert decoded == health
    assert decoded is not None and decoded.side_channel_address == ("::1", 5600)


def test_a_body_that_is_not_a_json_object_is_not_a_kvpush_server() -> None:
    # vLLM's /health: 200 with an empty body.
    assert decode_server_health(b"") is None
    assert decode_server_health(b"[1, 2]") is None
    # An object without kvpush's fields: known to be up, nothing more.
    unknown = decode_server_health(b'{"status": "ok", "model": "x"}')
    assert unknown == ServerHealth(status="ok")
    assert unknown.side_channel_address is None


def test_a_malformed_server_health_names_the_field_and_what_was_expected() -> None:
    with pytest.raises(MalformedHealth) as info:
        decode_server_health(b'{"status": "ok", "side_channel_port": "5600"}', "GET h/health")
    message = str(info.value)
    assert message.startswith("GET h/health: Expected `int | null`, got `str`")
    assert "`$.side_channel_port`" in message
    assert "expected a JSON object with a kvpush server's /health fields" in message
    with pytest.raises(MalformedHealth, match=r"\$\.side_channel_port"):
        decode_server_health(b'{"side_channel_port": 70000}')


def test_a_figure_of_the_wrong_type_is_not_known_and_the_rest_is_read() -> None:
    body = (
        b'{"status": "ok", "role": "prefill", "cpu": {"at_s": true, "process_s": 1.0},'
        b' "transfers": {"in_flight": 2, "clock_bounds": {"a": {"round_trip_s": "1"},'
        b' "b": {"round_trip_s": 0.001, "skew_lb_s": 0.0, "age_s": 3.0}}}}'
    )
    health = decode_server_health(body)
    assert health is not None and health.cpu is None
    assert health.transfers is not None and health.transfers.in_flight == 2
    assert list(health.transfers.clock_bounds) == ["b"]


def test_a_proxy_health_round_trips_and_anything_else_is_refused() -> None:
    health = ProxyHealth(
        status="ok",
        role="proxy",
        prefill=(BackendHealth(url="http://p", status="ok", http_status=200),),
        decode=(BackendHealth(url="http://d", status="unreachable", detail="ConnectError"),),
    )
    assert decode_proxy_health(encode(health)) == health
    with pytest.raises(MalformedHealth, match=r"not JSON .*; expected a JSON object"):
        decode_proxy_health(b"")
    with pytest.raises(MalformedHealth, match="missing required field `prefill`"):
        decode_proxy_health(b'{"status": "ok", "role": "prefill"}')
    with pytest.raises(MalformedHealth, match=r"missing required field `url` - at `\$\.decode"):
        decode_proxy_health(b'{"status": "ok", "role": "proxy", "prefill": [], "decode": [{}]}')
