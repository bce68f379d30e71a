"""The `kvpush` mode: the whole kvpush path, through `kvpush.runtime`."""

from __future__ import annotations

from kvpush.bench.modes import ModeUnavailable
from kvpush.bench.workload import Workload


class KvpushReceiver:
    def __init__(self, workload: Workload) -> None:
        raise ModeUnavailable("not available: kvpush.runtime is not in this tree yet")


class KvpushSender:
    def __init__(self, workload: Workload) -> None:
        raise ModeUnavailable("not available: kvpush.runtime is not in this tree yet")
