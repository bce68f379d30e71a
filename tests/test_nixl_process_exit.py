"""A process that used NIXL must exit with its own status, not a crash in UCX's teardown."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvpush.config import prepare_ucx_environment

pytestmark = pytest.mark.nixl

_USE_NIXL = """
from kvpush.transports.nixl import NixlTransport
t = NixlTransport("exit-check")
t.start()
t.close()
print("closed", flush=True)
"""


def test_a_process_that_used_nixl_exits_0() -> None:
    env = {k: v for k, v in os.environ.items() if k != "UCX_MODULES"}
    done = subprocess.run(
        [sys.executable, "-c", _USE_NIXL],
        check=False,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert "closed" in done.stdout, done.stderr[-2000:]
    assert done.returncode == 0, f"exit status {done.returncode}: {done.stderr[-2000:]}"


def test_ucx_defaults_leave_a_users_choice_and_rdma_hosts_alone(tmp_path: Path) -> None:
    no_rdma = tmp_path / "none"
    env: dict[str, str] = {}
    prepare_ucx_environment(env, rdma_devices=no_rdma)
    assert env == {"UCX_MODULES": "^ib,rdmacm"}

    chosen = {"UCX_MODULES": "ib"}
    prepare_ucx_environment(chosen, rdma_devices=no_rdma)
    assert chosen == {"UCX_MODULES": "ib"}

    rdma = tmp_path / "rdma"
    (rdma / "mlx5_0").mkdir(parents=True)
    env = {}
    prepare_ucx_environment(env, rdma_devices=rdma)
    assert env == {}
