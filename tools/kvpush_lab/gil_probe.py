"""Lab only: a probe of how long a thread waits to run (for the GIL, and for the OS).

It does what kvpush's runtime thread does when idle (a timed wait on a lock, then Python
code) and records, per wake-up, how late it ran: (wall-clock time, seconds late) as
pairs of doubles appended to a file. `kvpush_lab.vllm_gil_probe` runs it inside vLLM's
workers; `scripts/vllm-gil-probe` also runs it in a process of its own, for comparison.
"""

from __future__ import annotations

import struct
import threading
import time
from pathlib import Path

WAIT_S = 0.005  # the runtime's default idle poll in the connector (idle_poll_ms 5)
RECORD = struct.Struct("dd")


def probe(path: Path, stop: threading.Event, *, until: float | None = None) -> None:
    """Wake every WAIT_S until `stop` is set (or `until`, a monotonic time), appending
    (time, seconds late) records to `path`, flushed every half second."""
    buf = bytearray()
    flushed = time.monotonic()
    with path.open("wb", buffering=0) as out:
        while not stop.is_set() and (until is None or time.monotonic() < until):
            t0 = time.perf_counter()
            stop.wait(WAIT_S)
            buf += RECORD.pack(time.time(), time.perf_counter() - t0 - WAIT_S)
            if time.monotonic() - flushed > 0.5:
                out.write(bytes(buf))
                buf.clear()
                flushed = time.monotonic()
        out.write(bytes(buf))


def read_records(path: Path) -> list[tuple[float, float]]:
    data = path.read_bytes()
    usable = len(data) - len(data) % RECORD.size
    return [RECORD.unpack_from(data, i) for i in range(0, usable, RECORD.size)]
