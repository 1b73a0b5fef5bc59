"""worker/tokenizer.py against llama.cpp's recorded ids (tests/data/llamacpp_tokens.json) and by hand.

The JSON is written by tools/llamacpp_tokens.py (llama-cpp-python, dev only): ids for ~240 strings on the
demo model's byte-level BPE vocabulary under five pre-tokenizer names, and for a tiny SentencePiece-style
vocabulary (stored in the JSON) that this module writes to a GGUF and loads back.
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import gguf
import pytest

from helpers.tools import load_tool
from worker.errors import InvalidRequestError, ModelLoadError
from worker.tokenizer import PRE_TOKENIZERS, Tokenizer

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT / "tests/data/llamacpp_tokens.json"
MODES = {"plain": dict(add_special=False, parse_special=False),
         "special": dict(add_special=False, parse_special=True),
         "add_special": dict(add_special=True, parse_special=True)}


tool = load_tool("llamacpp_tokens.py")  # (it imports llama_cpp only inside the functions that need it)


def read_metadata(path) -> dict:
    reader = gguf.GGUFReader(str(path))
    return {k: f.contents() for k, f in reader.fields.items()}


@pytest.fixture(scope="module")
def llamacpp() -> dict:
    return json.loads(DATA.read_text(encoding="utf-8"))


@pytest.fixture(scope="module")
def demo_meta(demo_model_path) -> dict:
    return read_metadata(demo_model_path)


@pytest.fixture(scope="module")
def demo_tok(demo_meta) -> Tokenizer:
    return Tokenizer.from_metadata(demo_meta)


@pytest.fixture(scope="module")
def demo_sha_ok(demo_model_path, llamacpp) -> None:
    sha = tool.file_sha256(Path(demo_model_path))
    if sha != llamacpp["bpe"]["sha256"]:
        pytest.skip(f"{demo_model_path} (sha256 {sha[:12]}) is not the file the llama.cpp ids were "
                    f"recorded for; rerun tools/llamacpp_tokens.py")


@pytest.fixture(scope="module")
def spm_tok(tmp_path_factory, llamacpp) -> Tokenizer:
    """The tiny SPM vocabulary, written to a GGUF with gguf.GGUFWriter and read back."""
    path = tmp_path_factory.mktemp("spm") / "tiny-spm.gguf"
    tool.write_vocab_gguf(path, llamacpp["spm"]["metadata"])
    return Tokenizer.from_metadata(read_metadata(path))


def texts(tok: Tokenizer, ids) -> list[str]:
    return [tok.token_text(i) for i in ids]


# ---------------------------------------------------------------- byte-level BPE (demo model)

def test_demo_vocabulary_facts(demo_tok):
    assert demo_tok.model == "gpt2"
    assert demo_tok.vocab_size == 49152
    assert (demo_tok.bos_id, demo_tok.eos_id) == (1, 2)
    assert demo_tok.add_bos is False and demo_tok.add_eos is False     # metadata says so
    # eos (<|im_end|>, 2) plus the conventional end-of-turn texts present: <|endoftext|> (0).
    assert demo_tok.stop_ids == {0, 2}
    assert demo_tok.token_text(1) == "<|im_start|>" and demo_tok.is_special(1)
    assert demo_tok.token_text(216) == "Ġ" and demo_tok.token_bytes(216) == b" "
    assert not demo_tok.is_special(216)
    assert demo_tok.token_id("<|im_end|>") == 2


@pytest.mark.parametrize("pre", ["smollm", "llama-bpe", "qwen2", "default", "gpt-2"])
def test_ids_match_llamacpp(pre, demo_meta, demo_sha_ok, llamacpp):
    """Every recorded string, three modes, each pre-tokenizer regex set on the real vocabulary."""
    bpe = llamacpp["bpe"]
    assert pre in bpe["pre"] and len(bpe["strings"]) > 200
    own = demo_meta["tokenizer.ggml.pre"]
    tok = Tokenizer.from_metadata(demo_meta if pre == own else tool.bpe_variant_metadata(demo_meta, pre))
    mismatches = []
    for mode, kwargs in MODES.items():
        expected = bpe["pre"][pre][mode]
        assert len(expected) == len(bpe["strings"])
        for s, want in zip(bpe["strings"], expected):
            got = tok.encode(s, **kwargs)
            if got != want:
                mismatches.append((mode, s, got, want))
    assert not mismatches, f"{len(mismatches)} differ from llama.cpp, first: {mismatches[:3]}"


def test_pre_tokenizers_really_differ(llamacpp):
    """Guard against vacuous variants: llama.cpp's ids differ for every pair of pre-tokenizers, and the
    llama 3 one takes a vocabulary word whole even when no merges build it (ignore_merges)."""
    ids, strings = llamacpp["bpe"]["pre"], llamacpp["bpe"]["strings"]
    for p, q in itertools.combinations(ids, 2):
        assert ids[p]["plain"] != ids[q]["plain"], (p, q)
    k = strings.index(" zzzq")
    assert len(ids["llama-bpe"]["plain"][k]) == 1 and len(ids["gpt-2"]["plain"][k]) > 1


def test_token_bytes_match_llamacpp_pieces(demo_tok, demo_sha_ok, llamacpp):
    pieces = [demo_tok.token_bytes(i) for i in range(demo_tok.vocab_size)]
    assert tool.pieces_sha256(pieces) == llamacpp["bpe"]["pieces_sha256"]


def test_round_trip(demo_tok, llamacpp):
    strings = llamacpp["bpe"]["strings"] + ["x" * 5000, "word " * 2000, "🙂" * 300 + "\n" * 50]
    for s in strings:
        assert demo_tok.decode(demo_tok.encode(s, add_special=False)) == s
        # control tokens render as their text unless skipped, so parsed specials round-trip too
        assert demo_tok.decode(demo_tok.encode(s, parse_special=True)) == s


def test_special_tokens_parse_only_on_request(demo_tok):
    text = "<|im_start|>user\nHi<|im_end|>\n"
    plain = demo_tok.encode(text)
    assert 1 not in plain and 2 not in plain and len(plain) > 8
    parsed = demo_tok.encode(text, parse_special=True)
    assert parsed[0] == 1 and parsed[-2] == 2 and parsed.count(1) == 1
    assert demo_tok.decode(parsed, skip_special=True) == "user\nHi\n"
    assert demo_tok.decode(parsed) == text


def test_decode_edges(demo_tok):
    assert demo_tok.decode([]) == ""
    assert demo_tok.encode("") == []
    with pytest.raises(InvalidRequestError, match="out of range"):
        demo_tok.decode([5, 49152])
    with pytest.raises(InvalidRequestError, match="out of range"):
        demo_tok.decode([-1])
    # a lone first byte of a 4-byte sequence can never complete: U+FFFD
    first = demo_tok.encode("😀")[0]
    assert demo_tok.token_bytes(first) == b"\xf0\x9f"     # the emoji's first two bytes
    assert demo_tok.decode([first]) == "\ufffd"


def test_lone_surrogate_is_rejected(demo_tok):
    with pytest.raises(InvalidRequestError, match="surrogate"):
        demo_tok.encode("a\ud800b")


# ---------------------------------------------------------------- errors

def test_unsupported_model_and_pre(demo_meta):
    with pytest.raises(ModelLoadError, match=r"unsupported tokenizer model 'bert'.*gpt2, llama"):
        Tokenizer.from_metadata({**demo_meta, "tokenizer.ggml.model": "bert"})
    with pytest.raises(ModelLoadError, match=r"unsupported BPE pre-tokenizer 'tekken'.*smollm"):
        Tokenizer.from_metadata({**demo_meta, "tokenizer.ggml.pre": "tekken"})
    with pytest.raises(ModelLoadError, match="tokenizer.ggml.model"):
        Tokenizer.from_metadata({})
    with pytest.raises(ModelLoadError, match="merges"):
        Tokenizer.from_metadata({k: v for k, v in demo_meta.items() if k != "tokenizer.ggml.merges"})
    short = {**demo_meta, "tokenizer.ggml.token_type": demo_meta["tokenizer.ggml.token_type"][:10]}
    with pytest.raises(ModelLoadError, match="token_type' has 10 entries"):
        Tokenizer.from_metadata(short)
    assert {"smollm", "llama-bpe", "qwen2", "default", "gpt2"} <= set(PRE_TOKENIZERS)


def test_add_bos_defaults_follow_llamacpp(demo_meta):
    meta = {k: v for k, v in demo_meta.items() if k != "tokenizer.ggml.add_bos_token"}
    assert Tokenizer.from_metadata(meta).encode("hi")[0] != 1            # gpt2 default: no BOS
    llama3 = Tokenizer.from_metadata({**meta, "tokenizer.ggml.pre": "llama-bpe"})
    assert llama3.encode("hi")[0] == 1                                   # llama.cpp: llama3 adds BOS
    eos = Tokenizer.from_metadata({**demo_meta, "tokenizer.ggml.add_eos_token": True})
    assert eos.encode("hi")[-1] == 2 and eos.encode("hi", add_special=False)[-1] != 2


# ---------------------------------------------------------------- SentencePiece-style (tiny vocab)

@pytest.mark.parametrize("text,pieces", [
    # merges: he, ll (-1.0, leftmost first) -> llo (-0.8) -> hello -> ▁hello; ld, wo, wor, world, ▁world
    ("hello world", ["▁hello", "▁world"]),
    # bc (-0.5) beats the leftmost ▁a (-1.2) and ab (-1.5); 'abc' is no piece
    ("abc", ["▁a", "bc"]),
    # equal scores: the leftmost 'aa' wins, the other pair is then stale; '▁aa'/'aaa' are no pieces
    ("aaa", ["▁", "aa", "a"]),
    # the prefix space plus two spaces: ▁▁ (leftmost) then ▁a
    ("  a", ["▁▁", "▁a"]),
    # byte fallback for a char with no piece (U+2713 = E2 9C 93) and for '!'
    ("a✓", ["▁a", "<0xE2>", "<0x9C>", "<0x93>"]),
    ("x!", ["▁", "<0x78>", "<0x21>"]),
    ("a\nb", ["▁a", "\n", "b"]),
    ("日本", ["▁日本"]),
    # user-defined tokens are cut out even without parse_special, and a space is prefixed after them
    ("a<tool>b", ["▁a", "<tool>", "▁b"]),
])
def test_spm_by_hand(spm_tok, text, pieces):
    assert texts(spm_tok, spm_tok.encode(text, add_special=False)) == pieces


def test_spm_specials_and_bos(spm_tok):
    assert spm_tok.model == "llama" and spm_tok.add_bos and not spm_tok.add_eos   # llama.cpp defaults
    assert texts(spm_tok, spm_tok.encode("<s>a</s>", parse_special=True)) == ["<s>", "<s>", "▁a", "</s>"]
    plain = texts(spm_tok, spm_tok.encode("<s>", add_special=False))
    assert plain == ["▁", "<0x3C>", "<0x73>", "<0x3E>"]
    assert spm_tok.encode("<unk>", add_special=False, parse_special=True) == [0]
    assert spm_tok.stop_ids == {2}


@pytest.mark.parametrize("mode", list(MODES))
def test_spm_ids_match_llamacpp(spm_tok, llamacpp, mode):
    spm = llamacpp["spm"]
    assert len(spm["strings"]) > 100
    got = [spm_tok.encode(s, **MODES[mode]) for s in spm["strings"]]
    bad = [(s, g, w) for s, g, w in zip(spm["strings"], got, spm[mode]) if g != w]
    assert not bad, f"{len(bad)} differ from llama.cpp, first: {bad[:3]}"


def test_spm_pieces_and_decode(spm_tok, llamacpp):
    pieces = [spm_tok.token_bytes(i) for i in range(spm_tok.vocab_size)]
    assert tool.pieces_sha256(pieces) == llamacpp["spm"]["pieces_sha256"]
    assert spm_tok.token_bytes(spm_tok.token_id("<0x0A>")) == b"\n"
    assert spm_tok.token_bytes(spm_tok.token_id("▁hello")) == b" hello"
    ids = spm_tok.encode("hello world a✓")
    assert spm_tok.decode(ids, skip_special=True) == "hello world a✓"     # prefix space stripped once
    assert spm_tok.decode(ids) == "<s>hello world a✓"
    for s in ["  two", "x  y ", "日本 日本語", "a\nb", "👍 ok"]:
        assert spm_tok.decode(spm_tok.encode(s, add_special=False)) == s


def test_spm_without_byte_tokens(llamacpp):
    """No <0xXX> tokens: an unknown char becomes <unk>; without a usable <unk> id, a clear error."""
    meta = dict(llamacpp["spm"]["metadata"])
    keep = [i for i, t in enumerate(meta["tokenizer.ggml.tokens"]) if not t.startswith("<0x")]
    for key in ("tokenizer.ggml.tokens", "tokenizer.ggml.scores", "tokenizer.ggml.token_type"):
        meta[key] = [meta[key][i] for i in keep]
    tok = Tokenizer.from_metadata(meta)
    assert texts(tok, tok.encode("hello!", add_special=False)) == ["▁hello", "<unk>"]
    tok = Tokenizer.from_metadata({**meta, "tokenizer.ggml.unknown_token_id": 10**6})   # out of range
    assert tok.unk_id is None
    with pytest.raises(InvalidRequestError, match="0x21"):
        tok.encode("hello!")


def test_json_is_current(llamacpp):
    """The JSON was recorded from the tool's current strings and vocabularies (else: rerun the tool)."""
    assert llamacpp["spm"]["metadata"] == json.loads(json.dumps(tool.spm_metadata()))
    assert llamacpp["bpe"]["strings"][:len(tool.TRICKY_STRINGS)] == tool.TRICKY_STRINGS
    assert llamacpp["spm"]["strings"][:len(tool.SPM_STRINGS)] == tool.SPM_STRINGS
