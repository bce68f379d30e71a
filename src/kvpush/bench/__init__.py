"""`kvpush bench`: every transfer layer moving the same bytes, side by side.

`workload` (what moves), `modes` and `kvpush_mode` (each layer's two halves), `runner`
(the child processes and the report), `remote` (`--target`), `endpoint_service` (the
endpoint's half of `--target`), `report` (table and plot). This module stays free of
heavy imports: the CLI reads it to build its parser.
"""

ALL_MODES = ("memcpy", "nixl-raw", "kvpush", "mooncake")
