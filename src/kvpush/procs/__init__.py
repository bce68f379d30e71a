"""Server processes, as the tools and the CLI start and wait for them.

- `readiness`: the `wait-ready` logic (a server's process, its HTTP endpoint, its side
  channel) and `free_port`.
- `server_process`: one `kvpush` subcommand as a child process (`ServerProcess`): start,
  wait until ready, stop, show its log.

The bottom of the tools layer: `kvpush.demo`, the CLI and, from outside the package, the lab
(`tools/kvpush_lab`) use it; the library core, serving and the integrations do not.
"""
