"""Which CPUs a worker rank's threads run on.

vLLM-CPU binds each worker's OpenMP threads one to a core (`VLLM_CPU_OMP_THREADS_BIND`,
"auto" by default), the worker's main thread among them, and a new thread inherits the
CPUs of the thread that starts it. Started from the worker's main thread, the rank's
threads (the runtime's, with the heartbeats and the writes; NIXL's; the doctor's) would
all run on the one core of the model's compute and of the worker's busy loop between
steps. On a 2-core host a thread bound there went unscheduled for seconds at a time
while both servers computed, and live peers were timed out as silent.

vLLM's own NIXL connector moves its thread to cores it reserves; kvpush starts the
rank's threads on every CPU the engine's process may use (the worker's parent, which
vLLM does not bind), and leaves the worker's own threads where vLLM put them. Where the
worker is not bound to fewer CPUs than its engine (vLLM on GPUs; vLLM-CPU with "nobind"),
nothing changes.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator


def engine_cpus() -> frozenset[int] | None:
    """The CPUs of the engine's process, where the calling thread is bound to fewer of
    them; None where there is nothing to widen or it cannot be known here."""
    if not hasattr(os, "sched_getaffinity"):
        return None
    try:
        mine = os.sched_getaffinity(0)
        engine = os.sched_getaffinity(os.getppid())
    except OSError:  # a parent gone or not ours to read: leave the threads as they are
        return None
    return frozenset(engine) if mine < engine else None


@contextlib.contextmanager
def threads_started_on(cpus: frozenset[int] | None) -> Iterator[None]:
    """Threads started inside the block run on `cpus` (None: where the caller runs);
    the calling thread's own CPUs are given back when it ends."""
    if cpus is None:
        yield
        return
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cpus)
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


def describe(cpus: frozenset[int] | None) -> str:
    """Where a rank's threads run, for its start's log line."""
    if cpus is None:
        return "its threads on the worker's CPUs"
    return f"its threads on CPUs {cpu_list(cpus)}, the engine's"


def cpu_list(cpus: frozenset[int] | set[int]) -> str:
    """`cpus` the way /proc writes a CPU list: 0-3,6."""
    spans: list[list[int]] = []
    for cpu in sorted(cpus):
        if spans and spans[-1][1] == cpu - 1:
            spans[-1][1] = cpu
        else:
            spans.append([cpu, cpu])
    return ",".join(f"{a}" if a == b else f"{a}-{b}" for a, b in spans)
