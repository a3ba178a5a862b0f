"""Request bodies of the OpenAI-compatible API, checked field by field, and OpenAI's error bodies.

:func:`parse_json` reads a body (UTF-8 JSON, bounded nesting, valid Unicode); every body is then a
JSON object checked by hand (no schema library): each rejection is an
:class:`APIError` whose message names the field, the value received, what was expected and the
fix, and whose ``param`` is the field, as OpenAI's own errors do. Unknown fields are rejected with
the closest known name (a misspelled ``max_token`` must not silently fall back to the default);
OpenAI fields this server does not implement are accepted only at their "off" value, and any other
value is a 400 that names the field and the feature it asks for.
"""
from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from corekv.config.values import describe_value, did_you_mean
from corekv.hashing import check_cache_salt
from corekv.engine.sampling import MAX_LOGPROBS, SamplingParams

__all__ = ["APIError", "GenerateRequest", "error_body", "parse_json", "parse_completion",
           "parse_chat", "parse_prefix", "DEFAULT_MAX_TOKENS", "DEFAULT_CHAT_MAX_TOKENS",
           "MAX_JSON_DEPTH", "MAX_NUM_PROMPTS"]

DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
DEFAULT_CHAT_MAX_TOKENS = 256  # chat has no OpenAI default short of the context; a bounded one
#: prompts one /v1/completions request may batch (each is one engine request; more: send several)
MAX_NUM_PROMPTS = 1024
_SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "seed", "stop", "n", "ignore_eos",
                    "stop_token_ids", "include_stop_str_in_output", "skip_special_tokens",
                    "presence_penalty", "frequency_penalty", "repetition_penalty", "min_tokens")
_COMMON_FIELDS = ("model", "max_tokens", "stream", "stream_options", "cache_salt", "user",
                  "logit_bias", *_SAMPLING_FIELDS)
_COMPLETION_FIELDS = ("prompt", "echo", "logprobs", *_COMMON_FIELDS)
_CHAT_FIELDS = ("messages", "max_completion_tokens", "logprobs", "top_logprobs", *_COMMON_FIELDS)
#: OpenAI fields this server does not implement: accepted only at these "off" values; any other
#: value is a 400 naming the field and the feature (field: (off values, feature))
_COMPLETION_UNSUPPORTED = {
    "best_of": ((None, 1), "best_of (server-side ranking of several completions; use n)"),
    "suffix": ((None, ""), "suffix (text insertion after the completion)"),
}
_TOOLS = "tool and function calling"
_CHAT_UNSUPPORTED = {
    "tools": ((None, []), _TOOLS),
    "tool_choice": ((None, "none"), _TOOLS),
    "parallel_tool_calls": ((None, True, False), _TOOLS),
    "functions": ((None, []), _TOOLS),
    "function_call": ((None, "none"), _TOOLS),
    "response_format": ((None, {"type": "text"}), "structured outputs (JSON mode, json_schema)"),
    "audio": ((None,), "audio output"),
    "modalities": ((None, ["text"]), "output modalities other than text"),
    "prediction": ((None,), "predicted outputs"),
    "web_search_options": ((None,), "web search"),
    "reasoning_effort": ((None,), "reasoning effort"),
    "store": ((None, False), "stored completions"),
    "metadata": ((None, {}), "stored completions' metadata"),
    "service_tier": ((None, "auto", "default"), "service tiers"),
}
#: nesting a body may have: any body this API accepts needs 4 (chat content parts), and values
#: well below Python's recursion limit keep code that recurses over them (repr, in error
#: messages) from overflowing
MAX_JSON_DEPTH = 32
_TOO_DEEP = (f"the request body is nested more than {MAX_JSON_DEPTH} levels deep; no field of this "
             "API needs that, send a flatter JSON object")
# NOTE: a lone surrogate can only come from a \u escape (UTF-8 cannot encode one); this finds
# every candidate cheaply, and the strings are checked only when it finds one.
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")
_SURROGATE = re.compile("[\ud800-\udfff]")


class APIError(Exception):
    """An error the API reports as ``{"error": {...}}`` with HTTP ``status``."""

    def __init__(self, message: str, *, status: int = 400, param: str | None = None,
                 type: str = "invalid_request_error", code: str | None = None):
        super().__init__(message)
        self.status, self.param, self.type, self.code = status, param, type, code

    def body(self) -> dict[str, Any]:
        return error_body(str(self), type=self.type, param=self.param, code=self.code)


def error_body(message: str, *, type: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    """OpenAI's error body: ``{"error": {"message", "type", "param", "code"}}``."""
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def parse_json(body: bytes) -> Any:
    """A request body as JSON (RFC 8259): UTF-8, no ``NaN``/``Infinity``, nested at most
    :data:`MAX_JSON_DEPTH` deep, strings valid Unicode (no lone surrogates, which no tokenizer
    or UTF-8 encoder takes); anything else is a 400."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as e:
        raise APIError(f"the request body is not valid JSON: byte {e.start} is not UTF-8 ({e.reason}); "
                       "send a UTF-8 JSON object with Content-Type: application/json") from None
    try:
        value = json.loads(text, parse_constant=_refuse_constant)
    except RecursionError:  # NOTE: the decoder recurses per level; a deep body exhausts the stack
        raise APIError(_TOO_DEEP) from None
    except ValueError as e:  # JSONDecodeError, NaN/Infinity, an integer past Python's digit limit
        raise APIError(f"the request body is not valid JSON ({e}); send a JSON object with "
                       "Content-Type: application/json") from None
    _check_tree(value, has_surrogates=_SURROGATE_ESCAPE.search(body) is not None)
    return value


@dataclass(frozen=True)
class GenerateRequest:
    """A checked completion or chat request: what the engine needs, plus how to answer.

    ``prompts`` holds one prompt per engine request, each a str, token ids, or chat messages (the
    engine renders those with the chat template and the assistant prompt): chat has one, a
    completions batch one per prompt (choice ``i * n + j`` is completion ``j`` of prompt ``i``).
    ``model`` is None when the body named none; ``echo`` prepends each prompt's text to its
    choices (completions only).
    """

    prompts: tuple[Any, ...]
    params: SamplingParams
    cache_salt: str | None
    model: str | None
    stream: bool
    include_usage: bool
    echo: bool = False

    @property
    def prompt(self) -> Any:
        """The first (for chat, the only) prompt."""
        return self.prompts[0]


def parse_completion(body: Any) -> GenerateRequest:
    """A ``POST /v1/completions`` body: ``prompt`` is a str, a list of token ids, or a batch (a
    list of strings or a list of token-id lists); ``logprobs`` is an integer (the top tokens per
    token, OpenAI's legacy shape)."""
    body = _object(body)
    _check_fields(body, _COMPLETION_FIELDS, _COMPLETION_UNSUPPORTED)
    prompts = _completion_prompts(body.get("prompt"))
    echo = _bool(body, "echo")
    logprobs = body.get("logprobs")
    if logprobs is False:  # NOTE: some clients send the chat API's boolean "off"
        logprobs = None
    if logprobs is not None and (not _is_count(logprobs) or logprobs > MAX_LOGPROBS):
        raise APIError(f"logprobs must be null or an integer in [0, {MAX_LOGPROBS}] (the most likely "
                       f"tokens to list per generated token), got {describe_value(logprobs)}",
                       param="logprobs")
    if echo and logprobs is not None:
        raise APIError("echo with logprobs asks for the prompt's log-probabilities, which this server "
                       "does not compute (the engine keeps the logits of the last prompt token only, "
                       "and reuses cached prefixes without computing them); send echo or logprobs, "
                       "not both", param="echo")
    request = _generate_request(body, prompts, body.get("max_tokens"), DEFAULT_MAX_TOKENS,
                                logprobs=logprobs)
    return dataclasses.replace(request, echo=echo)


def parse_chat(body: Any) -> GenerateRequest:
    """A ``POST /v1/chat/completions`` body: ``messages`` with text content; ``logprobs: true``
    with ``top_logprobs: k`` asks for log-probabilities (OpenAI's chat shape)."""
    body = _object(body)
    _check_fields(body, _CHAT_FIELDS, _CHAT_UNSUPPORTED)
    messages = parse_messages(body.get("messages"))
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    wants_logprobs = _bool(body, "logprobs")
    top = body.get("top_logprobs")
    if top is not None and (not _is_count(top) or top > MAX_LOGPROBS):
        raise APIError(f"top_logprobs must be null or an integer in [0, {MAX_LOGPROBS}], got "
                       f"{describe_value(top)}", param="top_logprobs")
    if top and not wants_logprobs:
        raise APIError(f"top_logprobs={top} needs logprobs: true; send both, or leave top_logprobs out",
                       param="top_logprobs")
    return _generate_request(body, (messages,), max_tokens, DEFAULT_CHAT_MAX_TOKENS,
                             logprobs=(top or 0) if wants_logprobs else None)


def parse_prefix(body: Any, *, with_pin: bool) -> tuple[Any, str | None, bool]:
    """An ``/admin/warm`` (``with_pin``) or ``/admin/unpin`` body: ``(prompt, cache_salt, pin)``
    where prompt is a str, token ids, or chat messages (rendered without the assistant prompt)."""
    body = _object(body)
    _check_fields(body, ("prompt", "messages", "cache_salt", *(("pin",) if with_pin else ())))
    if ("prompt" in body) == ("messages" in body):
        raise APIError("pass exactly one of prompt (a string) or messages (chat messages), got "
                       f"{sorted(k for k in ('prompt', 'messages') if k in body) or 'neither'}",
                       param="prompt")
    if "messages" in body:
        prompt = parse_messages(body["messages"])
    else:
        prompt = body["prompt"]
        if not (isinstance(prompt, str) and prompt) and not _is_token_ids(prompt):
            raise APIError(f"prompt must be a non-empty string or list of token ids, got "
                           f"{describe_value(prompt)}", param="prompt")
    pin = body.get("pin", True)
    if not isinstance(pin, bool):
        raise APIError(f"pin must be true or false, got {describe_value(pin)}", param="pin")
    return prompt, _salt(body), pin


def parse_messages(messages: Any) -> list[dict[str, str]]:
    """Chat messages as the engine takes them: ``[{"role": str, "content": str}]``; content may
    also be OpenAI's list of ``{"type": "text", "text": ...}`` parts (joined)."""
    if not isinstance(messages, list) or not messages:
        raise APIError(f"messages must be a non-empty list of {{'role', 'content'}} objects, got "
                       f"{describe_value(messages)}", param="messages")
    checked = []
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping) or not isinstance(message.get("role"), str):
            raise APIError(f"messages[{i}] must be an object with a string role, got "
                           f"{describe_value(message)}", param=f"messages[{i}]")
        if message["role"] in ("tool", "function"):
            raise APIError(f"messages[{i}].role={message['role']!r}: {_TOOLS} is not supported by this "
                           "server; send system, user and assistant messages", param=f"messages[{i}].role")
        for key in ("tool_calls", "function_call"):
            if message.get(key):
                raise APIError(f"messages[{i}].{key}: {_TOOLS} is not supported by this server; send "
                               "the assistant's text as content", param=f"messages[{i}].{key}")
        content = message.get("content")
        if isinstance(content, list):
            if not all(isinstance(p, Mapping) and p.get("type") == "text"
                       and isinstance(p.get("text"), str) for p in content):
                raise APIError(f"messages[{i}].content: only text parts "
                               f"({{'type': 'text', 'text': ...}}) are supported, got {describe_value(content)}",
                               param=f"messages[{i}].content")
            content = "".join(p["text"] for p in content)
        if not isinstance(content, str):
            raise APIError(f"messages[{i}].content must be a string or a list of text parts, got "
                           f"{describe_value(content)}", param=f"messages[{i}].content")
        checked.append({"role": message["role"], "content": content})
    return checked


# -- helpers ---------------------------------------------------------------------------------
def _generate_request(body: Mapping, prompts: Any, max_tokens: Any, default_max_tokens: int, *,
                      logprobs: int | None) -> GenerateRequest:
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise APIError(f"model must be a string, got {describe_value(model)}; see GET /v1/models",
                       param="model")
    stream = _bool(body, "stream")
    options = body.get("stream_options")
    if options is not None and not stream:
        raise APIError("stream_options applies to streamed answers only; send stream: true with it, "
                       "or leave it out", param="stream_options")
    options = options or {}
    if not isinstance(options, Mapping) or set(options) - {"include_usage"}:
        raise APIError(f"stream_options must be {{'include_usage': bool}}, got {describe_value(options)}",
                       param="stream_options")
    include_usage = options.get("include_usage", False)
    if not isinstance(include_usage, bool):
        raise APIError(f"stream_options.include_usage must be true or false, got "
                       f"{describe_value(include_usage)}", param="stream_options")
    fields = {k: body[k] for k in _SAMPLING_FIELDS if body.get(k) is not None}
    fields["max_tokens"] = default_max_tokens if max_tokens is None else max_tokens
    if body.get("logit_bias") is not None:
        fields["logit_bias"] = _logit_bias(body["logit_bias"])
    if logprobs is not None:
        fields["logprobs"] = logprobs
    try:
        params = SamplingParams(**fields)
    except (TypeError, ValueError) as e:
        # NOTE: a SamplingParams field is also the body's name
        raise APIError(str(e), param=getattr(e, "field", None)) from e
    return GenerateRequest(tuple(prompts), params, _salt(body), model, stream, include_usage)


def _completion_prompts(prompt: Any) -> list[Any]:
    """The prompts of a completions body: a str, a list of token ids, a list of strings, or a list
    of token-id lists (OpenAI's four shapes)."""
    shapes = ("a non-empty string, a list of token ids, or a batch of up to "
              f"{MAX_NUM_PROMPTS} prompts (a list of strings or a list of token-id lists)")
    if (isinstance(prompt, str) and prompt) or _is_token_ids(prompt):
        return [prompt]
    if not isinstance(prompt, list) or not prompt:
        raise APIError(f"prompt must be {shapes}, got {describe_value(prompt)}", param="prompt")
    if len(prompt) > MAX_NUM_PROMPTS:
        raise APIError(f"prompt is a batch of {len(prompt)} prompts, more than {MAX_NUM_PROMPTS}; "
                       "send the rest in further requests", param="prompt")
    kind = str if isinstance(prompt[0], str) else list
    for i, item in enumerate(prompt):
        if kind is str and not (isinstance(item, str) and item):
            raise APIError(f"prompt[{i}] must be a non-empty string like the batch's first prompt, got "
                           f"{describe_value(item)}", param="prompt")
        if kind is list and not _is_token_ids(item):
            raise APIError(f"prompt[{i}] must be a non-empty list of token ids (integers >= 0) in a "
                           f"batch of token-id lists, got {describe_value(item)}; prompt must be "
                           f"{shapes}", param="prompt")
    return list(prompt)


def _logit_bias(bias: Any) -> dict[int, Any]:
    """OpenAI's ``logit_bias`` (token ids as JSON's string keys) with integer keys; the values are
    checked by :class:`SamplingParams`."""
    if not isinstance(bias, Mapping):
        raise APIError(f"logit_bias must be an object mapping token ids to biases in [-100, 100], got "
                       f"{describe_value(bias)}; send e.g. {{\"50256\": -100}}", param="logit_bias")
    converted = {}
    for key, value in bias.items():
        if not (isinstance(key, str) and key.isdecimal() and key.isascii()):
            raise APIError(f"logit_bias keys must be token ids (decimal integers >= 0), got "
                           f"{describe_value(key)}; send e.g. {{\"50256\": -100}}", param="logit_bias")
        converted[int(key)] = value
    return converted


def _bool(body: Mapping, name: str) -> bool:
    """An optional boolean field (null or absent: false)."""
    value = body.get(name)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise APIError(f"{name} must be true or false, got {describe_value(value)}", param=name)
    return value


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _object(body: Any) -> Mapping:
    if not isinstance(body, Mapping):
        raise APIError(f"the request body must be a JSON object, got {describe_value(body)}")
    return body


def _check_fields(body: Mapping, known: tuple[str, ...],
                  unsupported: Mapping[str, tuple[tuple, str]] | None = None) -> None:
    unsupported = unsupported or {}
    for key, value in body.items():
        if key in known:
            continue
        if key in unsupported:
            off_values, feature = unsupported[key]
            # NOTE: by type too: True == 1 and 0 == False, but best_of=true is no "off"
            if not any(type(value) is type(off) and value == off for off in off_values):
                raise APIError(f"{key}={describe_value(value)}: {feature} is not supported by this "
                               f"server; leave {key} out (or send {off_values[-1]!r})", param=key)
            continue
        raise APIError(f"unknown field {key!r}{did_you_mean(str(key), known)} (known fields: "
                       f"{', '.join(known)})", param=key)


def _salt(body: Mapping) -> str | None:
    try:
        return check_cache_salt(body.get("cache_salt"), allow_empty=False)
    except TypeError as e:
        raise APIError(str(e), param="cache_salt") from None


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number (RFC 8259)")


def _check_tree(value: Any, *, has_surrogates: bool) -> None:
    """Walk the containers (iteratively: the walk itself must not recurse) for their depth and,
    when ``has_surrogates``, their strings for lone surrogates."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            children = [*item.keys(), *item.values()]
        elif isinstance(item, list):
            children = item
        else:
            children = (item,) if depth == 1 else ()
        if depth > MAX_JSON_DEPTH:
            raise APIError(_TOO_DEEP)
        for child in children:
            if isinstance(child, (dict, list)):
                stack.append((child, depth + 1))
            elif has_surrogates and isinstance(child, str) and _SURROGATE.search(child):
                raise APIError(f"the request body has a string with a lone UTF-16 surrogate "
                               f"({describe_value(child)}); send valid Unicode text (escape a "
                               "character outside the BMP as a surrogate pair)")


def _is_token_ids(value: Any) -> bool:
    return (isinstance(value, list) and bool(value)
            and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in value))
