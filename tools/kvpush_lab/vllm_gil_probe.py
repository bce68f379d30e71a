"""Lab only: `KvpushConnector` with a probe thread in each vLLM worker that measures
how long a thread of that process waits to run (the GIL, and the OS's scheduling):
`kvpush_lab.gil_probe`, recording to `$KVPUSH_GIL_PROBE_OUT.<pid>`.
`scripts/vllm-gil-probe` runs servers with it (`kv_connector: GilProbeConnector`,
`kv_connector_module_path: kvpush_lab.vllm_gil_probe`) and compares with the same
probe in a process of its own.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import TYPE_CHECKING

from kvpush.integrations.vllm.connector import KvpushConnector
from kvpush_lab.gil_probe import probe

if TYPE_CHECKING:
    import torch


class GilProbeConnector(KvpushConnector):
    """KvpushConnector, plus the probe thread in each worker (started with the KV
    cache's registration, joined at shutdown)."""

    _probe_thread: threading.Thread | None = None

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        super().register_kv_caches(kv_caches)
        self._probe_stop = threading.Event()
        path = Path(f"{os.environ['KVPUSH_GIL_PROBE_OUT']}.{os.getpid()}")
        self._probe_thread = threading.Thread(
            target=probe, args=(path, self._probe_stop), name="kvpush-gil-probe", daemon=True
        )
        self._probe_thread.start()

    def shutdown(self) -> None:
        if self._probe_thread is not None:
            self._probe_stop.set()
            self._probe_thread.join(2)
        super().shutdown()
