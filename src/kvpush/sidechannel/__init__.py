"""The side channel: each engine serves its transport metadata and cache geometry by rank.

`MetadataServer` (ZeroMQ ROUTER, one port per engine) and `fetch_metadata` (the client);
the wire format is described in `kvpush.sidechannel.wire`.
"""

from kvpush.sidechannel.client import FetchResult, fetch_metadata, fetch_metadata_timed
from kvpush.sidechannel.server import MetadataServer, SideChannelStats
from kvpush.sidechannel.wire import GET_META_MSG, ROLES, PeerMetadata, Refusal

__all__ = [
    "GET_META_MSG",
    "ROLES",
    "FetchResult",
    "MetadataServer",
    "PeerMetadata",
    "Refusal",
    "SideChannelStats",
    "fetch_metadata",
    "fetch_metadata_timed",
]
