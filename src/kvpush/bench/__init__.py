"""`kvpush bench`: every transfer layer moving the same bytes, side by side.

`workload` (what moves), `modes` and `kvpush_mode` (each layer's two halves), `runner`
(the child processes and the report), `interleave` and `rounds` (the local run, round by
round, and its paired ratios), `shapes` (`--shapes`: kvpush between engines of
different TP sizes, a process per rank), `remote` (`--target`), `endpoint_service` (the
endpoint's half of `--target`), `report` (table and plot). This module stays free of
heavy imports: the CLI reads it to build its parser.
"""

# What `--modes` runs unless told otherwise.
DEFAULT_MODES = ("memcpy", "nixl-raw", "kvpush", "mooncake")
# kvpush-token: kvpush with a side-channel token, so every data-plane message carries a
# MAC (`kvpush.protocol.auth`): its cost beside kvpush's, in one run.
ALL_MODES = (*DEFAULT_MODES, "kvpush-token")
# Counted rounds of the interleaved local run (`interleave`), after its warm-up round:
# each ratio is the median of this many paired ones, an even count so that each pair of
# modes runs as often in one order as in the other. A ratio moves with the host, not only
# with its noise: a shared host's slow spells last from seconds to a minute, and during
# one kvpush and nixl-raw both slow down, by different amounts. A run must span several
# of them for its medians to repeat, so `--quick` takes 48 rounds (about 40 s for two
# modes), where 8 (12 s) let five runs in a row disagree by 11 to 22 %
# (docs/benchmarks.md, "Sixth pass"). A round's batch of a size never shrinks below
# `workload.ROUND_MIN_BYTES`.
DEFAULT_ROUNDS = 5
QUICK_ROUNDS = 48
