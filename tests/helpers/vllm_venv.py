"""Running a script in the vLLM venv (`.venv-vllm`, which `make test` builds), on this
checkout's kvpush whatever the venv holds, and reading the JSON it prints last. A
missing venv is a failure, never a skip: the tests that use this are the only proof of
what they check."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest

from kvpush.errors import ConfigError
from kvpush_lab.vllm_servers import vllm_python

SRC = Path(__file__).resolve().parents[2] / "src"


def run_in_vllm_venv(
    script: str, *args: str, path: tuple[Path, ...] = (), timeout_s: float = 240
) -> Any:
    """Run `script` (`python -c`) with `args` in the vLLM venv, `path` after this
    checkout's `src` on its PYTHONPATH; the JSON of its last line of output."""
    try:
        python = vllm_python()
    except ConfigError as exc:
        pytest.fail(f"cannot run in the vLLM venv: {exc}", pytrace=False)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = os.pathsep.join(str(p) for p in (SRC, *path))
    run = subprocess.run(
        [str(python), "-c", script, *args],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        env=env,
        check=False,
    )
    assert run.returncode == 0, run.stderr[-4000:]
    return json.loads(run.stdout.strip().splitlines()[-1])
