"""Prefill and decode roles: the engine side of disaggregated serving through kvpush.

Push mode, request by request (the proxy sends both legs at once, with one `transfer_id`):

- decode: a request with `kv_transfer_params.do_remote_prefill` allocates its blocks at
  once, reusing its own prefix cache, and registers them with the prefill server named by
  `remote_host`/`remote_port` (its side channel) through `PushRuntime.receive`. When the
  runtime reports the transfer finished, the engine recomputes the last prompt token and
  decodes; when it reports a failure, the request ends with an error naming the reason.
- prefill: a request with `do_remote_decode` computes the prompt (one output token) and
  holds its blocks; they are offered with `PushRuntime.send` (with `--layerwise`, as each
  layer finishes, so writes overlap the rest of the forward pass) and freed when the
  runtime reports the transfer ended, whichever way.

Both roles poll the runtime on the engine thread, the only thread that touches the engine
(the runtime's own contract: results are taken by the engine, once). A client that goes
away aborts its transfer; its blocks are freed only when the runtime says the transfer
ended, so no late write can land in a reused block.

The roles live beside this module: `prefill_role.PrefillRole` and `decode_role.DecodeRole`,
objects the engine loop (`worker.EngineWorker`) calls at the points `worker.Role` names,
and `kv_bridge.KVBridge`, the node they drive. This module checks a request's
`kv_transfer_params` for the role it reaches and assembles a role (`build_role`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from kvpush.errors import FailureReason
from kvpush.health import ServerHealth
from kvpush.node import TransportFactory, nixl_transport
from kvpush.serving.decode_role import DecodeRole
from kvpush.serving.engine import Engine
from kvpush.serving.kv_bridge import KVBridge
from kvpush.serving.metrics import Registry
from kvpush.serving.openai_request import BadRequest, CompletionRequest
from kvpush.serving.prefill_role import PrefillRole
from kvpush.serving.server import Prepare
from kvpush.serving.worker import EngineWorker, Jobs, Role
from kvpush.transfer_params import (
    REMOTE_DECODE,
    REMOTE_PREFILL,
    BadTransferParams,
    parse_remote_decode,
    parse_remote_prefill,
    wants_remote_decode,
    wants_remote_prefill,
)

if TYPE_CHECKING:
    from kvpush.serving.options import ServeOptions


def _prepare_for(role: str) -> Prepare:
    def prepare(req: CompletionRequest) -> CompletionRequest:
        kvp = req.kv_transfer_params
        if kvp is None:
            return req
        try:
            if role == "prefill" and wants_remote_decode(kvp):
                parse_remote_decode(kvp, require_transfer_id=True)
                if req.stream:
                    raise BadRequest("a remote-decode (prefill) request cannot stream")
            elif role == "decode" and wants_remote_prefill(kvp):
                parse_remote_prefill(kvp)
            elif wants_remote_decode(kvp) or wants_remote_prefill(kvp):
                raise BadRequest(
                    f"this is a {role} server: expected "
                    + (REMOTE_DECODE if role == "prefill" else REMOTE_PREFILL)
                )
        except BadTransferParams as exc:
            raise BadRequest(str(exc)) from None
        return req

    return prepare


def build_role(
    options: ServeOptions,
    engine: Engine,
    registry: Registry,
    token: str | None,
    *,
    transport_factory: TransportFactory = nixl_transport,
) -> tuple[EngineWorker, KVBridge, Prepare, Callable[[], ServerHealth]]:
    """The prefill or decode role over `engine`: its worker (not started), its started
    `KVBridge`, the request check for its HTTP layer and its `/health` extra. The
    transport is NIXL unless a factory is given (tests run the roles over loopback)."""
    bridge = KVBridge(options, engine, token, transport_factory=transport_factory)
    runtime = bridge.start()
    try:
        jobs = Jobs(options.admission())  # the loop's and the role's one table
        role: Role
        if options.role == "prefill":
            role = PrefillRole(engine, jobs, runtime, registry, layerwise=options.layerwise)
        else:
            role = DecodeRole(engine, jobs, runtime, registry)
        worker = EngineWorker(engine, role, jobs=jobs)
    except BaseException:
        bridge.close()
        raise
    return worker, bridge, _prepare_for(options.role), bridge.health


__all__ = ["DecodeRole", "FailureReason", "KVBridge", "PrefillRole", "build_role"]
