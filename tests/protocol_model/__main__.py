"""`python -m tests.protocol_model --scope ci|large [--rev main] [--mutation NAME]`."""

from __future__ import annotations

import argparse
import sys
import time

from . import loader, scopes, table
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
    parser.add_argument(
        "--write-doc",
        action="store_true",
        help="write the scope table into docs/protocol-checking.md (the ci group)",
    )
    args = parser.parse_args(argv)
    cpu_start = time.process_time()
    state = loader.load(args.rev)
    failed = False
    total_states, total_s = 0, 0.0
    rows: list[str] = []
    scenario_rows: list[str] = []
    for scope in scopes.group(args.scope):
        model = Model(scope, state, args.mutation)

        def progress(depth: int, states: int, frontier: int, seconds: float) -> None:
            print(f"  depth {depth}: {states} states, frontier {frontier}, {seconds:.1f} s")

        find = frozenset(args.find.split(",")) if args.find else None
        result = check(model, args.max_states, progress if args.verbose else None, find)
        print(result.report(), flush=True)
        rows.append(table.row(result, scope.max_depth))
        scenario_rows += table.scenario_rows(result)
        total_states += result.states
        total_s += result.seconds
        failed = failed or not result.ok
    print(f"total: {total_states} distinct states in {total_s:.1f} s")
    if args.write_doc:
        cpu = time.process_time() - cpu_start
        total = f"| total | | {total_states:,} | | | | {total_s:.1f} ({cpu:.0f} s CPU) |"
        table.write(args.scope, table.render(rows, total))
        table.write(f"{args.scope} scenarios", "\n".join([table.SCENARIO_HEADER, *scenario_rows]))
        print(f"wrote the {args.scope} table into {table.DOC}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
