"""A stand-in for a vLLM worker, for tests/test_vllm_affinity.py: binds its main thread to
the CPUs given as arguments, then reports (one JSON line) the engine's CPUs as
`engine_cpus` reads them, and the CPUs of a thread started inside and outside
`threads_started_on`."""

from __future__ import annotations

import json
import os
import sys
import threading

from kvpush.integrations.vllm.affinity import describe, engine_cpus, threads_started_on


def _thread_cpus() -> list[int]:
    seen: list[int] = []
    t = threading.Thread(target=lambda: seen.extend(sorted(os.sched_getaffinity(0))))
    t.start()
    t.join()
    return seen


def main(bind_to: list[int]) -> None:
    os.sched_setaffinity(0, bind_to)
    cpus = engine_cpus()
    with threads_started_on(cpus):
        started = _thread_cpus()
    report = {
        "engine_cpus": None if cpus is None else sorted(cpus),
        "started_thread": started,
        "plain_thread": _thread_cpus(),
        "caller_after": sorted(os.sched_getaffinity(0)),
        "described": describe(cpus),
    }
    print(json.dumps(report))


if __name__ == "__main__":
    main([int(a) for a in sys.argv[1:]])
