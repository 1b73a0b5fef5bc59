"""worker/detokenizer.py: streamed text equals tokenizer.decode, and no partial UTF-8 ever leaks out.

"No partial UTF-8" is checked as: after every push the text so far is a prefix of the final text (so a
delta is never a U+FFFD that a later byte would have turned into a real character), and every delta is a
str (a broken sequence cannot be represented otherwise).
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import gguf
import pytest

from worker.detokenizer import IncrementalDetokenizer
from worker.errors import InvalidRequestError
from worker.tokenizer import Tokenizer

DATA = Path(__file__).resolve().parents[2] / "tests/data/llamacpp_tokens.json"


@pytest.fixture(scope="module")
def strings() -> list[str]:
    data = json.loads(DATA.read_text(encoding="utf-8"))
    return data["bpe"]["strings"] + ["🧑🏽‍🚀 " * 20, "日本語 " * 50, "e\u0301" * 30 + "\U0001F600" * 10]


@pytest.fixture(scope="module")
def tok(demo_model_path) -> Tokenizer:
    reader = gguf.GGUFReader(str(demo_model_path))
    return Tokenizer.from_metadata({k: f.contents() for k, f in reader.fields.items()})


@pytest.fixture(scope="module")
def spm_tok() -> Tokenizer:
    return Tokenizer.from_metadata(json.loads(DATA.read_text(encoding="utf-8"))["spm"]["metadata"])


def stream(tok: Tokenizer, ids: list[int], chunks: list[int], **kwargs) -> list[str]:
    """Push ids in the given chunk sizes; returns the deltas (flush last). Checks the prefix property."""
    detok = IncrementalDetokenizer(tok, **kwargs)
    final = tok.decode(ids, skip_special=kwargs.get("skip_special", True))
    deltas, pos, so_far = [], 0, ""
    for n in chunks:
        delta = detok.push(ids[pos:pos + n])
        pos += n
        assert isinstance(delta, str)
        so_far += delta
        assert final.startswith(so_far), (ids, so_far, final)
        deltas.append(delta)
    assert pos >= len(ids)
    deltas.append(detok.flush())
    assert "".join(deltas) == final
    return deltas


def random_chunks(rng: random.Random, n: int) -> list[int]:
    sizes = []
    while sum(sizes) < n:
        sizes.append(rng.choice([1, 1, 2, 3, 5, 8, 13]))
    return sizes


def test_token_by_token_equals_decode(tok, strings):
    split_inside_a_char = 0
    for s in strings:
        ids = tok.encode(s, parse_special=True)
        deltas = stream(tok, ids, [1] * len(ids), skip_special=False)
        assert "".join(deltas) == s
        # a token that ends inside a multi-byte char must yield nothing until the char completes
        for k, i in enumerate(ids):
            b = tok.token_bytes(i)
            try:
                b.decode("utf-8")
            except UnicodeDecodeError:
                split_inside_a_char += 1
                assert "\ufffd" not in deltas[k]
    assert split_inside_a_char > 20      # the strings really exercise held-back tails


def test_random_chunks(tok, strings):
    seed = random.randrange(2**32)
    print(f"seed={seed}")
    rng = random.Random(seed)
    for s in strings:
        ids = tok.encode(s, parse_special=True)
        stream(tok, ids, random_chunks(rng, len(ids)), skip_special=True)
    # one long stream made of all strings, including the special tokens between them
    ids = [i for s in strings for i in tok.encode(s + "<|im_end|>", parse_special=True)]
    deltas = stream(tok, ids, random_chunks(rng, len(ids)), skip_special=True)
    assert "<|im_end|>" not in "".join(deltas)
    deltas = stream(tok, ids, random_chunks(rng, len(ids)), skip_special=False)
    assert "".join(deltas).count("<|im_end|>") == sum(s.count("<|im_end|>") + 1 for s in strings)


def test_emoji_bytes_held_until_complete(tok):
    ids = tok.encode("😀")
    assert len(ids) >= 2
    detok = IncrementalDetokenizer(tok)
    assert [detok.push([i]) for i in ids[:-1]] == [""] * (len(ids) - 1)
    assert detok.push(ids[-1:]) == "😀"
    assert detok.flush() == ""


def test_invalid_bytes(tok):
    """U+FFFD only for bytes that can never become valid; an incomplete tail is settled at flush."""
    lone = tok.token_id("\u00bf")                 # byte-level token for the lone byte 0xBF
    assert tok.token_bytes(lone) == b"\xbf"
    first = tok.encode("😀")[0]                   # F0 9F: the start of a 4-byte sequence
    detok = IncrementalDetokenizer(tok)
    assert detok.push([lone]) == "\ufffd"         # a continuation byte cannot start a char: replaced
    assert detok.push([first]) == ""              # may still complete: held
    assert detok.push(tok.encode("a")) == "\ufffda"   # 'a' cannot continue it: one U+FFFD, then 'a'
    assert detok.push([first]) == ""
    assert detok.flush() == "\ufffd"              # the stream ended inside a character
    ids = [lone, first] + tok.encode("a") + [first]
    assert tok.decode(ids) == "\ufffd\ufffda\ufffd"


def test_out_of_range_id(tok):
    with pytest.raises(InvalidRequestError, match="out of range"):
        IncrementalDetokenizer(tok).push([tok.vocab_size])


def test_spm_space_prefix(spm_tok):
    ids = spm_tok.encode("hello world a✓")           # BOS, ▁hello, ▁world, ▁a, 3 byte tokens
    assert stream(spm_tok, ids, [1] * len(ids), strip_space_prefix=True)[-1] == ""
    assert "".join(stream(spm_tok, ids, [1] * len(ids), strip_space_prefix=True)) == "hello world a✓"
    # a completion continues a prompt: its first token's space is real text, so it is kept by default
    detok = IncrementalDetokenizer(spm_tok)
    assert "".join(detok.push([i]) for i in ids) + detok.flush() == " hello world a✓"
    rng = random.Random(7)
    for s in ["日本 日本語", "  a  b", "a\nb ✓✓", "👍 hello"]:
        ids = spm_tok.encode(s)
        assert "".join(stream(spm_tok, ids, random_chunks(rng, len(ids)), strip_space_prefix=True)) == s
