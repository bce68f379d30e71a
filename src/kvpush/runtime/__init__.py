"""The push runtime: one object per rank that an engine drives.

Public engine API (every method is thread-safe and never blocks on the network)::

    rt = PushRuntime(transport, geometry, identity, directory,
                     RuntimeSettings(timing=..., token=...,   # checked when built
                                     compatibility=CompatibilityPolicy(),  # default: strict
                                     drive_in_step=True),  # engine calls run the pass (below)
                     clock=...)
    rt.start()                       # starts the transport, registers memory, threads
    rt.local_metadata() -> PeerMetadata   # what to publish on this rank's side channel

    # sending side (prefill)
    rt.send(transfer_id, blocks, ready_layers=None)   # None: every layer computed already
    rt.layers_ready(transfer_id, layers)              # layer-by-layer push
    rt.refuse(transfer_id, detail)   # a registration we will never send: fail it now
        # LocalProtocolError for a transfer not being sent: never sent, or ended with
        # its result already taken from poll() (accepted, a no-op, while still queued)

    # receiving side (decode)
    rt.receive(transfer_id, sender, blocks, sender_offset=0, sender_block_tokens=None)
        # `sender` is a PeerAddress(host, port, rank): the sender's side channel.
        # blocks[i] receives the sender's block number sender_offset + i
        # (sender_offset = number of blocks we already had from the prefix cache).
        # sender_block_tokens: the sender's block size where ours is k times it; blocks
        # are then parts of ours (kvpush.geometry.sub_block_ids); None: ours.
    rt.reject(transfer_id, sender, detail)            # refuse before allocating
        # reported here too: poll() returns it on the receiver side, REJECTED, no blocks

    rt.abort(transfer_id)            # either side; the result still comes from poll()
    rt.poll() -> list[TransferResult]            # what ended since the last call
    rt.wait(timeout) -> list[TransferResult]     # the same, blocking until one ends
    rt.transfer_state(transfer_id, side) -> SenderState | ReceiverState | None
        # side "sender"/"receiver"; None once ended (result in poll()) or never handed in
    rt.statistics() -> RuntimeStatistics   # counts, and the in-flight ids with their
                                           # states (sending_transfers/receiving_transfers)
        # forged_messages: data-plane messages dropped unread because of who sent them,
        # by reason (see "Identity" below)
    rt.close()                       # in-flight transfers end as SHUTDOWN; joins threads

The contract: every transfer handed in through `send` or `receive` comes back from
`poll()`/`wait()` exactly once, as finished or failed with a `FailureReason`. Whatever
goes wrong on any thread (handshake not done, peer unknown, unreachable or
incompatible, write error, peer gone or restarted, deadline, malformed message, cancel,
an exception on the background thread) is queued as a result, never handled where it was
found. Every result is a `TransferEnded` built by the protocol (`kvpush.protocol`: its
machines, the receiver's handshake included, and `ended_unreported` for what they did not
end before the runtime stopped); the runtime only carries out effects and passes results
on, as `TransferResult`s: a sending transfer's with what its writes measured
(`result.writes`, a `WritesMeasured`: writes posted, descriptors and bytes the data
plane moved, time spent posting and time with a write in flight).

When a result arrives, kvpush no longer touches its blocks: the engine may free or reuse
them at once (on the receiving side, a finished transfer's blocks hold the KV data).
That is why:

* a receiver that gives up (abort, deadline, silent sender) reports the failure only
  once the sender has acknowledged its cancel, or, if the sender never answers,
  `lease_s + 2 * liveness_timeout_s` later: the sender measures its lease on the
  receiver's clock and starts no write after it, so no late write can land in blocks
  the engine got back (what this still assumes: `kvpush.protocol.state`);
* a sender reports a failure only once every write it issued for the transfer has been
  reported by the data plane (done or failed), whatever ended it (silence, lease,
  deadline, abort, close), except when the data plane reports the peer gone. Its blocks
  stay held until then; `statistics().writes_in_flight` and `sending["ending"]` show it.

Compatibility is checked on every handshake, on both sides, by default: a peer whose
cache differs from ours in protocol version, layout, block size, dtype, mode or regions
fails the transfers that needed it with INCOMPATIBLE_PEER, the detail naming each field
that differs, theirs and ours. Only an explicit `kvpush.config.CompatibilityPolicy`
(fields that may differ, and why) relaxes that.

Failure reasons an engine may want to tell apart: BLOCK_MISMATCH (the receiver's blocks
plus `sender_offset` do not add up to the sender's blocks, on both sides), PEER_GONE (the
data plane lost the peer, a remote disconnect during a write included), REJECTED (the
receiver's `reject()`, on both sides).

Identity: a data-plane message is attributed to the agent the data plane says sent it,
never to what it claims, and an agent is believed to be an engine only once that
engine's side channel (the directory's lookup, with the token when one is configured)
named it; see `kvpush.protocol.state`, "Who sent it". Each runtime incarnation has a
random message key, published in `local_metadata()` (`PeerMetadata.message_key`) and
required in front of every message it accepts: NIXL does not authenticate agent names.
With `token=` (the deployment's side-channel token; `kvpush.node` passes it) every
message is also sealed with a MAC under a key for its pair of ranks and incarnations,
derived from the token and never sent, with a sequence number (`kvpush.protocol.auth`):
what a reader of the network sees grants nothing. What is dropped is counted in
`statistics().forged_messages` by reason: "bad_key", "bad_mac", "replayed",
"unknown_agent", "impostor", "unverified", "wrong_engine", "not_counterpart",
"unread_overflow" (`PushProtocol.forged_messages`). A peer restarted at a new address is
believed once its old address no longer serves the old agent (it is looked up again).
So engine ids must be unique: a second engine that claims the id of one that still
runs elsewhere is refused as an impostor (counted, its Registers never read), and its
transfers end at their deadline.

Bounds (TimingConfig): a silent peer is declared dead after `liveness_timeout_s`; a
peer the data plane reports gone, or one whose side channel now serves a new
incarnation, ends its transfers at once; a transfer's deadline, `transfer_deadline_s`,
runs from the engine's call (`send`/`receive`), handshake included; nothing lives past
it plus the fence, except a sender's transfer whose write the data plane never reports.

Engine misuse that can be seen at the call (a transfer id already in flight, a block id
outside the cache, a layer out of range, a sender that is not a `PeerAddress`) raises
`LocalProtocolError` at once; a transfer id reused while the protocol still remembers its
previous use ends as LOCAL_ERROR. After the background thread died on an unexpected
error, calls raise `RuntimeStopped` (its cause chained; a `kvpush.errors.BrokenError`,
not a `ClosedError`, which means closed by us) and every transfer that was in flight is
reported as LOCAL_ERROR once the transport is closed.

`close()` ends the transfers in flight as SHUTDOWN the safe way: senders wait for their
writes (up to half of its timeout), receivers for their senders' acknowledgements (up to
0.25 s: a live sender answers within a round trip); then the transport is closed (no
write can read our memory after that) and what is left is reported. A receiver's
transfer reported then may still be written by a sender whose lease has not run out: an
engine that keeps running should not reuse those blocks for `lease_s + 2 *
liveness_timeout_s`.

Layout of this package, along its seams:

* `facade` — `PushRuntime`: the engine-facing calls, every argument check, the lock, the
  result queue and its counters. Each call reaches the driver as a command: queued for
  the runtime's thread, or run at once in an in-step pass (`Driver.drive`).
* `driver` — `Driver`: the pass (commands, one poll of the transport, its events, the
  protocol's tick, the effects carried out), the runtime's thread that loops over it, the
  statistics snapshot. It owns the transport (and so the NIXL agent) and the protocol
  machines; they are touched only inside a pass, under the driver's lock.
* `directory` — the `PeerDirectory` port (`InMemoryPeerDirectory`,
  `SideChannelPeerDirectory`) and the `LookupPool` of threads that runs lookups.
* `values` — `RuntimeIdentity`, `RuntimeStatistics`, `TransferResult`, `WritesMeasured`,
  `PeerAddress`.

Threads, and who touches what: the transport and the protocol machines are touched only
inside a pass, and a pass runs only under the driver's lock, one thread at a time: the
runtime's own thread, or an engine thread driving in-step (below). The facade's result
queue, in-flight set and counters are under the facade's lock; a pass reports into
them. The runtime's thread is started by `start()` and joined by `close()`, and so is a
pool of up to 16 lookup threads (started on demand) that do the blocking side-channel
lookups, different addresses in parallel, and post each result back as a command: they
touch neither the transport nor the protocol. One address that never answers costs only
its own transfers: known-good addresses go first, addresses never seen or whose last
lookup got no answer hold at most three quarters of the pool (those at most half), and
an unanswered address is tried again only after a back-off (50 ms doubling to 2 s,
cleared by an answer) while its transfers wait within their own deadline.

In-step driving (the default; `drive_in_step=False` turns it off): an engine call
(`send`, `receive`, `layers_ready`, `abort`, `reject`, `poll`, and `wait` before it
waits) runs the driver's pass itself, on the engine's thread, when no other thread is in
one (a try-lock: the transport and the protocol are only ever touched under that lock,
by one thread at a time). It runs the commands queued before it, then its own, then
polls the transport once: a `send()` posts its write at once, with no hand-off to the
runtime's thread. When the lock is taken the call only queues its command; the next
pass, on whichever thread, runs it. An exception in an in-step pass ends the runtime as
a crash of its thread does (the thread is woken to re-raise it). An engine that calls
`poll()` once per step drives the runtime itself: for 10 ms after each `poll()` the
runtime's thread wakes for commands only.

The driver's thread blocks on its command queue while nothing is in flight (waking every
`idle_poll_s`, default half a heartbeat interval, to look for registrations: NIXL cannot
wake a thread on an incoming notification), and polls the transport with exponential
backoff (50 us up to `max_backoff_s`, default 0.25 ms) while transfers are in flight.
Right after data-plane activity (an event in, a write or message out) it keeps polling
at the shortest wait for `spin_s` (default 0.5 ms): NIXL progresses only when polled,
and the next event (WriteDone, the peer's answer) is usually that close. It never polls
without waiting: a hot loop would hold the GIL from the engine's own Python threads.
Idle, nothing spins. (Why these defaults, with figures: docs/benchmarks.md, "Design
notes moved from docstrings".)

Latency inside a busy engine: when another thread of the process computes in Python, each
wake-up of a thread that does not hold the GIL (the runtime's thread, or the thread in
`wait()`) waits for it up to `sys.getswitchinterval()` (5 ms by default). On one host UCX
runs over TCP and a write needs three alternating polls (receiver, sender, receiver), so
a transfer needs several such wake-ups. What removes them: in-step calls (above), an
engine that takes results with `poll()` on its own thread, and NIXL's UCX progress
thread (`NixlTransport(progress_thread_wait_ms=10)`, from a node's `transport_factory`;
opt-in: it moves the data plane without the GIL, at a CPU cost per GB on large
transfers). Figures, and the commands:
docs/benchmarks.md, "Per-transfer cost".

Publishing: the runtime does not serve its own side channel. `kvpush.node.Node` does
the wiring every caller needs: it binds one `MetadataServer` per engine (port 0 lets the
OS pick), builds each rank's `RuntimeIdentity` with that port, starts each rank's runtime
and then publishes its `local_metadata()`; a lookup before that answers "unknown rank",
as for any rank not up yet. (`kvpush.node.Rank` is one rank without a side channel, for
engines whose side channel lives in another process, as vLLM's does.) The runtime
owns the transport it is given: `start()` starts it, `close()` closes it.

Handshakes: a receiver handshakes with the sender's address from the request before it
registers (the protocol's HANDSHAKING state; one lookup per address, however many
transfers wait for it); the `Register` carries the receiver's own address (`identity`)
so the sender handshakes back before its first write. Metadata is cached per address
while the peer is heard from (heartbeats flow while transfers do); an address not heard
from for `revalidate_after_s` (default 0.1 s) is looked up again before its next
Register, so a peer restarted there (new incarnation, new agent) is handshaked afresh on
the first transfer after the restart, and everything still in flight with its old
incarnation fails with PEER_RESTARTED. The lookup costs one side-channel round trip, and
only after a quiet spell; in push mode it overlaps the sender's prefill. The first
contact between a sender and a receiver also takes one data-plane round trip (a
heartbeat and its echo) before the first write: it bounds the receiver's clock for the
lease. Later transfers take none.

A sender restarted faster than `revalidate_after_s` still gets the first Register, sent
from the cache to its dead agent. When the data plane reports that agent gone in the
same loop pass (NIXL could not deliver the notification), the Register reached nobody:
the protocol takes it back and looks the address up again, and registers once more
(`register_retries` in `statistics()`). Only once, and only while nothing was heard from
that agent since the Register went out, so never when a byte may have been written.
"""

from kvpush.errors import RuntimeStopped
from kvpush.protocol import ReceiverState, SenderState
from kvpush.runtime.directory import (
    InMemoryPeerDirectory,
    PeerDirectory,
    SideChannelPeerDirectory,
)
from kvpush.runtime.facade import PushRuntime
from kvpush.runtime.services import RuntimeService, ServiceHost
from kvpush.runtime.values import (
    PeerAddress,
    RuntimeIdentity,
    RuntimeSettings,
    RuntimeStatistics,
    TransferResult,
    WritesMeasured,
)

__all__ = [
    "InMemoryPeerDirectory",
    "PeerAddress",
    "PeerDirectory",
    "PushRuntime",
    "ReceiverState",
    "RuntimeIdentity",
    "RuntimeService",
    "RuntimeSettings",
    "RuntimeStatistics",
    "RuntimeStopped",
    "SenderState",
    "ServiceHost",
    "SideChannelPeerDirectory",
    "TransferResult",
    "WritesMeasured",
]
