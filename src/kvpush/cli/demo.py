"""`kvpush demo`: the whole prefill/decode path on this machine, checked token for token.

Builds the tiny model if it is missing; starts a prefill server, a decode server and a
proxy as separate processes, each waited for with the `wait-ready` logic (a server that
dies at start-up fails the demo at once, with its log tail); sends a concurrent workload
of prompts of varied lengths; checks every completion against a single-instance run;
prints a summary and stops everything. `--inject kill-prefill` shows what a user sees
when a prefill server dies. Exit 0 only when every check passed.
"""

from __future__ import annotations

import argparse

from kvpush.demo.run import add_demo_arguments, options_from_args, run_demo


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser(
        "demo",
        help="run prefill, decode and proxy servers and check them against one instance",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_demo_arguments(p)
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    report = run_demo(options_from_args(args), lambda line: print(line, flush=True))
    print("\n".join(report.summary_lines()), flush=True)
    print("demo OK" if report.ok else "demo FAILED", flush=True)
    return 0 if report.ok else 1
