"""The OpenAI HTTP shapes as msgspec Structs: requests in, completions / chunks / errors out.

Requests ignore unknown fields (clients send many) and keep every field optional that
OpenAI keeps optional; None means "not given" so the worker's defaults apply. Range
checks and the translation into a worker job live in gateway/translate.py, so decoding
only checks JSON types (a wrong type is a 400 naming the field's path).

Responses mirror OpenAI's field order. Fields set to UNSET are left out of the JSON
(a chunk's `usage` exists only when stream_options.include_usage is set; an empty delta
is `{}`).
"""

from __future__ import annotations

from typing import Literal

import msgspec
from msgspec import UNSET, UnsetType

# ---- requests -------------------------------------------------------------------------


class ContentPart(msgspec.Struct, kw_only=True):
    type: str                                   # only "text" is supported
    text: str | None = None


class ChatMessageIn(msgspec.Struct, kw_only=True):
    role: str                                   # system | developer | user | assistant | tool
    content: str | list[ContentPart] | None = None
    name: str | None = None


class StreamOptions(msgspec.Struct, kw_only=True):
    include_usage: bool | None = None


class _SamplingFields(msgspec.Struct, kw_only=True):
    """Fields shared by both endpoints (OpenAI's plus top_k / min_p / repetition_penalty)."""

    model: str
    max_tokens: int | None = None
    temperature: float | None = None            # 0..2; 0 = greedy
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None         # up to 16 strings
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    user: str | None = None
    n: int | None = None                        # only 1 is supported


class ChatCompletionRequest(_SamplingFields, kw_only=True):
    """POST /v1/chat/completions."""

    messages: list[ChatMessageIn]
    max_completion_tokens: int | None = None    # OpenAI's newer name for max_tokens
    logprobs: bool | None = None                # not supported yet: true -> 400
    top_logprobs: int | None = None


class CompletionRequest(_SamplingFields, kw_only=True):
    """POST /v1/completions (max_tokens defaults to 16, as OpenAI's)."""

    prompt: str | list[str]                     # a string or a list of exactly one string
    echo: bool | None = None                    # not supported: true -> 400
    logprobs: int | None = None                 # not supported: any value -> 400
    suffix: str | None = None                   # not supported: any value -> 400
    best_of: int | None = None                  # only 1


# ---- responses ------------------------------------------------------------------------

FinishReason = str  # "stop" | "length" (whatever the worker's Done says)


class Usage(msgspec.Struct, kw_only=True):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class AssistantMessage(msgspec.Struct, kw_only=True):
    role: Literal["assistant"] = "assistant"
    content: str = ""


class ChatChoice(msgspec.Struct, kw_only=True):
    index: int
    message: AssistantMessage
    logprobs: None = None
    finish_reason: FinishReason


class ChatCompletion(msgspec.Struct, kw_only=True):
    id: str                                     # chatcmpl-...
    object: Literal["chat.completion"] = "chat.completion"
    created: int                                # unix seconds
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ChatDelta(msgspec.Struct, kw_only=True):
    role: Literal["assistant"] | UnsetType = UNSET
    content: str | UnsetType = UNSET


class ChatChunkChoice(msgspec.Struct, kw_only=True):
    index: int
    delta: ChatDelta
    logprobs: None = None
    finish_reason: FinishReason | None = None


class ChatCompletionChunk(msgspec.Struct, kw_only=True):
    """One SSE `data:` line of a streamed chat completion."""

    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None | UnsetType = UNSET     # only with include_usage: null, then the totals


class TextChoice(msgspec.Struct, kw_only=True):
    index: int
    text: str
    logprobs: None = None
    finish_reason: FinishReason | None = None


class TextCompletion(msgspec.Struct, kw_only=True):
    """POST /v1/completions: the whole completion, or (stream=true) one SSE chunk."""

    id: str                                     # cmpl-...
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[TextChoice]
    usage: Usage | None | UnsetType = UNSET


class ModelCard(msgspec.Struct, kw_only=True):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "specd"


class ModelList(msgspec.Struct, kw_only=True):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorBody(msgspec.Struct, kw_only=True):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(msgspec.Struct, kw_only=True):
    error: ErrorBody


class Health(msgspec.Struct, kw_only=True):
    status: str                                 # ok | ready | unavailable
    reason: str | None = None
    workers: int | None = None
    models: list[str] | None = None
