"""OpenAI request bytes -> a validated worker GenerateJob; worker events -> OpenAI objects.

Pure functions, no I/O: decoding (wrong JSON types become a 400 naming the field's path),
the checks msgspec types cannot express (roles, content parts, stop strings, n, token
limits, sampling ranges via worker.protocol.SamplingParams.validate), and the builders of
the response bodies and SSE chunks.
"""

from __future__ import annotations

import re
import time
import uuid
from dataclasses import dataclass
from typing import Any

import msgspec

from gateway.errors import ApiError, invalid
from gateway.schemas import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatDelta,
    ChatMessageIn,
    CompletionRequest,
    TextChoice,
    TextCompletion,
    Usage,
)
from worker.protocol import ChatMessage, Done, GenerateJob, InvalidRequestError, SamplingParams

_INT32_MAX = 2**31 - 1
MAX_STOP = 16                       # OpenAI allows 4; more costs nothing here
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's (and vLLM's) default for /v1/completions
_ROLES = {"system": "system", "developer": "system", "user": "user",
          "assistant": "assistant", "tool": "tool"}
_SAMPLING = ("temperature", "top_p", "top_k", "min_p", "seed", "repetition_penalty",
             "presence_penalty", "frequency_penalty")

_chat_decoder = msgspec.json.Decoder(ChatCompletionRequest)
_completion_decoder = msgspec.json.Decoder(CompletionRequest)
_encoder = msgspec.json.Encoder()


@dataclass(frozen=True)
class Plan:
    """What the route needs besides the job: how to answer."""

    job: GenerateJob
    chat: bool
    stream: bool
    include_usage: bool
    created: int                    # unix seconds, the same on every chunk


# ---- decoding and validation ----------------------------------------------------------

def decode_chat(body: bytes) -> ChatCompletionRequest:
    return _decode(_chat_decoder, body)


def decode_completion(body: bytes) -> CompletionRequest:
    return _decode(_completion_decoder, body)


_PATH = re.compile(r" - at `\$\.?(?P<path>[^`]*)`$")
_MISSING = re.compile(r"missing required field `(?P<field>[^`]+)`")


def _decode(decoder: msgspec.json.Decoder, body: bytes) -> Any:
    if not body.strip():
        raise invalid("the request body is empty; send a JSON object (Content-Type: application/json)")
    try:
        return decoder.decode(body)
    except msgspec.ValidationError as exc:
        text = str(exc)
        m = _PATH.search(text)
        path = m.group("path") if m else ""
        reason = text[: m.start()] if m else text
        missing = _MISSING.search(reason)
        if missing:
            field = missing.group("field")
            param = f"{path}.{field}" if path else field
            raise invalid(f"missing required field '{param}'", param=param) from None
        if not path:
            raise invalid(f"the request body must be a JSON object: {reason}") from None
        raise invalid(f"invalid type for '{path}': {reason}", param=path) from None
    except msgspec.DecodeError as exc:
        raise invalid(f"the request body is not valid JSON: {exc}") from None


def chat_plan(req: ChatCompletionRequest) -> Plan:
    if not req.messages:
        raise invalid("'messages' must contain at least one message", param="messages")
    messages = [_message(i, m) for i, m in enumerate(req.messages)]
    if req.logprobs or req.top_logprobs:
        raise invalid("logprobs are not supported yet; leave 'logprobs' unset or false",
                      param="logprobs")
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    request_id = f"chatcmpl-{uuid.uuid4().hex}"
    return _plan(req, request_id, chat=True, messages=messages, prompt=None,
                 max_tokens=max_tokens, max_tokens_param=param)


def completion_plan(req: CompletionRequest) -> Plan:
    prompt = req.prompt
    if isinstance(prompt, list):
        if len(prompt) != 1:
            raise invalid(f"'prompt' must be a string or a list of exactly one string (batches "
                          f"are not supported), got a list of {len(prompt)}", param="prompt")
        prompt = prompt[0]
    if req.echo:
        raise invalid("'echo' is not supported; leave it unset or false", param="echo")
    if req.logprobs is not None:
        raise invalid("logprobs are not supported yet; leave 'logprobs' unset", param="logprobs")
    if req.suffix:
        raise invalid("'suffix' is not supported; leave it unset", param="suffix")
    if req.best_of not in (None, 1):
        raise invalid(f"only best_of=1 is supported, got {req.best_of}", param="best_of")
    max_tokens = COMPLETIONS_DEFAULT_MAX_TOKENS if req.max_tokens is None else req.max_tokens
    request_id = f"cmpl-{uuid.uuid4().hex}"
    return _plan(req, request_id, chat=False, messages=None, prompt=prompt,
                 max_tokens=max_tokens, max_tokens_param="max_tokens")


def _message(i: int, m: ChatMessageIn) -> ChatMessage:
    role = _ROLES.get(m.role)
    if role is None:
        raise invalid(f"messages[{i}].role must be one of {', '.join(_ROLES)}, got {m.role!r}",
                      param=f"messages[{i}].role")
    content = m.content
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            if part.type != "text" or part.text is None:
                raise invalid(f"messages[{i}].content[{j}] has type {part.type!r}; only "
                              f"{{\"type\": \"text\", \"text\": ...}} parts are supported",
                              param=f"messages[{i}].content[{j}]")
            texts.append(part.text)
        content = "\n".join(texts)
    if content is None and role not in ("assistant", "tool"):
        raise invalid(f"messages[{i}].content is required for role {m.role!r}",
                      param=f"messages[{i}].content")
    return ChatMessage(role=role, content=content, name=m.name)


def _plan(req: Any, request_id: str, *, chat: bool, messages: list[ChatMessage] | None,
          prompt: str | None, max_tokens: int | None, max_tokens_param: str) -> Plan:
    if req.n not in (None, 1):
        raise invalid(f"only n=1 is supported, got n={req.n}", param="n")
    if max_tokens is not None and not 1 <= max_tokens <= _INT32_MAX:
        raise invalid(f"{max_tokens_param} must be an integer from 1 to {_INT32_MAX}, got {max_tokens}",
                      param=max_tokens_param)
    if req.top_k is not None and req.top_k > _INT32_MAX:   # msgspec ints are unbounded
        raise invalid(f"top_k must be at most {_INT32_MAX} (0 = off), got {req.top_k}", param="top_k")
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    if len(stop) > MAX_STOP:
        raise invalid(f"'stop' takes at most {MAX_STOP} strings, got {len(stop)}", param="stop")
    if any(s == "" for s in stop):
        raise invalid("stop strings must not be empty", param="stop")
    given = {k: getattr(req, k) for k in _SAMPLING if getattr(req, k) is not None}
    try:
        sampling = SamplingParams(**given).validate()
    except InvalidRequestError as exc:
        message = str(exc)
        raise invalid(message, param=message.split(" ", 1)[0]) from None
    now = time.time()
    job = GenerateJob(request_id=request_id, model=req.model, messages=messages, prompt=prompt,
                      max_tokens=max_tokens, sampling=sampling, stop=stop, created=now)
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    return Plan(job=job, chat=chat, stream=bool(req.stream), include_usage=include_usage,
                created=int(now))


def check_context(plan: Plan, n_ctx: int) -> None:
    """max_tokens alone must leave room for at least one prompt token (the worker checks
    prompt + max_tokens exactly, after tokenizing)."""
    mt = plan.job.max_tokens
    if n_ctx > 0 and mt is not None and mt >= n_ctx:
        raise ApiError(400, f"max_tokens ({mt}) must be less than the context length of model "
                            f"'{plan.job.model}' ({n_ctx} tokens, prompt included); lower it",
                       param="max_tokens", code="context_length_exceeded")


# ---- responses ------------------------------------------------------------------------

def usage(done: Done) -> Usage:
    u = done.usage
    return Usage(prompt_tokens=u.prompt_tokens, completion_tokens=u.completion_tokens,
                 total_tokens=u.prompt_tokens + u.completion_tokens)


def completion_body(plan: Plan, text: str, done: Done) -> ChatCompletion | TextCompletion:
    job = plan.job
    if plan.chat:
        return ChatCompletion(id=job.request_id, created=plan.created, model=job.model,
                              choices=[ChatChoice(index=0, message=AssistantMessage(content=text),
                                                  finish_reason=done.finish_reason)],
                              usage=usage(done))
    return TextCompletion(id=job.request_id, created=plan.created, model=job.model,
                          choices=[TextChoice(index=0, text=text, finish_reason=done.finish_reason)],
                          usage=usage(done))


class Chunks:
    """The SSE lines of one streamed completion (same id / created / model on each)."""

    def __init__(self, plan: Plan) -> None:
        self.plan = plan
        self._usage_field: Any = None if plan.include_usage else msgspec.UNSET

    def _line(self, obj: msgspec.Struct) -> bytes:
        return b"data: " + _encoder.encode(obj) + b"\n\n"

    def _chunk(self, choices: list, usage: Any) -> bytes:
        job = self.plan.job
        cls = ChatCompletionChunk if self.plan.chat else TextCompletion
        return self._line(cls(id=job.request_id, created=self.plan.created, model=job.model,
                              choices=choices, usage=usage))

    def _choice(self, *, text: str | None = None, role: bool = False,
                finish_reason: str | None = None) -> Any:
        if self.plan.chat:
            delta = ChatDelta(role="assistant" if role else msgspec.UNSET,
                              content=msgspec.UNSET if text is None else text)
            return ChatChunkChoice(index=0, delta=delta, finish_reason=finish_reason)
        return TextChoice(index=0, text=text or "", finish_reason=finish_reason)

    def first(self) -> bytes | None:
        """Chat streams open with the role (content ""); text completions have no such chunk."""
        if not self.plan.chat:
            return None
        return self._chunk([self._choice(role=True, text="")], self._usage_field)

    def text(self, text: str) -> bytes:
        return self._chunk([self._choice(text=text)], self._usage_field)

    def finish(self, done: Done) -> bytes:
        return self._chunk([self._choice(finish_reason=done.finish_reason)], self._usage_field)

    def usage(self, done: Done) -> bytes | None:
        if not self.plan.include_usage:
            return None
        return self._chunk([], usage(done))

    @staticmethod
    def done() -> bytes:
        return b"data: [DONE]\n\n"
