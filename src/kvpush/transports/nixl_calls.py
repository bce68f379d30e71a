"""NIXL's calls that kvpush makes on every write, bound once per agent, and the releases
of NIXL objects that may fail quietly (a handle NIXL cannot release is NIXL's to
reclaim)."""

from __future__ import annotations

import logging
from typing import Any

from kvpush.transports._nixl_import import NixlModule

logger = logging.getLogger(__name__)


class WriteCalls:
    """NIXL's three per-write calls (make, post, check), bound once per agent.

    `nixl_agent`'s methods of the same names rebuild the backend list, look the
    operation up and map the status per call: about 1 us each, on every write and every
    check of a write in flight. Here the bindings' own methods are called with what
    those wrappers would pass (handles stay NIXL's `nixl_xfer_handle`, released the
    same way). A NIXL whose Python API lacks any of these falls back to the API."""

    def __init__(self, nixl: NixlModule, agent: Any, backend: str, merge: bool) -> None:
        self._agent = agent
        self._backend = backend
        self._skip_merge = not merge
        try:
            raw = agent.agent
            bindings = nixl.api.nixlBind
            self._handle_type = nixl.api.nixl_xfer_handle
            self._make_raw = raw.makeXferReq
            self._post_raw = raw.postXferReq
            self._status_raw = raw.getXferStatus
            self._op = agent.nixl_ops["WRITE"]
            self._backends = [agent.backends[backend]]
            self._states = {bindings.NIXL_SUCCESS: "DONE", bindings.NIXL_IN_PROG: "PROC"}
            self._raw = raw
            self.bound = True
        except (AttributeError, KeyError, TypeError):
            self.bound = False

    def make(self, ours: Any, our_index: Any, theirs: Any, their_index: Any, notif: bytes) -> Any:
        if not self.bound:
            return self._agent.make_prepped_xfer(
                "WRITE",
                ours,
                our_index,
                theirs,
                their_index,
                notif,
                [self._backend],
                skip_desc_merge=self._skip_merge,
            )
        value = self._make_raw(
            self._op,
            ours._handle,
            our_index,
            theirs._handle,
            their_index,
            notif,
            self._backends,
            self._skip_merge,
        )
        return self._handle_type(self._raw, value)

    def post(self, handle: Any, notif: bytes) -> str:
        if not self.bound:
            return str(self._agent.transfer(handle, notif))
        return self._states.get(self._post_raw(handle._handle, notif), "ERR")

    def state(self, handle: Any) -> str:
        if not self.bound:
            return str(self._agent.check_xfer_state(handle))
        return self._states.get(self._status_raw(handle._handle), "ERR")


def release_quietly(handle: Any) -> None:
    """Release a NIXL handle; a handle that cannot be released is NIXL's to reclaim."""
    try:
        handle.release()
    except Exception as exc:
        logger.debug("NIXL handle %r not released: %r", handle, exc)


def quietly(call: Any, *args: Any) -> None:
    try:
        call(*args)
    except Exception as exc:
        logger.debug("NIXL cleanup %r%r failed: %r", call, args, exc)
