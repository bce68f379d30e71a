"""Two "hosts": sender and receiver in two network namespaces joined by a veth pair.

UCX is limited to TCP over the veth (as between two machines without RDMA); the test
checks the bytes by checksum and that they really crossed the veth. The addresses are in
a private test subnet that exists only inside the two namespaces.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from nixl_procs import PeerProcess, transfer_and_check

pytestmark = [pytest.mark.nixl, pytest.mark.netns]

SUBNET_A, SUBNET_B = "10.77.0.1", "10.77.0.2"


@dataclass
class Host:
    namespace: str
    device: str
    address: str

    def ucx_env(self) -> dict[str, str]:
        # TCP only, on the veth only: no shared memory shortcut between the "hosts".
        return {"UCX_TLS": "tcp", "UCX_NET_DEVICES": self.device}

    def tx_bytes(self) -> int:
        out = subprocess.run(
            [
                "ip",
                "netns",
                "exec",
                self.namespace,
                "cat",
                f"/sys/class/net/{self.device}/statistics/tx_bytes",
            ],
            check=True,
            capture_output=True,
            text=True,
            timeout=10,
        )
        return int(out.stdout)


def _ip(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=10, check=False)


@pytest.fixture
def hosts() -> Iterator[tuple[Host, Host]]:
    if shutil.which("ip") is None:
        pytest.skip("iproute2 (`ip`) is not installed: run `make venv` or apt-get install iproute2")
    if os.geteuid() != 0:
        pytest.skip("network namespaces need root (CAP_SYS_ADMIN); run as root to test two hosts")
    tag = f"{os.getpid() % 100000}"
    a = Host(f"kvpush-a-{tag}", f"kvpa{tag}", SUBNET_A)
    b = Host(f"kvpush-b-{tag}", f"kvpb{tag}", SUBNET_B)
    made: list[str] = []
    try:
        for host in (a, b):
            res = _ip("netns", "add", host.namespace)
            if res.returncode != 0:
                pytest.skip(f"cannot create a network namespace: {res.stderr.strip()}")
            made.append(host.namespace)
        steps = [
            (
                "link",
                "add",
                a.device,
                "netns",
                a.namespace,
                "type",
                "veth",
                "peer",
                "name",
                b.device,
                "netns",
                b.namespace,
            ),
        ]
        for host in (a, b):
            steps += [
                ("-n", host.namespace, "addr", "add", f"{host.address}/24", "dev", host.device),
                ("-n", host.namespace, "link", "set", host.device, "up"),
                ("-n", host.namespace, "link", "set", "lo", "up"),
            ]
        for step in steps:
            res = _ip(*step)
            if res.returncode != 0:
                pytest.skip(f"cannot set up the veth pair (`ip {' '.join(step)}`): {res.stderr}")
        yield a, b
    finally:
        for ns in made:
            _ip("netns", "del", ns)  # takes its end of the veth pair with it


def test_transfer_between_two_hosts(hosts: tuple[Host, Host]) -> None:
    a, b = hosts
    sender = PeerProcess(["ip", "netns", "exec", a.namespace], env=a.ucx_env())
    receiver = PeerProcess(["ip", "netns", "exec", b.namespace], env=b.ucx_env())
    try:
        sent_before = a.tx_bytes()
        result = transfer_and_check(sender, receiver, 1, "kv_separate/NHD", "bfloat16")
        assert result["event"] == "done"
        # The blocks crossed the veth: at least 13 blocks x 4 regions x 512 bytes went out.
        assert a.tx_bytes() - sent_before >= 13 * 4 * 512
        # And back the other way: a second transfer, receiver to sender.
        transfer_and_check(receiver, sender, 2, "blocks_first/HND", "float32")
    finally:
        sender.close()
        receiver.close()
