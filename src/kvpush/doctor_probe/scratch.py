"""The scratch buffer `kvpush doctor` writes into, and the writes it asks for.

A rank that allows doctor writes (it has a token, or its operator allowed them) owns
one `ScratchBuffer` of `SCRATCH_BYTES` beside its KV cache, on the cache's device, and
registers it with its transport. A doctor check asks the prefill's rank to write into
the decode's buffer (`kvpush.doctor_probe.rank`): `PROBE_WRITES` writes of two sizes, each
carrying `pattern(seed, size)`. The doctor then asks the decode for the `digest` of its
buffer and compares it with the digest of the pattern it chose: the bytes crossed the
data plane intact, or they did not. No KV block is read or written on the way.
"""

from __future__ import annotations

import hashlib
from typing import Any

import numpy as np

from kvpush.errors import ConfigError
from kvpush.geometry import ScratchRegion

__all__ = ["PROBE_SIZES", "PROBE_WRITES", "SCRATCH_BYTES", "ScratchBuffer", "digest", "pattern"]

SMALL_WRITE = 64 * 1024  # round trip: mostly latency
LARGE_WRITE = 4 * 1024 * 1024  # bandwidth: as large as the buffer
SCRATCH_BYTES = LARGE_WRITE
PROBE_SIZES = (SMALL_WRITE, LARGE_WRITE)
# Writes per size and check: the median of these is reported. Bounded, so one check
# moves at most 5 * 64 KiB + 5 * 4 MiB.
PROBE_WRITES = 5


def pattern(seed: bytes, nbytes: int) -> bytes:
    """The bytes a check writes: a stream from the seed the doctor chose."""
    return hashlib.shake_256(b"kvpush-doctor/1 " + seed).digest(nbytes)


def digest(data: bytes | memoryview) -> str:
    return hashlib.sha256(data).hexdigest()


class ScratchBuffer:
    """`SCRATCH_BYTES` of zeroed memory on `device` ("cpu" or "cuda:N"), alive as long
    as this object: its owner keeps it until its transport is closed."""

    def __init__(self, device: str = "cpu", nbytes: int = SCRATCH_BYTES) -> None:
        if nbytes <= 0:
            raise ConfigError(f"a scratch buffer needs a positive size, got {nbytes}")
        self._device = device
        self._tensor: Any = None
        if device == "cpu":
            self._host = np.zeros(nbytes, dtype=np.uint8)
            base = int(self._host.ctypes.data)
        else:
            import torch  # only a GPU rank gets here, and it has torch

            self._tensor = torch.zeros(nbytes, dtype=torch.uint8, device=device)
            base = int(self._tensor.data_ptr())
        self.region = ScratchRegion(base_addr=base, nbytes=nbytes, device=device)

    def fill(self, data: bytes) -> None:
        """Our first `len(data)` bytes become `data` (before a check's writes go out)."""
        src = np.frombuffer(data, dtype=np.uint8)
        if self._tensor is None:
            self._host[: len(src)] = src
        else:
            import torch

            self._tensor[: len(src)].copy_(torch.from_numpy(src.copy()))

    def digest(self, nbytes: int) -> str:
        """The SHA-256 of our first `nbytes` bytes, as they are now."""
        if self._tensor is None:
            return digest(self._host[:nbytes].tobytes())
        return digest(self._tensor[:nbytes].cpu().numpy().tobytes())
