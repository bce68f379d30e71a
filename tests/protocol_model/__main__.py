"""`python -m tests.protocol_model --scope ci|large [--rev main] [--mutation NAME]`."""

from __future__ import annotations

import argparse
import sys

from . import loader, scopes
from .checker import check
from .model import Model


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.protocol_model")
    parser.add_argument("--scope", default="ci", help="a scope name, or a group: ci, large")
    parser.add_argument("--rev", default=None, help="check the protocol of this git revision")
    parser.add_argument("--mutation", default=None, help="put a named bug back (see api.py)")
    parser.add_argument("--max-states", type=int, default=None)
    parser.add_argument(
        "--find",
        default=None,
        help="comma-separated violation kinds to look for; steps breaking others are not taken",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="progress per depth")
    args = parser.parse_args(argv)
    state = loader.load(args.rev)
    failed = False
    total_states, total_s = 0, 0.0
    for scope in scopes.group(args.scope):
        model = Model(scope, state, args.mutation)

        def progress(depth: int, states: int, frontier: int, seconds: float) -> None:
            print(f"  depth {depth}: {states} states, frontier {frontier}, {seconds:.1f} s")

        find = frozenset(args.find.split(",")) if args.find else None
        result = check(model, args.max_states, progress if args.verbose else None, find)
        print(result.report(), flush=True)
        total_states += result.states
        total_s += result.seconds
        failed = failed or not result.ok
    print(f"total: {total_states} distinct states in {total_s:.1f} s")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
