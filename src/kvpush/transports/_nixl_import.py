"""Find the installed NIXL build: the `nixl` meta-package first, then the CUDA-13 and
CUDA-12 wheels (`nixl-cu12` runs on CPU-only hosts too)."""

from __future__ import annotations

import importlib
import threading
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
    api: Any = None  # the `_api` module itself

    def make_agent(self, name: str, config: Any, progress_wait_us: int = 0) -> Any:
        """`nixl_agent(name, config)`, with the UCX progress thread's wait set.

        NIXL's UCX progress thread waits for UCX events in poll() with a timeout of its
        `pthrDelay` (rounded up to milliseconds); the Python API always sets it to 0,
        which turns that wait into a spin (a whole core, idle or not). No argument
        reaches it, so for the one constructor call the bindings' `nixlAgent` is
        wrapped to set the delay first (under a lock, so two of ours never interleave)."""
        if not progress_wait_us or self.api is None:
            return self.nixl_agent(name, config)
        bindings = self.api.nixlBind
        with _agent_lock:
            self.api.nixlBind = _DelayedBindings(bindings, progress_wait_us)
            try:
                return self.nixl_agent(name, config)
            finally:
                self.api.nixlBind = bindings


class _DelayedBindings:
    """The NIXL bindings module, but `nixlAgent` gets `pthrDelay` set (`make_agent`)."""

    def __init__(self, bindings: Any, delay_us: int) -> None:
        self._bindings = bindings
        self._delay_us = delay_us

    def __getattr__(self, name: str) -> Any:
        return getattr(self._bindings, name)

    def nixlAgent(self, name: str, config: Any) -> Any:  # NIXL's name for it
        config.pthrDelay = self._delay_us
        return self._bindings.nixlAgent(name, config)


_agent_lock = threading.Lock()


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
            api=api,
        )
        return _found
    raise TransportError(
        FailureReason.LOCAL_ERROR,
        "NIXL is not installed (tried " + "; ".join(errors) + "); install nixl-cu12 "
        "(CPU hosts and CUDA 12) or nixl-cu13",
    )
