"""`DoctorProbe`: the node service that answers `kvpush doctor`'s data-plane check.

Given to a `Node` at assembly (`Node(services=[DoctorProbe(scratch=...)])`), it gives
each rank a `RankProbe` and serves three request kinds on the node's side channel,
behind the token's proof like every request: start test writes from a rank into a
receiver's scratch buffer, read where they stand, read a digest of a rank's own buffer.
A rank without a scratch buffer refuses them all, saying why. Bodies (msgpack maps)::

    b"doctor-write"   {"rank": r, "to": [host, port, rank], "seed": bytes} -> {"probe": id}
    b"doctor-result"  {"rank": r, "probe": id} -> `ProbeReport.as_dict()`
    b"doctor-digest"  {"rank": r, "bytes": n} -> {"sha256": hex of its first n bytes}
"""

from __future__ import annotations

from collections.abc import Mapping

from kvpush.doctor_probe.rank import ProbeRefused, RankProbe
from kvpush.errors import LocalProtocolError
from kvpush.node import NodeService
from kvpush.runtime import PeerAddress
from kvpush.sidechannel import ControlHandler, RequestRejected

__all__ = ["DOCTOR_DIGEST", "DOCTOR_RESULT", "DOCTOR_WRITE", "DoctorProbe"]

DOCTOR_WRITE, DOCTOR_RESULT, DOCTOR_DIGEST = b"doctor-write", b"doctor-result", b"doctor-digest"


class DoctorProbe(NodeService):
    """The doctor's checks on every rank of one node. `scratch`: each rank owns a
    scratch buffer (a server turns it on when it has a token or its operator allows
    doctor writes); without one, every check is refused, naming why. `first_rank`: the
    rank of the first `for_rank` (a process that runs one rank of an engine whose ranks
    live in several, as vLLM's workers do, serves that rank alone)."""

    def __init__(self, *, scratch: bool, first_rank: int = 0) -> None:
        self._scratch = scratch
        self._first = first_rank
        self._ranks: list[RankProbe] = []  # by rank - first_rank, as the node builds them

    def for_rank(self, rank: int) -> RankProbe:
        if rank != self._first + len(self._ranks):
            raise LocalProtocolError(f"DoctorProbe: rank {rank} asked for out of order")
        probe = RankProbe(self._scratch)
        self._ranks.append(probe)
        return probe

    def control(self) -> Mapping[bytes, ControlHandler]:
        return {
            DOCTOR_WRITE: self._write,
            DOCTOR_RESULT: self._result,
            DOCTOR_DIGEST: self._digest,
        }

    def _rank(self, body: object, *keys: str) -> tuple[RankProbe, dict[str, object]]:
        if not isinstance(body, dict) or not all(k in body for k in ("rank", *keys)):
            raise RequestRejected(f"expected a map with {', '.join(('rank', *keys))}")
        r = body["rank"]
        ranks, first = self._ranks, self._first
        if isinstance(r, bool) or not isinstance(r, int) or not 0 <= r - first < len(ranks):
            raise RequestRejected(
                f"rank {r!r} is not one of this node's {first}..{first + len(ranks) - 1}"
            )
        return ranks[r - first], body

    def _write(self, body: object) -> object:
        probe, body = self._rank(body, "to", "seed")
        to, seed = body["to"], body["seed"]
        if not (
            isinstance(to, list | tuple)
            and len(to) == 3
            and isinstance(to[0], str)
            and all(isinstance(x, int) and not isinstance(x, bool) for x in to[1:])
            and isinstance(seed, bytes)
        ):
            raise RequestRejected("expected to = [host, port, rank] and seed = bytes")
        try:
            return {"probe": probe.start_probe(PeerAddress(*to), seed)}
        except (ProbeRefused, LocalProtocolError) as exc:
            raise RequestRejected(str(exc)) from None

    def _result(self, body: object) -> object:
        probe, body = self._rank(body, "probe")
        probe_id = body["probe"]
        report = probe.probe_report(probe_id) if isinstance(probe_id, int) else None
        if report is None:
            raise RequestRejected(f"no check {probe_id!r} is known on rank {body['rank']}")
        return report.as_dict()

    def _digest(self, body: object) -> object:
        probe, body = self._rank(body, "bytes")
        nbytes = body["bytes"]
        if isinstance(nbytes, bool) or not isinstance(nbytes, int):
            raise RequestRejected(f"expected bytes = a byte count, got {nbytes!r}")
        try:
            return {"sha256": probe.scratch_digest(nbytes)}
        except ProbeRefused as exc:
            raise RequestRejected(str(exc)) from None
