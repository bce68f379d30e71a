"""What the doctor found: one `StepResult` per step, rendered as text or as JSON.

The `Report` is built once, by `kvpush.doctor.checks.run_doctor`; `as_json()` and
`render_text()` both read it and nothing else, so the two forms never disagree.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field


class Verdict(enum.StrEnum):
    """One step's verdict, from best to worst; `skip` is a step this run did not check."""

    OK = "ok"
    SKIP = "skip"
    WARN = "warn"
    FAIL = "fail"


_RANK = {Verdict.OK: 0, Verdict.SKIP: 1, Verdict.WARN: 2, Verdict.FAIL: 3}


def worst(verdicts: list[Verdict]) -> Verdict:
    return max(verdicts, key=_RANK.__getitem__, default=Verdict.OK)


@dataclass(frozen=True, slots=True)
class Finding:
    """One observation. A warn or a fail carries `next_action`: what to change, concretely."""

    verdict: Verdict
    text: str
    side: str | None = None  # "prefill", "decode", or None for the pair
    next_action: str | None = None

    def as_json(self) -> dict[str, object]:
        return {
            "verdict": self.verdict.value,
            "side": self.side,
            "text": self.text,
            "next_action": self.next_action,
        }


@dataclass(slots=True)
class StepResult:
    number: int
    name: str
    findings: list[Finding] = field(default_factory=list)
    # Measured values, keyed by side ("prefill", "decode") or "pair"; JSON-ready.
    figures: dict[str, object] = field(default_factory=dict)
    not_run_because: str | None = None  # set when an earlier step failed

    @property
    def verdict(self) -> Verdict:
        if self.not_run_because is not None:
            return Verdict.SKIP
        return worst([f.verdict for f in self.findings])

    def add(
        self,
        verdict: Verdict,
        text: str,
        *,
        side: str | None = None,
        next_action: str | None = None,
    ) -> None:
        if verdict in (Verdict.WARN, Verdict.FAIL) and not next_action:
            raise ValueError(f"a {verdict} finding needs a next action: {text}")
        self.findings.append(Finding(verdict, text, side, next_action))

    def as_json(self) -> dict[str, object]:
        return {
            "step": self.number,
            "name": self.name,
            "verdict": self.verdict.value,
            "run": self.not_run_because is None,
            "not_run_because": self.not_run_because,
            "findings": [f.as_json() for f in self.findings],
            "figures": self.figures,
        }


@dataclass(frozen=True, slots=True)
class Report:
    prefill: str  # the addresses as given, for the heading
    decode: str
    steps: tuple[StepResult, ...]

    @property
    def verdict(self) -> Verdict:
        """fail, warn or ok: a step not checked (skip) makes nothing worse, nor better."""
        found = worst([s.verdict for s in self.steps if s.verdict is not Verdict.SKIP])
        return found

    @property
    def exit_code(self) -> int:
        """0 when nothing failed (warnings included), 1 when any step failed."""
        return 1 if self.verdict is Verdict.FAIL else 0

    def as_json(self) -> dict[str, object]:
        return {
            "verdict": self.verdict.value,
            "exit_code": self.exit_code,
            "prefill": self.prefill,
            "decode": self.decode,
            "steps": [s.as_json() for s in self.steps],
        }

    def render_text(self) -> str:
        lines = [f"kvpush doctor: prefill {self.prefill}, decode {self.decode}"]
        for step in self.steps:
            tag = f"[{step.verdict.value}]".ljust(7)
            if step.not_run_because is not None:
                tag = "[--]".ljust(7)
                lines.append(f"{tag}{step.number} {step.name}: not run ({step.not_run_because})")
                continue
            lines.append(f"{tag}{step.number} {step.name}")
            for f in step.findings:
                mark = "" if f.verdict is Verdict.OK else f"{f.verdict.value.upper()}: "
                who = f"{f.side}: " if f.side else ""
                lines.append(f"       {mark}{who}{f.text}")
                if f.next_action:
                    lines.append(f"         next: {f.next_action}")
        fails = sum(s.verdict is Verdict.FAIL for s in self.steps)
        warns = sum(s.verdict is Verdict.WARN for s in self.steps)
        unchecked = [str(s.number) for s in self.steps if s.verdict is Verdict.SKIP]
        lines.append(
            f"verdict: {self.verdict.value} ({fails} failing step{'s' * (fails != 1)}, "
            f"{warns} with warnings, not checked: {', '.join(unchecked) or 'none'})"
        )
        return "\n".join(lines)
