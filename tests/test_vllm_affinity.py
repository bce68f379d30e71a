"""Where a vLLM worker rank's threads run (`kvpush.integrations.vllm.affinity`): a process
whose calling thread is bound to one CPU, as vLLM-CPU binds a worker's main thread, starts
its threads on every CPU of its parent, and keeps its own binding.

Each case runs in a child process of its own (tests/helpers/affinity_child.py), as a
vLLM worker is its engine's child, so the test process's own CPUs are never touched."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvpush.integrations.vllm.affinity import cpu_list

CHILD = Path(__file__).parent / "helpers" / "affinity_child.py"
CPUS = sorted(os.sched_getaffinity(0))


def _child(bind_to: list[int]) -> dict[str, object]:
    """Run the child bound to `bind_to` (its main thread, as vLLM binds a worker's)."""
    out = subprocess.run(
        [sys.executable, str(CHILD), *map(str, bind_to)],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return dict(json.loads(out.stdout))


def test_a_thread_started_from_a_bound_thread_runs_on_every_cpu_of_the_engine() -> None:
    if len(CPUS) < 2:
        pytest.fail(f"this test needs 2 CPUs to bind one of them; this process has {CPUS}")
    got = _child([CPUS[0]])
    # The engine's CPUs are this (parent) process's; the worker's main thread keeps its one.
    assert got["engine_cpus"] == CPUS
    assert got["started_thread"] == CPUS
    assert got["caller_after"] == [CPUS[0]]
    assert got["described"] == f"its threads on CPUs {cpu_list(set(CPUS))}, the engine's"
    # Without the block, a thread inherits the bound thread's one CPU: what vLLM-CPU did
    # to the rank's threads before.
    assert got["plain_thread"] == [CPUS[0]]


def test_an_unbound_worker_changes_nothing() -> None:
    got = _child(CPUS)
    assert got["engine_cpus"] is None
    assert got["started_thread"] == got["plain_thread"] == got["caller_after"] == CPUS
    assert got["described"] == "its threads on the worker's CPUs"


@pytest.mark.parametrize(
    ("cpus", "text"), [({0}, "0"), ({0, 1, 2, 5}, "0-2,5"), ({3, 7, 8, 9, 11}, "3,7-9,11")]
)
def test_cpu_lists_read_as_proc_writes_them(cpus: set[int], text: str) -> None:
    assert cpu_list(cpus) == text
