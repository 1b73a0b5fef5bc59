"""Chat template: renders a conversation into the prompt text a model was trained on.

The template is the Jinja2 source stored in GGUF `tokenizer.chat_template` (HF's chat_template), run the
way HF transformers' apply_chat_template runs it: an ImmutableSandboxedEnvironment with trim_blocks and
lstrip_blocks, the loopcontrols extension, `raise_exception(msg)` and `strftime_now(fmt)` globals, and a
`tojson` filter that does not HTML-escape (ensure_ascii=False, optional indent/separators/sort_keys).
Templates come from model files, i.e. from strangers: the sandbox blocks attribute access to internals
(`''.__class__`, ...) and mutation of the passed data, and here any blocked access fails at once with a
clear error instead of quietly rendering nothing. A model without a template gets ChatML.

Every failure surfaces as ChatTemplateError (an InvalidRequestError): template syntax, raise_exception
from the template (e.g. "roles must alternate"), sandbox violations, and errors inside the template.
"""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any, Mapping, Sequence

import jinja2
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment, SecurityError

from worker.errors import InvalidRequestError, ModelLoadError

ROLES = ("system", "user", "assistant", "tool")
_RESERVED = ("messages", "add_generation_prompt", "tools", "bos_token", "eos_token")

# ChatML, for models whose metadata carries no template (llama.cpp uses the same fallback).
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


class ChatTemplateError(InvalidRequestError):
    """The chat template could not render this conversation (or could not be compiled)."""


class _TemplateRaised(Exception):
    """raise_exception() called by the template itself; its message is meant for the user."""


class _GenerationTag(Extension):
    """HF's `{% generation %}...{% endgeneration %}` marks assistant text for training masks; when
    rendering a prompt it is a no-op wrapper, but templates that use it must still compile."""

    tags = {"generation"}

    def parse(self, parser):
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


class _StrictSandbox(ImmutableSandboxedEnvironment):
    """The immutable sandbox, but a blocked attribute raises now rather than yielding an Undefined
    that renders as '' (which would hide an attack or a broken template)."""

    def unsafe_undefined(self, obj: Any, attribute: str):
        raise SecurityError(f"access to attribute {attribute!r} of {type(obj).__name__!r} object is unsafe")


def _raise_exception(message: str):
    raise _TemplateRaised(str(message))


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: Sequence[str] | None = None, sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent,
                      separators=tuple(separators) if separators is not None else None, sort_keys=sort_keys)


def _environment() -> jinja2.Environment:
    env = _StrictSandbox(trim_blocks=True, lstrip_blocks=True, keep_trailing_newline=False,
                         extensions=[loopcontrols, _GenerationTag])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


def _text_of(content: Any, where: str) -> str:
    """str content as is; a list of {type: text, text: ...} parts joined with newlines."""
    if isinstance(content, str):
        return content
    if isinstance(content, (list, tuple)):
        texts = []
        for k, part in enumerate(content):
            if not isinstance(part, Mapping) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                kind = part.get("type") if isinstance(part, Mapping) else type(part).__name__
                raise InvalidRequestError(f"{where}: content part {k} is {kind!r}; only "
                                          f"{{'type': 'text', 'text': str}} parts are supported")
            texts.append(part["text"])
        return "\n".join(texts)
    raise InvalidRequestError(f"{where}: content must be a string or a list of text parts, "
                              f"got {type(content).__name__}")


def normalize_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Validated copies of the messages with text content; other keys (tool_calls, name,
    tool_call_id, ...) pass through for templates that use them."""
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence) or not messages:
        raise InvalidRequestError("messages must be a non-empty list of {role, content} objects")
    out = []
    for k, message in enumerate(messages):
        where = f"messages[{k}]"
        if not isinstance(message, Mapping):
            raise InvalidRequestError(f"{where} must be an object with 'role' and 'content', "
                                      f"got {type(message).__name__}")
        role = message.get("role")
        if role not in ROLES:
            raise InvalidRequestError(f"{where}: role {role!r} is not supported; use one of {', '.join(ROLES)}")
        msg = dict(message)
        content = message.get("content")
        if content is None and role == "assistant":
            msg["content"] = ""            # an assistant turn that only calls tools
        elif content is None:
            raise InvalidRequestError(f"{where}: a {role} message needs 'content'")
        else:
            msg["content"] = _text_of(content, where)
        out.append(msg)
    return out


class ChatTemplate:
    """A compiled chat template; render(messages) -> prompt text."""

    def __init__(self, template: str, *, bos_token: str, eos_token: str):
        if not isinstance(template, str) or not template.strip():
            raise ChatTemplateError("chat template is empty")
        self.source = template
        self.bos_token = bos_token
        self.eos_token = eos_token
        try:
            self._template = _environment().from_string(template)
        except jinja2.TemplateSyntaxError as e:
            raise ChatTemplateError(f"chat template does not compile: line {e.lineno}: {e.message}") from e

    @classmethod
    def from_metadata(cls, meta: Mapping[str, Any], tokenizer) -> "ChatTemplate":
        """The GGUF's tokenizer.chat_template (ChatML when absent); bos/eos texts from the tokenizer."""
        def text(token_id):
            return "" if token_id is None else tokenizer.token_bytes(token_id).decode("utf-8", "replace")

        template = meta.get("tokenizer.chat_template") or CHATML_TEMPLATE
        try:
            return cls(template, bos_token=text(tokenizer.bos_id), eos_token=text(tokenizer.eos_id))
        except ChatTemplateError as e:
            raise ModelLoadError(f"GGUF tokenizer.chat_template is unusable: {e}") from e

    def render(self, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = True,
               tools: Sequence[Mapping[str, Any]] | None = None, **extra: Any) -> str:
        """Prompt text for `messages` (validated, content parts joined); `extra` reaches the template
        as variables (e.g. enable_thinking=False)."""
        clash = sorted(set(extra) & set(_RESERVED))
        if clash:
            raise InvalidRequestError(f"template variables {clash} are set by render() itself")
        context = dict(extra, messages=normalize_messages(messages), add_generation_prompt=add_generation_prompt,
                       tools=list(tools) if tools is not None else None,
                       bos_token=self.bos_token, eos_token=self.eos_token)
        try:
            return self._template.render(**context)
        except _TemplateRaised as e:
            raise ChatTemplateError(f"the model's chat template rejected the conversation: {e}") from None
        except SecurityError as e:
            raise ChatTemplateError(f"chat template blocked by the sandbox: {e}") from None
        except jinja2.TemplateError as e:
            raise ChatTemplateError(f"chat template failed: {type(e).__name__}: {e}") from None
        except Exception as e:  # noqa: BLE001 - any error inside template code is a template failure
            raise ChatTemplateError(f"chat template failed: {type(e).__name__}: {e}") from None
