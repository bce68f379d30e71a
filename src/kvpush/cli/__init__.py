"""The `kvpush` command line. Only this package configures logging or prints.

Each subcommand lives in its own module with `add_parser(subparsers)` and
`run(args) -> int`; `_COMMANDS` lists them in the order `--help` shows them.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from collections.abc import Sequence

from kvpush import __version__
from kvpush.errors import KVPushError

_COMMANDS: tuple[str, ...] = (
    "demo",
    "endpoint",
    "probe",
    "doctor",
    "wait_ready",
    "bench",
    "make_model",
    "serve",
    "proxy",
)

EXIT_OK, EXIT_ERROR, EXIT_USAGE = 0, 1, 2


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvpush", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"kvpush {__version__}")
    parser.add_argument(
        "-v", "--verbose", action="count", default=0, help="more log output (-vv: debug)"
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in _COMMANDS:
        importlib.import_module(f"kvpush.cli.{name}").add_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exit_:
        return int(exit_.code or 0)
    level = {0: logging.WARNING, 1: logging.INFO}.get(args.verbose, logging.DEBUG)
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return int(args.run(args))
    except KVPushError as exc:
        print(f"{type(exc).__name__}: {exc}", file=sys.stderr)
        return EXIT_ERROR
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
