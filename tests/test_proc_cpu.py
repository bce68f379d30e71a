"""The idle-CPU accounting of `scripts/vllm-compare` (`kvpush_lab.proc_cpu`) on real
processes: a tree whose members burn known amounts of CPU (counted by the burners
themselves, so the host's load does not move the expected figures), a sleeper, an
orphaned grandchild that only the process group still ties to the tree, and a window
that lasts longer than the work."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

import pytest

from kvpush_lab.proc_cpu import cpu_used, process_tree, snapshot

# On "burn S", burn S CPU seconds of its own (process_time), then answer "burnt".
_BURNER = """
import sys, time
for line in sys.stdin:
    end = time.process_time() + float(line.split()[1])
    while time.process_time() < end:
        pass
    print("burnt", flush=True)
"""

# Root: a sleeping child; a middle process that starts the grandchild (a burner
# reading the FIFO argv[1], answering into argv[2]) and exits, so the grandchild is
# reparented away from root and only shares its process group; then burns itself.
_ROOT = f"""
import subprocess, sys
burner = {_BURNER!r}
sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
start = (
    "import subprocess, sys; "
    "p = subprocess.Popen([sys.executable, '-c', sys.argv[1]], "
    "stdin=open(sys.argv[2]), stdout=open(sys.argv[3], 'w')); print(p.pid)"
)
middle = subprocess.run(
    [sys.executable, "-c", start, burner, sys.argv[1], sys.argv[2]],
    stdout=subprocess.PIPE, text=True, check=True,
)
print("pids", sleeper.pid, middle.stdout.strip(), flush=True)
exec(burner)
"""


@dataclass
class Tree:
    root: subprocess.Popen[str]
    sleeper: int
    grandchild: int
    grandchild_in: TextIO
    grandchild_out: Path

    def burn(self, root_s: float, grandchild_s: float) -> None:
        """Both burn, and have finished when this returns."""
        assert self.root.stdin is not None and self.root.stdout is not None
        self.root.stdin.write(f"burn {root_s}\n")
        self.root.stdin.flush()
        self.grandchild_in.write(f"burn {grandchild_s}\n")
        self.grandchild_in.flush()
        assert self.root.stdout.readline().startswith("burnt")
        deadline = time.monotonic() + 60
        while "burnt" not in self.grandchild_out.read_text():
            assert time.monotonic() < deadline, "the grandchild never finished burning"
            time.sleep(0.05)


@pytest.fixture
def tree(tmp_path: Path) -> Iterator[Tree]:
    fifo = tmp_path / "grandchild.in"
    out = tmp_path / "grandchild.out"
    os.mkfifo(fifo)
    with subprocess.Popen(
        [sys.executable, "-c", _ROOT, str(fifo), str(out)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    ) as root:  # leaving it closes the pipes and reaps root
        try:
            with open(fifo, "w") as grandchild_in:  # opens once the middle opened its end
                assert root.stdout is not None
                line = root.stdout.readline().split()
                assert line[:1] == ["pids"], line
                yield Tree(root, int(line[1]), int(line[2]), grandchild_in, out)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(root.pid, signal.SIGKILL)


def process_state(pid: int) -> str:
    """The state letter of `pid` in /proc (R, S, Z...): the field after the name."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    return stat[stat.rindex(")") + 2]


def test_cpu_used_counts_each_process_of_the_tree_over_the_window_as_measured(
    tree: Tree,
) -> None:
    pids = process_tree(tree.root.pid)
    assert {tree.root.pid, tree.sleeper, tree.grandchild} <= set(pids), pids

    started = time.monotonic()
    before = snapshot(pids)
    tree.burn(0.4, 0.6)
    time.sleep(0.5)  # the window lasts at least this much longer than the work
    after = snapshot(pids)
    window = time.monotonic() - started

    used = cpu_used(before, after)
    by_pid = {p.pid: u for p, u in used.by_process}
    slack = 0.05  # clock ticks (10 ms each) and the burners' own loop overhead
    assert by_pid[tree.root.pid] == pytest.approx(0.4, abs=slack), by_pid
    assert by_pid[tree.grandchild] == pytest.approx(0.6, abs=slack), by_pid
    assert by_pid[tree.sleeper] <= 0.02, by_pid
    assert used.cpu_s == pytest.approx(sum(by_pid.values()))
    # The share is over the window the snapshots spanned (at least the sleep, at most
    # what the test saw from before the first to after the second), however late.
    assert 0.5 <= used.elapsed_s <= window, (used.elapsed_s, window)
    assert used.share == pytest.approx(used.cpu_s / used.elapsed_s)


def test_a_process_that_ended_or_started_between_snapshots_does_not_count(
    tree: Tree,
) -> None:
    pids = process_tree(tree.root.pid)
    before = snapshot(pids)
    os.kill(tree.sleeper, signal.SIGKILL)
    late = subprocess.Popen([sys.executable, "-c", "pass"])
    late.wait(10)
    deadline = time.monotonic() + 30  # the sleeper a zombie (root never reaps it): not counted
    while process_state(tree.sleeper) != "Z":
        assert time.monotonic() < deadline, "the killed sleeper never became a zombie"
        time.sleep(0.01)
    after = snapshot([*pids, late.pid])
    used = cpu_used(before, after)
    assert tree.sleeper in used.gone
    assert {p.pid for p, _ in used.by_process} == set(pids) - {tree.sleeper}
