"""PushRuntime handshaking over the real side channel: ZeroMQ sockets on loopback.

Each runtime publishes `local_metadata()` through its own `MetadataServer`; peers are
found with `SideChannelPeerDirectory`, IPv4 and IPv6 alike. Data moves on the loopback
fabric, so the bytes are compared for real.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack

import pytest

from helpers.ranks import Engine
from helpers.waiting import wait_results
from kvpush.errors import FailureReason
from kvpush.runtime import PeerAddress
from kvpush.transports.loopback import LoopbackFabric

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def stack() -> Iterator[ExitStack]:
    with ExitStack() as s:
        yield s


@pytest.mark.parametrize("host", ["127.0.0.1", "::1"])
def test_push_over_a_real_side_channel(stack: ExitStack, host: str) -> None:
    fabric = LoopbackFabric()
    p = Engine(stack, fabric, "p", host, token="s3cret", expect_compat_hash=True)
    d = Engine(stack, fabric, "d", host, token="s3cret", expect_compat_hash=True)
    assert p.runtime is not None and d.runtime is not None
    p.runtime.send("t1", [0, 1, 2])
    d.runtime.receive("t1", p.address, [5, 6], sender_offset=1)
    [rd] = wait_results(d.runtime)
    [rp] = wait_results(p.runtime)
    assert rd.ok and rp.ok
    for region in range(len(p.kv.geometry.regions)):
        assert d.kv.block(region, 5) == p.kv.block(region, 1)
        assert d.kv.block(region, 6) == p.kv.block(region, 2)


def test_wrong_token_is_a_refused_handshake(stack: ExitStack) -> None:
    fabric = LoopbackFabric()
    p = Engine(stack, fabric, "p", "127.0.0.1", token="right", expect_compat_hash=True)
    d = Engine(stack, fabric, "d", "127.0.0.1", token="wrong", expect_compat_hash=True)
    assert d.runtime is not None
    d.runtime.receive("t1", p.address, [1])
    [r] = wait_results(d.runtime)
    assert r.reason is FailureReason.HANDSHAKE_REFUSED


def test_incompatible_geometry_is_refused_with_the_reason(stack: ExitStack) -> None:
    fabric = LoopbackFabric()
    p = Engine(stack, fabric, "p", "127.0.0.1", num_layers=3, expect_compat_hash=True)
    d = Engine(stack, fabric, "d", "127.0.0.1", expect_compat_hash=True)
    assert d.runtime is not None
    d.runtime.receive("t1", p.address, [1])
    [r] = wait_results(d.runtime)
    assert r.reason is FailureReason.INCOMPATIBLE_PEER


def test_nobody_listening_fails_the_handshake(stack: ExitStack) -> None:
    fabric = LoopbackFabric()
    d = Engine(stack, fabric, "d", "127.0.0.1", expect_compat_hash=True)
    assert d.runtime is not None
    d.runtime.receive("t1", PeerAddress("127.0.0.1", 9), [1])
    [r] = wait_results(d.runtime)
    assert r.reason is FailureReason.HANDSHAKE_FAILED and "127.0.0.1:9" in r.detail


@pytest.mark.parametrize("host", ["127.0.0.1", "::1"])
def test_a_dtype_mismatch_is_refused_without_any_compatibility_option(
    stack: ExitStack, host: str
) -> None:
    # Directories as the README builds them (no expected hash): the runtime checks.
    fabric = LoopbackFabric()
    p = Engine(stack, fabric, "p", host, dtype="float16", expect_compat_hash=False)
    d = Engine(stack, fabric, "d", host, dtype="bfloat16", expect_compat_hash=False)
    assert p.runtime is not None and d.runtime is not None
    p.runtime.send("t1", [0])
    d.runtime.receive("t1", p.address, [1])
    [r] = wait_results(d.runtime)
    assert r.reason is FailureReason.INCOMPATIBLE_PEER
    assert "dtype: theirs 'float16', ours 'bfloat16'" in r.detail
    assert p.runtime.statistics().bytes_written == 0
