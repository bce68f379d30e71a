"""`kvpush doctor --proxy URL`: every prefill/decode pair behind one `kvpush proxy`.

The proxy's `/health` lists its backends' URLs; each `kvpush serve` backend's own
`/health` names its side channel. A backend the doctor cannot place (unreachable, or a
server whose `/health` does not name its side channel, as vLLM's) is a finding of its
own; every pair of placed backends gets a full report.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from kvpush.doctor.checks import DoctorOptions, Target, run_doctor
from kvpush.doctor.http import HttpFailed, base_url, get_health, get_proxy_health
from kvpush.doctor.report import Finding, Report, Verdict, worst
from kvpush.errors import AddressError
from kvpush.health import MalformedHealth


@dataclass(frozen=True, slots=True)
class ProxyReport:
    proxy: str
    backends: tuple[Finding, ...]  # one per backend the doctor could not place
    pairs: tuple[Report, ...]

    @property
    def verdict(self) -> Verdict:
        if any(f.verdict is Verdict.FAIL for f in self.backends) or not self.pairs:
            return Verdict.FAIL
        return worst([r.verdict for r in self.pairs])

    @property
    def exit_code(self) -> int:
        """0 when nothing failed (warnings included), 1 when anything failed."""
        return 1 if self.verdict is Verdict.FAIL else 0

    def as_json(self) -> dict[str, object]:
        return {
            "verdict": self.verdict.value,
            "exit_code": self.exit_code,
            "proxy": self.proxy,
            "backends": [f.as_json() for f in self.backends],
            "pairs": [r.as_json() for r in self.pairs],
        }

    def render_text(self) -> str:
        lines = [f"kvpush doctor: proxy {self.proxy}: {len(self.pairs)} pair(s) to check"]
        for f in self.backends:
            lines.append(f"[{f.verdict.value}] {f.side}: {f.text}")
            if f.next_action:
                lines.append(f"  next: {f.next_action}")
        for i, report in enumerate(self.pairs, 1):
            lines += ["", f"--- pair {i} of {len(self.pairs)}", report.render_text()]
        lines += ["", f"proxy verdict: {self.verdict.value}"]
        return "\n".join(lines)


def check_proxy(proxy_url: str, options: DoctorOptions) -> ProxyReport:
    """`options` gives the token and the timeout; its prefill and decode are ignored."""
    base = base_url(proxy_url)
    try:
        health = get_proxy_health(base, options.timeout_s)
    except HttpFailed as exc:
        return ProxyReport(base, (_fail("proxy", str(exc), "start the proxy, or fix --proxy"),), ())
    except MalformedHealth as exc:
        return ProxyReport(
            base,
            (
                _fail(
                    "proxy",
                    f"{base}/health does not list prefill and decode backends: {exc}",
                    "give --proxy the URL of a kvpush proxy",
                ),
            ),
            (),
        )
    problems: list[Finding] = []
    placed: dict[str, list[Target]] = {"prefill": [], "decode": []}
    for role, pool in (("prefill", health.prefill), ("decode", health.decode)):
        for backend in pool:
            target = _place(role, backend.url, options, problems)
            if target is not None:
                placed[role].append(target)
    pairs = tuple(
        run_doctor(replace(options, prefill=p, decode=d))
        for p in placed["prefill"]
        for d in placed["decode"]
    )
    return ProxyReport(base, tuple(problems), pairs)


def _place(role: str, url: str, options: DoctorOptions, problems: list[Finding]) -> Target | None:
    try:
        base = base_url(url)
        _, body = get_health(base, options.timeout_s)
    except (AddressError, HttpFailed) as exc:
        problems.append(
            _fail(
                role,
                f"backend {url}: {exc}",
                f"start the {role} server at {url}, or take it out of the proxy's --{role}",
            )
        )
        return None
    side_channel = body.side_channel_address if body is not None else None
    if side_channel is None:
        problems.append(
            _fail(
                role,
                f"backend {url}: its /health does not name its side channel (not a kvpush "
                "serve server?)",
                f"check this pair with --{role} HOST:PORT (its side channel) and "
                f"--{role}-http {url} instead of --proxy",
            )
        )
        return None
    return Target(role, *side_channel, base)


def _fail(side: str, text: str, action: str) -> Finding:
    return Finding(Verdict.FAIL, text, side, action)
