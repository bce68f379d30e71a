"""Which protocol the checker runs: the working tree's, or one from a git revision.

`load(None)` is `kvpush.protocol` as imported. `load("main")` reads the protocol's files
of that revision with `git show` (`messages.py` and `state.py`, and, from the split along
the sender/receiver seam on, `_common.py`, `sender.py` and `receiver.py` between them, and
the modules split out of those since (`claims.py`, `lookups.py`, ...), in import order; a
file a revision does not have is skipped) and loads them as a separate package
(`kvpush_protocol_at_main`), so the checker can run an older protocol, unedited, next to
the current one: the honest way to show that it finds a bug the current code fixed.
"""

from __future__ import annotations

import re
import subprocess
import sys
import types
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
_FILES = (
    "messages",
    "auth",
    "_common",
    "identity",
    "tombstones",
    "leases",
    "writes",
    "choice",
    "sender",
    "lookups",
    "claims",
    "receiver_messages",
    "receiver_timers",
    "receiver",
    "state",
)
# The files that every revision the checker can run has; the others are optional.
_REQUIRED = ("messages", "state")


def load(rev: str | None) -> types.ModuleType:
    """The `state` module of the protocol at `rev` (None: the one on sys.path)."""
    if rev is None:
        from kvpush.protocol import state

        return state
    package = "kvpush_protocol_at_" + re.sub(r"\W", "_", rev)
    if package + ".state" in sys.modules:
        return sys.modules[package + ".state"]
    pkg = types.ModuleType(package)
    pkg.__path__ = []
    sys.modules[package] = pkg
    for name in _FILES:
        shown = subprocess.run(
            ["git", "show", f"{rev}:src/kvpush/protocol/{name}.py"],
            cwd=REPO,
            check=name in _REQUIRED,
            capture_output=True,
            text=True,
        )
        if shown.returncode != 0:
            continue  # a revision from before the split
        source = shown.stdout
        # The only edit: its imports of its sibling modules point at this package.
        source = source.replace("kvpush.protocol.", f"{package}.")
        module = types.ModuleType(f"{package}.{name}")
        module.__file__ = f"{rev}:src/kvpush/protocol/{name}.py"
        sys.modules[module.__name__] = module
        exec(compile(source, module.__file__, "exec"), module.__dict__)
        setattr(pkg, name, module)
    return sys.modules[package + ".state"]
