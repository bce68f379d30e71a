"""CPU that trees of processes use over a window, read from /proc (Linux), for the
idle-CPU figures of `scripts/vllm-compare`.

Three rules make such a figure mean what it says:

- The same processes before and after: a snapshot is taken of a fixed list of pids,
  each keyed with its start time, and only a process seen in both snapshots with the
  same start time counts. A process that came or went in between (or a pid the kernel
  reused) would otherwise add its whole life.
- The whole tree: a server's processes are its leader and every descendant, children
  of children included, found by parent pid, whatever session or process group they
  put themselves in.
- The window as it was, not as it was meant to be: the share is CPU seconds over the
  seconds between the two snapshots, each stamped with the monotonic clock while it
  was read. On a loaded host a `sleep(10)` can return tens of seconds late; dividing by
  the 10 s asked for gave 336 % and 838 % on 2 cores.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

_PROC = Path("/proc")
_TICK = os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True, slots=True)
class ProcessCpu:
    pid: int
    started: int  # clock ticks after boot (/proc/PID/stat field 22): tells reused pids apart
    name: str
    cpu_s: float  # user + system, all its threads, those that ended included


@dataclass(frozen=True, slots=True)
class CpuSnapshot:
    taken_at: float  # time.monotonic(), halfway through reading
    read_s: float  # how long reading took
    processes: Mapping[tuple[int, int], ProcessCpu]  # (pid, started) ->


@dataclass(frozen=True, slots=True)
class CpuUsed:
    elapsed_s: float  # between the two snapshots
    by_process: tuple[tuple[ProcessCpu, float], ...]  # (as before, CPU seconds in the window)
    gone: tuple[int, ...]  # pids in the first snapshot only (not counted)

    @property
    def cpu_s(self) -> float:
        return sum(used for _, used in self.by_process)

    @property
    def share(self) -> float:
        """Cores' worth: 1.0 is one core busy the whole window."""
        return self.cpu_s / self.elapsed_s if self.elapsed_s > 0 else 0.0


def _stat(pid: int) -> list[str] | None:
    """/proc/PID/stat's fields, the command name (which may hold spaces or ')') first:
    [0] the name, [1] the state, [2] the parent pid, [3] the process group, [12]/[13]
    utime/stime (clock ticks), [20] the start time (`man 5 proc`: fields 2-5, 14, 15, 22)."""
    try:
        text = (_PROC / str(pid) / "stat").read_text()
    except OSError:
        return None
    head, _, rest = text.rpartition(")")
    fields = rest.split()
    return [head.partition("(")[2], *fields] if len(fields) > 19 else None


def process_tree(root: int) -> list[int]:
    """`root` and all its live descendants, and the live members of the process group
    `root` leads (those its descendants left behind, reparented); empty if `root` and
    its group are gone."""
    children: dict[int, list[int]] = {}
    group: list[int] = []
    for entry in _PROC.iterdir():
        if not entry.name.isdigit():
            continue
        fields = _stat(int(entry.name))
        if fields is not None:
            children.setdefault(int(fields[2]), []).append(int(entry.name))
            if int(fields[3]) == root:
                group.append(int(entry.name))
    tree: set[int] = set()
    todo = [root, *group] if _stat(root) is not None else group
    while todo:
        pid = todo.pop()
        if pid not in tree:
            tree.add(pid)
            todo.extend(children.get(pid, ()))
    return sorted(tree)


def snapshot(pids: Iterable[int]) -> CpuSnapshot:
    """CPU seconds so far of each of `pids` still alive."""
    started = time.monotonic()
    out: dict[tuple[int, int], ProcessCpu] = {}
    for pid in pids:
        fields = _stat(pid)
        if fields is None or fields[1] in ("Z", "X"):
            continue  # gone, or a zombie (its times already went to its parent's)
        proc = ProcessCpu(
            pid, int(fields[20]), fields[0], (int(fields[12]) + int(fields[13])) / _TICK
        )
        out[(pid, proc.started)] = proc
    ended = time.monotonic()
    return CpuSnapshot((started + ended) / 2, ended - started, out)


def cpu_used(before: CpuSnapshot, after: CpuSnapshot) -> CpuUsed:
    """What the processes in both snapshots used between them."""
    by_process = tuple(
        (proc, max(0.0, after.processes[key].cpu_s - proc.cpu_s))
        for key, proc in before.processes.items()
        if key in after.processes
    )
    gone = tuple(p.pid for k, p in before.processes.items() if k not in after.processes)
    return CpuUsed(after.taken_at - before.taken_at, by_process, gone)
