"""Find the installed NIXL build: the `nixl` meta-package first, then the CUDA-13 and
CUDA-12 wheels (`nixl-cu12` runs on CPU-only hosts too)."""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any

from kvpush.config import prepare_ucx_environment
from kvpush.errors import FailureReason, TransportError

_CANDIDATES = ("nixl", "nixl_cu13", "nixl_cu12")


@dataclass(frozen=True, slots=True)
class NixlModule:
    package: str  # which one was found, e.g. "nixl_cu12"
    nixl_agent: Any
    nixl_agent_config: Any
    # NIXL's own exception classes (from its bindings), for mapping at our edge.
    remote_disconnect_error: type[BaseException]
    not_found_error: type[BaseException]


_found: NixlModule | None = None


def load_nixl() -> NixlModule:
    """Import NIXL once; raise `TransportError(LOCAL_ERROR)` naming what to install."""
    global _found
    if _found is not None:
        return _found
    prepare_ucx_environment()
    errors: list[str] = []
    for package in _CANDIDATES:
        try:
            api = importlib.import_module(f"{package}._api")
            bindings = importlib.import_module(f"{package}._bindings")
        except ImportError as exc:
            errors.append(f"{package}: {exc}")
            continue
        _found = NixlModule(
            package=package,
            nixl_agent=api.nixl_agent,
            nixl_agent_config=api.nixl_agent_config,
            remote_disconnect_error=bindings.nixlRemoteDisconnectError,
            not_found_error=bindings.nixlNotFoundError,
        )
        return _found
    raise TransportError(
        FailureReason.LOCAL_ERROR,
        "NIXL is not installed (tried " + "; ".join(errors) + "); install nixl-cu12 "
        "(CPU hosts and CUDA 12) or nixl-cu13",
    )
