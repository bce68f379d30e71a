"""Prefill and decode roles: the engine side of disaggregated serving through kvpush."""

from __future__ import annotations

from collections.abc import Callable

from kvpush.errors import ConfigError
from kvpush.serving.engine import Engine
from kvpush.serving.metrics import Registry
from kvpush.serving.server import Prepare
from kvpush.serving.worker import EngineWorker


def build_role(
    options: object, engine: Engine, registry: Registry
) -> tuple[EngineWorker, Prepare | None, Callable[[], dict[str, object]] | None]:
    raise ConfigError("the prefill and decode roles are not built yet: use --role both")
