"""worker/chat_template.py: the demo model's template, HF-compatible rendering, sandbox, validation."""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

import gguf
import pytest

from worker.chat_template import CHATML_TEMPLATE, ChatTemplate, ChatTemplateError
from worker.errors import InvalidRequestError, ModelLoadError, SpecdError
from worker.tokenizer import Tokenizer

DATA = Path(__file__).resolve().parents[2] / "tests/data/llamacpp_tokens.json"
SMOL_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"


@pytest.fixture(scope="module")
def demo_meta(demo_model_path) -> dict:
    reader = gguf.GGUFReader(str(demo_model_path))
    return {k: f.contents() for k, f in reader.fields.items()}


@pytest.fixture(scope="module")
def tok(demo_meta) -> Tokenizer:
    return Tokenizer.from_metadata(demo_meta)


@pytest.fixture(scope="module")
def smol(demo_meta, tok) -> ChatTemplate:
    return ChatTemplate.from_metadata(demo_meta, tok)


def plain(template: str) -> ChatTemplate:
    return ChatTemplate(template, bos_token="<s>", eos_token="</s>")


USER = [{"role": "user", "content": "Hi there"}]


def test_demo_system_and_user(smol):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"}]
    assert smol.render(messages) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nWhat is 2+2?<|im_end|>\n"
        "<|im_start|>assistant\n")


def test_demo_user_only_gets_default_system_prompt(smol):
    assert smol.render(USER) == (
        f"<|im_start|>system\n{SMOL_SYSTEM}<|im_end|>\n"
        "<|im_start|>user\nHi there<|im_end|>\n"
        "<|im_start|>assistant\n")


def test_generation_prompt_flag_and_multi_turn(smol):
    messages = USER + [{"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Bye"}]
    without = smol.render(messages, add_generation_prompt=False)
    assert without.endswith("<|im_start|>assistant\nHello!<|im_end|>\n<|im_start|>user\nBye<|im_end|>\n")
    assert smol.render(messages) == without + "<|im_start|>assistant\n"


def test_rendered_prompt_tokenizes_to_chatml_specials(smol, tok):
    ids = tok.encode(smol.render(USER), parse_special=True)
    assert ids.count(1) == 3 and ids.count(2) == 2          # <|im_start|> x3, <|im_end|> x2
    tail = tok.encode("assistant\n")
    assert ids[0] == 1 and ids[-len(tail) - 1:] == [1] + tail


def test_bos_eos_and_fallback(demo_meta, tok):
    t = ChatTemplate.from_metadata({**demo_meta, "tokenizer.chat_template": "{{ bos_token }}|{{ eos_token }}"}, tok)
    assert t.render(USER) == "<|im_start|>|<|im_end|>"
    fallback = ChatTemplate.from_metadata({}, tok)           # no template in the metadata: ChatML
    assert fallback.source == CHATML_TEMPLATE
    assert fallback.render(USER) == "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n"


def test_spm_bos_text():
    spm = Tokenizer.from_metadata(json.loads(DATA.read_text(encoding="utf-8"))["spm"]["metadata"])
    t = ChatTemplate.from_metadata({"tokenizer.chat_template": "{{ bos_token }}{{ messages[0].content }}{{ eos_token }}"}, spm)
    assert t.render(USER) == "<s>Hi there</s>"


def test_content_parts_are_joined(smol):
    parts = [{"type": "text", "text": "line one"}, {"type": "text", "text": "line two"}]
    assert "<|im_start|>user\nline one\nline two<|im_end|>" in smol.render([{"role": "user", "content": parts}])


@pytest.mark.parametrize("messages,match", [
    ([], "non-empty list"),
    ("hello", "non-empty list"),
    ([{"role": "robot", "content": "x"}], "role 'robot' is not supported; use one of system, user, assistant, tool"),
    ([{"content": "x"}], "role None"),
    (["just a string"], r"messages\[0\] must be an object"),
    ([{"role": "user"}], "needs 'content'"),
    ([{"role": "user", "content": 42}], "content must be a string or a list of text parts"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
     "content part 0 is 'image_url'"),
])
def test_message_validation(smol, messages, match):
    with pytest.raises(InvalidRequestError, match=match):
        smol.render(messages)


def test_assistant_tool_call_without_content_and_extra_keys_pass_through():
    t = plain("{% for m in messages %}[{{ m.role }}:{{ m.content }}:{{ m.tool_calls | tojson if m.tool_calls else '' }}"
              "{{ m.tool_call_id or '' }}]{% endfor %}")
    calls = [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]
    out = t.render([{"role": "user", "content": "go"}, {"role": "assistant", "content": None, "tool_calls": calls},
                    {"role": "tool", "content": "42", "tool_call_id": "c1"}])
    assert out == f'[user:go:][assistant::{json.dumps(calls)}][tool:42:c1]'


def test_sandbox_blocks_internals():
    with pytest.raises(ChatTemplateError, match="sandbox.*'__class__'.*unsafe"):
        plain("{{ ''.__class__.__mro__ }}").render(USER)
    with pytest.raises(ChatTemplateError, match="sandbox"):
        plain("{{ messages.append(1) }}").render(USER)              # immutable: no mutation of inputs
    with pytest.raises(ChatTemplateError, match="sandbox"):
        plain("{{ raise_exception.__globals__ }}").render(USER)


def test_raise_exception_and_other_failures():
    t = plain("{% if messages[0].role != 'system' %}{{ raise_exception('Conversation must start with system') }}{% endif %}")
    with pytest.raises(ChatTemplateError, match="rejected the conversation: Conversation must start with system"):
        t.render(USER)
    with pytest.raises(ChatTemplateError, match="TypeError"):
        plain("{{ messages[0].content + 1 }}").render(USER)
    with pytest.raises(ChatTemplateError, match="does not compile: line 2"):
        plain("ok\n{% for %}")
    assert issubclass(ChatTemplateError, InvalidRequestError) and issubclass(ChatTemplateError, SpecdError)


def test_bad_template_in_metadata_is_a_load_error(demo_meta, tok):
    with pytest.raises(ModelLoadError, match="chat_template is unusable.*does not compile"):
        ChatTemplate.from_metadata({**demo_meta, "tokenizer.chat_template": "{% if %}"}, tok)


def test_hf_features():
    # tojson: no HTML escaping, non-ASCII kept, indent; loopcontrols; {% generation %}; whitespace control
    t = plain("{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}"
              "{% generation %}{{ m.content | tojson }}{% endgeneration %}{% endfor %}"
              "{{ tools | tojson(indent=1) }}")
    out = t.render([{"role": "user", "content": "<é & \"x\">"}, {"role": "user", "content": "never"}],
                   tools=[{"a": 1}])
    assert out == '"<é & \\"x\\">"[\n {\n  "a": 1\n }\n]'
    # trim_blocks + lstrip_blocks: block tags leave no blank lines or indentation; trailing newline dropped
    t = plain("{% for m in messages %}\n    {% if true %}\n{{ m.content }}\n    {% endif %}\n{% endfor %}\n")
    assert t.render(USER) == "Hi there\n"


def test_strftime_and_extra_variables():
    before = datetime.now().strftime("%Y-%m-%d")
    out = plain("{{ strftime_now('%Y-%m-%d') }}|{{ enable_thinking }}|{{ tools is none }}").render(
        USER, enable_thinking=False)
    after = datetime.now().strftime("%Y-%m-%d")
    assert out in (f"{before}|False|True", f"{after}|False|True")
    with pytest.raises(InvalidRequestError, match="set by render"):
        plain("x").render(USER, bos_token="no")
