"""Settings: validated once, frozen; the token comes from a file or $KVPUSH_TOKEN."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from kvpush.config import TOKEN_ENV, Config, SideChannelConfig, TimingConfig, load_token
from kvpush.errors import ConfigError


def test_defaults_are_consistent_and_frozen() -> None:
    config = Config()
    assert config.timing.heartbeat_interval_s < config.timing.liveness_timeout_s
    assert config.side_channel == SideChannelConfig(token=None, max_frame_bytes=64 * 1024)
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.timing.lease_s = 1.0  # type: ignore[misc]


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [
        ({"lease_s": 0}, "lease_s must be positive, got 0"),
        ({"transfer_deadline_s": -1.0}, "transfer_deadline_s must be positive"),
        (
            {"heartbeat_interval_s": 3.0, "liveness_timeout_s": 3.0},
            "heartbeat_interval_s (3.0) must be below liveness_timeout_s (3.0)",
        ),
    ],
)
def test_timing_is_validated(kwargs: dict[str, float], error: str) -> None:
    with pytest.raises(ConfigError) as exc:
        TimingConfig(**kwargs)
    assert error in str(exc.value)


def test_token_from_file_wins_over_the_environment(tmp_path: Path) -> None:
    path = tmp_path / "token"
    path.write_text("  from-file\n")
    assert load_token(path, env={TOKEN_ENV: "from-env"}) == "from-file"
    assert load_token(None, env={TOKEN_ENV: "from-env"}) == "from-env"
    assert load_token(None, env={TOKEN_ENV: ""}) is None
    assert load_token(None, env={}) is None


def test_unreadable_or_empty_token_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"cannot read token file .*missing: No such file"):
        load_token(tmp_path / "missing")
    empty = tmp_path / "empty"
    empty.write_text("\n")
    with pytest.raises(ConfigError, match="is empty: expected a shared secret"):
        load_token(empty)
