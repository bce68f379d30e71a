"""The side channel: each engine serves its transport metadata and cache geometry by rank.

`MetadataServer` (ZeroMQ ROUTER, one port per engine) and `fetch_metadata` (the client);
the wire format is described in `kvpush.sidechannel.wire`. Optional control requests
(`MetadataServer(control=...)`, `control_request`) carry other kinds on the same port;
the server only routes them (the endpoint registers the remote bench's).
"""

from kvpush.sidechannel.client import (
    FetchResult,
    control_request,
    fetch_metadata,
    fetch_metadata_timed,
)
from kvpush.sidechannel.server import ControlHandler, MetadataServer, SideChannelStats
from kvpush.sidechannel.wire import GET_META_MSG, PeerMetadata, Refusal, RequestRejected

__all__ = [
    "GET_META_MSG",
    "ControlHandler",
    "FetchResult",
    "MetadataServer",
    "PeerMetadata",
    "Refusal",
    "RequestRejected",
    "SideChannelStats",
    "control_request",
    "fetch_metadata",
    "fetch_metadata_timed",
]
