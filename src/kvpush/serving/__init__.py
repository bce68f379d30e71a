"""The reference serving stack: a small engine, OpenAI-compatible servers and a proxy.

- `model`: a Llama decoder in torch over a paged KV cache (`LlamaModel`, `ModelConfig`).
- `paged`: the KV cache tensors (`PagedKVCache`, layout `kv_separate/NHD`) and the block
  allocator with prefix caching (`BlockAllocator`).
- `engine`: continuous batching and its decoding (`Engine`), plus the hooks
  disaggregation needs.
- `sampling`: what a request asks for and how a token is chosen (`SamplingParams`,
  `sample`), and prompt-lookup speculation (`SpecConfig`, `propose_drafts`,
  `verify_drafts`, `DraftCounts`).
- `checkpoint`: Hugging Face checkpoints (`load_model`) and a tiny seeded one (`make_model`).
- `worker`: the engine loop, which calls a `Role` at named points; `prefill_role` and
  `decode_role` move KV over `kvpush.runtime.PushRuntime` on NIXL, and `disagg` builds
  them (`build_role`).
- `server`, `app`, `options`: the HTTP API and `kvpush serve`;
  `openai_request` and `detokenizer`: the OpenAI request side and streamed text.
- `proxy`: `kvpush proxy`, both legs at once.

Needs the `serve` extra (fastapi, uvicorn, httpx, tokenizers, safetensors).
"""
