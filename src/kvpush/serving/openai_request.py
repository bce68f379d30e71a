"""The OpenAI API's request side: a `/v1/completions` body, or a `/v1/chat/completions`
body rendered into one, checked in full before anything reaches the engine thread.

A bad request raises `BadRequest`, whose message says which field was wrong and what was
expected. `temperature` 0 (the default) decodes greedily; above it, tokens are sampled
(with `top_p`) from a generator seeded by `seed`. `stop` takes up to four strings. Beyond
OpenAI's fields, as vLLM does: `return_token_ids`, `ignore_eos` and `kv_transfer_params`
(disaggregated serving). OpenAI fields this server does not implement are accepted only
at their defaults; unknown fields are refused.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvpush.serving.checkpoint import Tokenizer
from kvpush.serving.sampling import SamplingParams


class BadRequest(Exception):
    """A request refused before it reaches the engine: its status and why."""

    def __init__(self, message: str, status: int = 400, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.retry_after_s = retry_after_s


@dataclass(frozen=True, slots=True)
class CompletionRequest:
    prompt_token_ids: list[int]
    max_tokens: int
    stream: bool
    ignore_eos: bool
    return_token_ids: bool
    include_usage: bool
    kv_transfer_params: dict[str, object] | None
    model: str | None
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()

    def sampling_params(self) -> SamplingParams:
        return SamplingParams(
            max_tokens=self.max_tokens,
            ignore_eos=self.ignore_eos,
            temperature=self.temperature,
            top_p=self.top_p,
            seed=self.seed,
        )


_IGNORED_IF_DEFAULT: dict[str, tuple[object, ...]] = {
    "n": (1, None),
    "best_of": (1, None),
    "logprobs": (None, 0),
    "echo": (False, None),
    "suffix": (None, ""),
    "presence_penalty": (0, 0.0, None),
    "frequency_penalty": (0, 0.0, None),
    "user": (),
    "top_k": (None, -1, 0),
}


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _number(body: dict[str, Any], key: str, default: float, low: float, high: float) -> float:
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float) or not low <= value <= high:
        raise BadRequest(f"{key} must be a number in {low:g}..{high:g}, got {value!r}")
    return float(value)


_MAX_STOPS = 4


def _stop_strings(value: object) -> tuple[str, ...]:
    if value is None or value == "":
        return ()
    stops = [value] if isinstance(value, str) else value
    if (
        not isinstance(stops, list)
        or len(stops) > _MAX_STOPS
        or not all(isinstance(x, str) and x and len(x) <= 256 for x in stops)
    ):
        raise BadRequest(
            f"stop must be a string or a list of up to {_MAX_STOPS} non-empty strings "
            f"(at most 256 characters each), got {str(value)[:60]!r}"
        )
    return tuple(stops)


# A token is hardly ever longer than this many characters: a longer text cannot fit in
# the context, so it is refused before the tokenizer spends time on it.
_MAX_CHARS_PER_TOKEN = 64


def parse_prompt(
    prompt: object, tokenizer: Tokenizer, *, vocab_size: int, max_model_len: int
) -> list[int]:
    """The prompt's token ids; raises `BadRequest`. Cheap checks come before tokenizing."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        if not prompt:
            raise BadRequest("prompt is empty: expected text or a list of token ids")
        if len(prompt) > max_model_len * _MAX_CHARS_PER_TOKEN:
            raise BadRequest(
                f"prompt of {len(prompt)} characters cannot fit the model's context length "
                f"of {max_model_len} tokens"
            )
        return tokenizer.encode(prompt)
    if isinstance(prompt, list) and prompt and all(_is_int(t) for t in prompt):
        if len(prompt) > max_model_len:
            raise BadRequest(
                f"prompt of {len(prompt)} tokens exceeds the model's context length {max_model_len}"
            )
        ids = [int(t) for t in prompt]
        bad = [t for t in ids if not 0 <= t < vocab_size]
        if bad:
            raise BadRequest(f"prompt token id {bad[0]} out of range: expected 0..{vocab_size - 1}")
        return ids
    if isinstance(prompt, list) and len(prompt) > 1:
        raise BadRequest("batched prompts are not supported: send one prompt per request")
    raise BadRequest(
        f"prompt must be a non-empty string or list of token ids, got {type(prompt).__name__}"
    )


_KNOWN_FIELDS = frozenset(
    {
        "model",
        "prompt",
        "max_tokens",
        "temperature",
        "top_p",
        "seed",
        "stop",
        "stream",
        "stream_options",
        "ignore_eos",
        "return_token_ids",
        "kv_transfer_params",
        *_IGNORED_IF_DEFAULT,
    }
)


def _check_field_names(body: dict[str, Any]) -> None:
    """Refuses fields we do not know and OpenAI fields set to what we do not support."""
    for key, allowed in _IGNORED_IF_DEFAULT.items():
        if key in body and allowed and body[key] not in allowed:
            raise BadRequest(
                f"{key}={body[key]!r} is not supported by this server: expected "
                + " or ".join(repr(a) for a in allowed if a is not None)
                + " (or leave it out)"
            )
    unknown = sorted(set(body) - _KNOWN_FIELDS)
    if unknown:
        raise BadRequest(f"unknown field(s) {unknown}: expected OpenAI completion fields")


def _flag(body: dict[str, Any], key: str) -> bool:
    value = body.get(key, False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise BadRequest(f"{key} must be true or false, got {value!r}")
    return value


def _include_usage(stream_options: object) -> bool:
    if stream_options is None:
        return False
    if not isinstance(stream_options, dict):
        raise BadRequest("stream_options must be an object")
    usage_flag = stream_options.get("include_usage", False)
    if not isinstance(usage_flag, bool):
        raise BadRequest(f"stream_options.include_usage must be true or false, got {usage_flag!r}")
    return usage_flag


def parse_completion_request(
    body: object,
    tokenizer: Tokenizer,
    *,
    vocab_size: int,
    max_model_len: int,
    prompt_token_ids: list[int] | None = None,
) -> CompletionRequest:
    """Validate a `/v1/completions` body; raises `BadRequest` naming the bad field.
    `prompt_token_ids`: the prompt, already parsed by `parse_prompt`."""
    if not isinstance(body, dict):
        raise BadRequest("request body must be a JSON object")
    _check_field_names(body)
    ids = (
        prompt_token_ids
        if prompt_token_ids is not None
        else parse_prompt(
            body.get("prompt"), tokenizer, vocab_size=vocab_size, max_model_len=max_model_len
        )
    )

    max_tokens = body.get("max_tokens", 16)
    if not _is_int(max_tokens) or max_tokens < 1:
        raise BadRequest(f"max_tokens must be a positive integer, got {max_tokens!r}")
    if len(ids) + max_tokens > max_model_len:
        raise BadRequest(
            f"prompt ({len(ids)} tokens) + max_tokens ({max_tokens}) exceeds the model's "
            f"context length {max_model_len}"
        )
    temperature = _number(body, "temperature", 0.0, 0.0, 2.0)
    top_p = _number(body, "top_p", 1.0, 0.0, 1.0)
    if top_p == 0:
        raise BadRequest("top_p must be above 0 (and at most 1), got 0")
    seed = body.get("seed")
    if seed is not None and not _is_int(seed):
        raise BadRequest(f"seed must be an integer, got {seed!r}")
    stop = _stop_strings(body.get("stop"))
    flags = {key: _flag(body, key) for key in ("stream", "ignore_eos", "return_token_ids")}
    include_usage = _include_usage(body.get("stream_options"))
    kvp = body.get("kv_transfer_params")
    if kvp is not None and not isinstance(kvp, dict):
        raise BadRequest("kv_transfer_params must be an object")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise BadRequest("model must be a string")
    return CompletionRequest(
        temperature=temperature,
        top_p=top_p,
        seed=None if seed is None else int(seed),
        stop=stop,
        prompt_token_ids=ids,
        max_tokens=int(max_tokens),
        stream=flags["stream"],
        ignore_eos=flags["ignore_eos"],
        return_token_ids=flags["return_token_ids"],
        include_usage=include_usage,
        kv_transfer_params=kvp,
        model=model,
    )


_CHAT_ROLES = ("system", "user", "assistant", "tool", "developer")
# Chat fields that mean the same as a completion's; the rest are refused as usual.
_CHAT_ONLY = ("messages", "max_completion_tokens", "add_generation_prompt")


def chat_to_completion(body: dict[str, Any], chat_template: str | None) -> dict[str, Any]:
    """A `/v1/chat/completions` body as the completion body it amounts to: the messages
    rendered with the checkpoint's chat template become the prompt."""
    if chat_template is None:
        raise BadRequest(
            "this model has no chat template (no chat_template in its tokenizer_config.json): "
            "use /v1/completions"
        )
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("messages must be a non-empty list of {role, content} objects")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in _CHAT_ROLES:
            raise BadRequest(f"messages[{i}].role must be one of {', '.join(_CHAT_ROLES)}")
        if not isinstance(m.get("content"), str):
            raise BadRequest(f"messages[{i}].content must be a string")
    if "prompt" in body:
        raise BadRequest("a chat request has messages, not a prompt")
    generation_prompt = body.get("add_generation_prompt", True)
    if not isinstance(generation_prompt, bool):
        raise BadRequest("add_generation_prompt must be true or false")
    out = {k: v for k, v in body.items() if k not in _CHAT_ONLY}
    if "max_completion_tokens" in body:
        out["max_tokens"] = body["max_completion_tokens"]
    out["prompt"] = render_chat(chat_template, messages, add_generation_prompt=generation_prompt)
    return out


def render_chat(template: str, messages: list[Any], *, add_generation_prompt: bool) -> str:
    from jinja2 import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    try:
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        text = env.from_string(template).render(
            messages=messages, add_generation_prompt=add_generation_prompt
        )
    except TemplateError as exc:
        raise BadRequest(f"the chat template cannot render these messages: {exc}") from None
    if not text:
        raise BadRequest("the chat template rendered these messages as empty text")
    return text
