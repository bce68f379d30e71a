"""The engine's side channel under vLLM: one `MetadataServer` per engine, in vLLM's
engine-core process, answering every worker rank's metadata by its side-channel rank
(`stage * tp_size + tp rank`). vLLM collects the ranks' metadata from the workers at
start-up and hands it to the scheduler's connector (`set_xfer_handshake_metadata`),
which starts the server then and closes it with itself.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvpush.integrations.vllm.metadata import RankMetadata
    from kvpush.integrations.vllm.params import ConnectorConfig
    from kvpush.sidechannel import MetadataServer, PeerMetadata

log = logging.getLogger(__name__)


class EngineSideChannel:
    """The side channel of the engine `config` names, started at the first `serve`."""

    def __init__(self, config: ConnectorConfig) -> None:
        self._config = config
        self._ranks: dict[int, PeerMetadata] = {}
        self._server: MetadataServer | None = None

    def serve(self, metadata: dict[int, RankMetadata]) -> None:
        """Answer these ranks' metadata from now on; start the server (once)."""
        from kvpush.config import SideChannelConfig
        from kvpush.sidechannel import MetadataServer

        self._ranks = {rank: meta.decode() for rank, meta in sorted(metadata.items())}
        if self._server is not None:
            return
        cfg = self._config
        server = MetadataServer(
            cfg.side_channel_host,
            cfg.side_channel_port,
            SideChannelConfig(token=cfg.token),
            lambda: self._ranks,
        )
        server.start()
        self._server = server
        log.info(
            "kvpush side channel for engine %s serving ranks %s on %s",
            cfg.engine_id,
            sorted(self._ranks),
            ", ".join(server.endpoints),
        )

    def close(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None


__all__ = ["EngineSideChannel"]
