"""`kvpush bench --target HOST:PORT`: benchmark against a running `kvpush endpoint`."""

from __future__ import annotations

from kvpush.errors import ConfigError
from kvpush.net import parse_host_port


def check_target(target: str) -> tuple[str, int]:
    """Parse the target; remote mode needs the kvpush runtime and endpoint to receive."""
    parse_host_port(target)
    raise ConfigError(
        f"--target {target}: remote mode is not available yet (it needs the kvpush runtime "
        "and `kvpush endpoint` to accept pushes); run without --target for the local bench"
    )
