"""`kvpush doctor`'s data-plane check on a vLLM worker (its step 4).

The engine's side channel is the scheduler's (`scheduler.py`): it runs in vLLM's engine
process and only publishes what each worker handed up. The checks must run where the
rank's NIXL agent is, in the worker, so each worker rank that takes test writes serves
the doctor's three request kinds (`kvpush.doctor_probe`) on a side channel of its own:
on the engine's side-channel host, a port the system picks, behind the engine's token
(every request carries the token's proof, as on the engine's side channel), publishing
no metadata. The rank publishes that port with its metadata (`PeerMetadata.probe_port`),
so the doctor finds it from the engine's side channel alone.

A rank takes test writes (registers the scratch buffer beside its KV cache) when the
engine has a token, or when `allow_doctor_writes` is set in `kv_connector_extra_config`,
as `kvpush serve` does (`--allow-doctor-writes`); otherwise nothing is served, no port
is opened, and the doctor says the rank has no scratch buffer.
"""

from __future__ import annotations

import msgspec

from kvpush.config import SideChannelConfig
from kvpush.doctor_probe import DoctorProbe
from kvpush.runtime.services import RuntimeService
from kvpush.sidechannel import MetadataServer, PeerMetadata

__all__ = ["WorkerDoctor"]


class WorkerDoctor:
    """The doctor's checks on one worker rank: the `RuntimeService` its `Rank` is given
    (`service`), and the side channel that serves them, started by `start` (after the
    rank started) and closed by `close` (before the rank closes)."""

    def __init__(self, host: str, rank: int, token: str | None) -> None:
        self._probe = DoctorProbe(scratch=True, first_rank=rank)
        self._service = self._probe.for_rank(rank)
        self._server = MetadataServer(
            host, 0, SideChannelConfig(token=token), {}, control=self._probe.control()
        )
        self._started = False

    @property
    def service(self) -> RuntimeService:
        return self._service

    def start(self) -> None:
        self._server.start()
        self._started = True

    def publish(self, metadata: PeerMetadata) -> PeerMetadata:
        """The rank's metadata, naming where its checks are served."""
        if not self._started:
            return metadata
        return msgspec.structs.replace(metadata, probe_port=self._server.port)

    def close(self) -> None:
        self._server.close()
