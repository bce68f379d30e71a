"""The scope table in docs/protocol-checking.md: written by the checker
(`python -m tests.protocol_model --scope ci --write-doc`), read back by the tests, which
check that each scope still explores the states, depth and goals the doc shows."""

from __future__ import annotations

import re
from pathlib import Path

from .checker import Result

DOC = Path(__file__).resolve().parents[2] / "docs" / "protocol-checking.md"
BEGIN = "<!-- BEGIN scope table {group} (written by --write-doc; do not edit) -->"
END = "<!-- END scope table {group} -->"
HEADER = (
    "| scope | depth | distinct states | transitions | cut states completed | goals reached "
    "| seconds |\n|---|---|---|---|---|---|---|"
)


def row(r: Result, depth: int) -> str:
    reached = len(r.goals) - len(r.missed)
    explored = f"{r.depth} (all)" if r.complete else str(depth)
    return (
        f"| {r.scope} | {explored} | {r.states:,} | {r.transitions:,} | {r.completed:,} "
        f"| {reached}/{len(r.goals)} | {r.seconds:.1f} |"
    )


SCENARIO_HEADER = (
    "| scope | scenario | first reached at depth | depth bound | room wanted "
    "| new states it led to |\n|---|---|---|---|---|---|"
)


def scenario_rows(r: Result) -> list[str]:
    """One row per scenario event of the scope: where the search first reached it, and
    how many states, new to the search, a step where it happened led to (a step into a
    state seen before, by another path, counts no more: 0 where, say, every forged
    message read is dropped and the state is the one the first such step made)."""
    out = []
    for event, (first, n) in r.scenario.items():
        at = "never" if first is None else str(first)
        out.append(f"| {r.scope} | {event} | {at} | {r.max_depth} | {r.room} | {n:,} |")
    return out


def render(rows: list[str], total: str) -> str:
    return "\n".join([HEADER, *rows, total])


def write(group: str, table: str, doc: Path = DOC) -> None:
    text = doc.read_text()
    begin, end = BEGIN.format(group=group), END.format(group=group)
    if begin not in text or end not in text:
        raise SystemExit(f"{doc}: no '{begin}' ... '{end}' block to write the table into")
    head, rest = text.split(begin, 1)
    _, tail = rest.split(end, 1)
    doc.write_text(f"{head}{begin}\n{table}\n{end}{tail}")


def read(group: str, doc: Path = DOC) -> dict[str, tuple[str, int, str]]:
    """scope -> (depth, distinct states, goals reached) as the doc's table shows them."""
    text = doc.read_text()
    begin, end = BEGIN.format(group=group), END.format(group=group)
    block = text.split(begin, 1)[1].split(end, 1)[0]
    out: dict[str, tuple[str, int, str]] = {}
    for line in block.splitlines():
        parsed = parse(line)
        if parsed is not None:
            out[parsed[0]] = parsed[1:]
    return out


def parse(line: str) -> tuple[str, str, int, str] | None:
    """(scope, depth, distinct states, goals reached) of one row of the table."""
    cells = [c.strip() for c in line.strip().strip("|").split("|")]
    if len(cells) != 7 or cells[0] == "total" or not re.fullmatch(r"[\d,]+", cells[2]):
        return None
    return cells[0], cells[1], int(cells[2].replace(",", "")), cells[5]
