"""Request and response models of the OpenAI-compatible API (pydantic v2).

Requests are validated strictly (no "5" -> 5 coercion, no NaN/inf) and unknown fields are
rejected, as OpenAI does. OpenAI fields that jaxserve does not implement are parsed as `Any` and
refused with a 400 naming the field by `check_unsupported`; a few harmless ones are accepted and
ignored (IGNORED_FIELDS, listed in the README).
"""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_serializer

from jaxserve.server.errors import APIError, bad_request

# Accepted and ignored: they only label, store or route requests on OpenAI's side.
IGNORED_FIELDS = ("user", "metadata", "store", "service_tier", "parallel_tool_calls", "safety_identifier",
                  "prompt_cache_key", "prompt_cache_retention", "prompt_cache_options")


class _Req(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class _Resp(BaseModel):
    model_config = ConfigDict(extra="forbid")


# ----------------------------------------------------------------------------- requests

class StreamOptions(_Req):
    include_usage: bool | None = None
    include_obfuscation: bool | None = None  # we never add obfuscation padding: nothing to turn off


class ContentPart(BaseModel):
    # extra allowed so image/audio parts parse and get a precise "not supported" error
    model_config = ConfigDict(extra="allow", strict=True)
    type: str
    text: str | None = None


Role = Literal["system", "developer", "user", "assistant", "tool", "function"]


class ChatMessage(_Req):
    role: Role
    content: str | list[ContentPart] | None = None
    name: str | None = None
    # what the openai client sends back when an assistant reply is appended to the history
    refusal: str | None = None
    annotations: list[Any] | None = None
    audio: Any = None
    function_call: Any = None
    tool_calls: list[Any] | None = None
    tool_call_id: str | None = None


class LoraScale(_Req):
    id: int
    scale: float


class _Sampling(_Req):
    """Fields shared by chat and completions (OpenAI's plus vLLM's sampling extensions)."""

    model: str | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    max_tokens: int | None = None
    n: int | None = Field(default=None)
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    temperature: float | None = None
    top_p: float | None = None
    # vLLM / llama.cpp extensions
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    ignore_eos: bool | None = None
    skip_special_tokens: bool | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool | None = None
    structured_outputs: Any = None  # vLLM: {"json" | "json_object" | "regex" | "choice" | "grammar": ...}
    response_format: Any = None  # OpenAI (chat); vLLM accepts it on completions too
    lora: list[LoraScale] | None = None  # llama.cpp: loaded LoRA adapters by id, mixed with these scales
    # accepted and ignored (see IGNORED_FIELDS)
    user: str | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    prompt_cache_options: dict[str, Any] | None = None


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage]
    logprobs: bool | None = None
    top_logprobs: int | None = None
    max_completion_tokens: int | None = None
    add_generation_prompt: bool | None = None  # vLLM extension
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM extension: extra template variables
    parallel_tool_calls: bool | None = None  # False: at most one call per reply (the first)
    tools: Any = None  # validated by server/tools.check_tools
    tool_choice: Any = None
    # not implemented: refused unless absent/neutral (check_unsupported)
    functions: Any = None
    function_call: Any = None
    audio: Any = None
    modalities: Any = None
    prediction: Any = None
    web_search_options: Any = None
    reasoning_effort: Any = None
    verbosity: Any = None
    moderation: Any = None


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool | None = None
    logprobs: int | None = None
    best_of: int | None = None
    suffix: Any = None


class TokenizeRequest(_Req):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_generation_prompt: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None


class DetokenizeRequest(_Req):
    model: str | None = None
    tokens: list[int]


def _neutral(field: str, v: Any) -> bool:
    """Whether an unimplemented field's value asks for nothing we would have to do."""
    if v is None:
        return True
    if field == "functions":
        return v == []
    if field == "function_call":
        return v == "none"
    if field == "modalities":
        return v == ["text"]
    return False


_UNSUPPORTED_WHY = {
    "functions": "the deprecated 'functions' API is not implemented: use 'tools'",
    "function_call": "the deprecated 'function_call' is not implemented: use 'tool_choice'",
    "audio": "audio output is not supported",
    "modalities": "only the \"text\" modality is supported",
    "prediction": "predicted outputs are not implemented",
    "web_search_options": "web search is not supported",
    "reasoning_effort": "reasoning effort is not supported",
    "verbosity": "verbosity is not supported",
    "moderation": "moderation is not supported",
    "suffix": "suffix (insertion) is not implemented",
}


def check_unsupported(req: BaseModel) -> None:
    for f, why in _UNSUPPORTED_WHY.items():
        if f in type(req).model_fields and not _neutral(f, getattr(req, f)):
            raise bad_request(f"'{f}' is not supported by this server: {why}", f, "unsupported_parameter")


# ----------------------------------------------------------------------------- parsing

_TYPE_TAGS = {"str", "int", "float", "bool", "none", "list", "dict"}


def _param_from_loc(loc: tuple) -> str | None:
    parts: list[str] = []
    for x in loc:
        if isinstance(x, int):
            if parts:
                parts[-1] += f"[{x}]"
            continue
        x = str(x)
        # union members and validators show up in the location: they are not field names
        if x in _TYPE_TAGS or not x.replace("_", "").isalnum():
            continue
        parts.append(x)
    return ".".join(parts) or None


def parse_request(model: type[_Req], body: Any):
    """Validate a decoded JSON body; raise a 400 APIError naming the first bad field."""
    if not isinstance(body, dict):
        got = "null" if body is None else type(body).__name__
        raise bad_request(f"the request body must be a JSON object, got {got}")
    try:
        return model.model_validate(body)
    except ValidationError as e:
        errs = e.errors(include_url=False)
        # prefer the most specific error (union members each report one; the longest loc says most)
        err = errs[0]
        param = _param_from_loc(err["loc"])
        if err["type"] == "extra_forbidden":
            msg = f"Unrecognized request argument supplied: {param}"
            raise bad_request(msg, param, "unknown_parameter") from None
        if err["type"] == "missing":
            raise bad_request(f"'{param}' is a required property", param, "missing_parameter") from None
        msg = err["msg"]
        raise bad_request(f"invalid value for '{param}': {msg}", param, "invalid_type") from None


# ----------------------------------------------------------------------------- responses

class PromptTokensDetails(_Resp):
    cached_tokens: int = 0


class Usage(_Resp):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class TopLogprob(_Resp):
    token: str
    logprob: float
    bytes: list[int] | None


class TokenLogprob(_Resp):
    token: str
    logprob: float
    bytes: list[int] | None
    top_logprobs: list[TopLogprob]


class ChatChoiceLogprobs(_Resp):
    content: list[TokenLogprob] | None
    refusal: list[TokenLogprob] | None = None


class ChatMessageOut(_Resp):
    role: Literal["assistant"] = "assistant"
    content: str | None
    refusal: str | None = None
    tool_calls: list[dict] | None = None  # server/tools.parse; left out of the JSON when None
    reasoning_content: str | None = None  # --reasoning-parser (server/reasoning.py); left out when None

    @model_serializer(mode="wrap")
    def _omit_absent_tool_calls(self, handler):
        d = handler(self)
        for k in ("tool_calls", "reasoning_content"):
            if d.get(k) is None:
                d.pop(k, None)
        return d


class ChatChoice(_Resp):
    index: int
    message: ChatMessageOut
    logprobs: ChatChoiceLogprobs | None
    finish_reason: str | None


class ChatCompletionResponse(_Resp):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ChatDelta(_Resp):
    role: Literal["assistant"] | None = None
    content: str | None = None

    @model_serializer(mode="wrap")
    def _drop_none(self, handler):
        # a delta carries only what changed: `role` is not nullable in the spec
        return {k: v for k, v in handler(self).items() if v is not None}


class ChatChunkChoice(_Resp):
    index: int
    delta: ChatDelta
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(_Resp):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class CompletionLogprobs(_Resp):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(_Resp):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: str | None


class CompletionResponse(_Resp):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class ModelCard(_Resp):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "jaxserve"
    root: str | None = None
    parent: str | None = None  # a LoRA adapter's base model (vLLM's field)
    max_model_len: int | None = None


class ModelList(_Resp):
    object: Literal["list"] = "list"
    data: list[ModelCard]


def dump(m: BaseModel, **kw) -> dict:
    return m.model_dump(**kw)


def api_error_from_value_error(e: Exception) -> APIError:
    return bad_request(str(e), getattr(e, "param", None))
