#!/usr/bin/env python3
"""Writes tests/data/llamacpp_tokens.json: llama.cpp's token ids for a fixed string list (dev tool).

llama.cpp is the reference for worker/tokenizer.py but never a runtime or CI dependency, so its answers
are recorded here once and tests/unit/test_tokenizer.py compares against the JSON. Needs llama-cpp-python.

Recorded, all with add_special=False unless named so:
- bpe: the given GGUF (byte-level BPE), its sha256, the strings, and ids for parse_special False/True.
  The same vocabulary (plus a few multi-digit tokens and merges, see bpe_variant_metadata) is also
  written to vocab-only GGUFs with tokenizer.ggml.pre replaced by each other supported pre-tokenizer
  name, so every regex set is checked against llama.cpp on a real vocabulary.
  `pieces_sha256` hashes llama.cpp's token_to_piece(id, special=True) for every id.
- spm: a tiny SentencePiece-style vocabulary defined below (<unk>, <s>, </s>, 256 byte tokens, scored
  pieces, a user-defined token), its ids for the same kinds of strings, with add_special=True too.

Usage: python3 tools/llamacpp_tokens.py [--model PATH] [--out tests/data/llamacpp_tokens.json]
"""

from __future__ import annotations

import argparse
import ctypes
import hashlib
import json
import random
import sys
import tempfile
from pathlib import Path

DEFAULT_MODEL = Path.home() / ".cache/specd/models/SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_OUT = Path(__file__).resolve().parent.parent / "tests/data/llamacpp_tokens.json"
BPE_PRE_VARIANTS = ("llama-bpe", "qwen2", "default", "gpt-2")   # besides the file's own

TRICKY_STRINGS = [
    "", " ", "  ", "\n", "Hello world", "hello   world", " leading space", "   three leading",
    "trailing space ", "trailing spaces   ", "a  b   c    d", "line1\nline2", "line1\r\nline2\r\n",
    "\n\n\nparagraph\n\n", "tab\there", "\t\tindented\t", "mixed \t \n whitespace \r\n end",
    "1", "42", "3.14159", "1234567890", "12345678901234567890", "$1,234.56", "2026-11-30T03:07:00Z",
    "phone: +1 (555) 010-9999", "version 0.19.0", "...", "?!?!", "!!!", "---===---", "a--b", "(((nested)))",
    "I'm", "you're", "it's", "we've", "they'll", "I'd", "don't", "IT'S LOUD", "She's 'quoted' here",
    "rock 'n' roll", "😀", "👍🏽", "👨‍👩‍👧‍👦 family", "🏳️‍🌈 flag", "I ❤️ NY", "日本語のテキスト",
    "中文字符测试", "한국어 텍스트", "العربية نص", "עברית", "Привет, мир!", "Ελληνικά", "हिन्दी पाठ",
    "café naïve façade résumé", "e\u0301 (combining)", "Straße", "ﬁ ligature", "x\u00a0y (nbsp)",
    "ideographic\u3000space", "zero\u200bwidth", "\u2003em space", "def f(x):\n    return x * 2\n",
    "    if (a && b) {\n        c += 1;\n    }\n", "for i in range(10):\n\tprint(i)",
    "<html><body class=\"x\">Hi</body></html>", "SELECT * FROM t WHERE id = 1;", "path/to/file.txt",
    "https://example.com/a?b=c&d=e#f", "user@example.com", "snake_case camelCase PascalCase",
    "<|im_start|>", "<|im_end|>", "<|endoftext|>", "<|im_start|>user\nHello!<|im_end|>\n",
    "text<|im_end|>more", "<|im_start|><|im_start|>", "<|im_start", "|im_start|>", "< |im_start| >",
    "<repo_name>x<file_sep>y", "<s>", "</s>", "<unk>",
    "The quick brown fox jumps over the lazy dog. THE QUICK BROWN FOX!",
    "1234567", "x 123 456 7890", "zzzq", " zzzq", "a zzzq b",
]

# --- the tiny SPM vocabulary: (text, score); U+2581 stands for a space --------------------------
SPM_PIECES = [
    ("▁", -1.0), ("a", -2.0), ("b", -2.0), ("c", -2.0), ("d", -2.5), ("e", -2.0), ("h", -3.0),
    ("l", -3.0), ("o", -3.0), ("r", -3.0), ("w", -3.0), ("é", -3.0), ("日", -3.0), ("本", -3.0),
    ("he", -1.0), ("ll", -1.0), ("llo", -0.8), ("hello", -0.5), ("▁hello", -0.3),
    ("wo", -1.05), ("wor", -1.1), ("ld", -1.0), ("world", -0.6), ("▁world", -0.4),
    ("ab", -1.5), ("bc", -0.5), ("▁a", -1.2), ("aa", -1.0), ("▁▁", -0.9), ("▁b", -1.3),
    ("日本", -0.7), ("▁日本", -0.6), ("cé", -1.4), ("▁c", -1.6), ("\n", -2.0),
]
SPM_USER_DEFINED = ["<tool>"]
SPM_STRINGS = [
    "", " ", "hello world", "abc", "aaa", "  a", "a✓", "a\nb", "hello\n\nworld", "日本 日本語", "café",
    "<s>a</s>", "a<tool>b", "<tool>", "<unk>", "x!y", "  hello   world  ", "ab bc abc bca",
    "\t", "👍", "a<s>b<tool>c</s>",
]


def tiny_spm_vocab() -> tuple[list[str], list[float], list[int]]:
    """(tokens, scores, token_types) of the tiny SPM vocabulary (GGUF token types)."""
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    scores = [0.0] * len(tokens)
    types = [2, 3, 3] + [6] * 256
    for text, score in SPM_PIECES:
        tokens.append(text), scores.append(score), types.append(1)
    for text in SPM_USER_DEFINED:
        tokens.append(text), scores.append(0.0), types.append(4)
    return tokens, scores, types


def random_strings(seed: int, n: int, alphabet: list[str], max_len: int) -> list[str]:
    rng = random.Random(seed)
    return ["".join(rng.choice(alphabet) for _ in range(rng.randrange(1, max_len))) for _ in range(n)]


BPE_ALPHABET = (list(" \t\n\r\x0b\x0c\x85\xa0\u2000\u3000'sdtmlrevSDT0123456789٣१aZé€😀日ع\u0301\u200d")
                + list(".,!?;:-_()[]{}<>|$+^~=#@&*/\\\"`%")
                + ["<|im_start|>", "<|im_end|>", "<|endoftext|>", " 's", "'S", "'ll", "'RE", "  ", "\n\n"])
SPM_ALPHABET = list("abcdehlorw é日本✓!\n") + ["<s>", "</s>", "<tool>", "<unk>", "  "]


# Added to the demo vocabulary for the pre-tokenizer variants: the demo vocabulary has no multi-digit
# tokens (so \p{N} vs \p{N}{1,3} would be invisible) and no token that only ignore_merges can produce.
VARIANT_EXTRA_TOKENS = ["12", "123", "45", "456", "Ġzzzq"]
VARIANT_EXTRA_MERGES = ["1 2", "12 3", "4 5", "45 6"]


def bpe_variant_metadata(tokenizer_meta: dict, pre: str) -> dict:
    """The demo model's tokenizer.* metadata with `pre` as pre-tokenizer and the extra tokens/merges."""
    meta = dict(tokenizer_meta)
    meta["tokenizer.ggml.pre"] = pre
    meta["tokenizer.ggml.tokens"] = list(meta["tokenizer.ggml.tokens"]) + VARIANT_EXTRA_TOKENS
    meta["tokenizer.ggml.token_type"] = list(meta["tokenizer.ggml.token_type"]) + [1] * len(VARIANT_EXTRA_TOKENS)
    meta["tokenizer.ggml.merges"] = list(meta["tokenizer.ggml.merges"]) + VARIANT_EXTRA_MERGES
    return meta


def write_vocab_gguf(path: str | Path, tokenizer_meta: dict) -> None:
    """A tensor-less llama GGUF holding only hyper-parameters and the given tokenizer.* keys, which
    llama.cpp loads with vocab_only=True."""
    import gguf

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_context_length(2048)
    w.add_embedding_length(64)
    w.add_block_count(1)
    w.add_feed_forward_length(128)
    w.add_head_count(4)
    w.add_head_count_kv(4)
    w.add_layer_norm_rms_eps(1e-5)
    for key, value in tokenizer_meta.items():
        if isinstance(value, bool):
            w.add_bool(key, value)
        elif isinstance(value, int):
            w.add_uint32(key, value)
        elif isinstance(value, str):
            w.add_string(key, value)
        elif key == "tokenizer.ggml.scores":
            w.add_array(key, [float(v) for v in value])
        elif key == "tokenizer.ggml.token_type":
            w.add_array(key, [int(v) for v in value])
        else:
            w.add_array(key, list(value))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def spm_metadata() -> dict:
    tokens, scores, types = tiny_spm_vocab()
    return {"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.scores": scores, "tokenizer.ggml.token_type": types,
            "tokenizer.ggml.unknown_token_id": 0, "tokenizer.ggml.bos_token_id": 1,
            "tokenizer.ggml.eos_token_id": 2}


def pieces_sha256(pieces) -> str:
    """Hash of a token -> bytes table: each piece as 4-byte little-endian length + bytes."""
    h = hashlib.sha256()
    for p in pieces:
        h.update(len(p).to_bytes(4, "little"))
        h.update(p)
    return h.hexdigest()


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


class _LlamaVocab:
    def __init__(self, path: str | Path):
        import llama_cpp

        self._llama_cpp = llama_cpp
        self.model = llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False)
        self.vocab = self.model._model.vocab

    def tokenize(self, s: str, *, add_special: bool, special: bool) -> list[int]:
        return list(self.model.tokenize(s.encode("utf-8"), add_bos=add_special, special=special))

    def pieces(self) -> list[bytes]:
        n = self._llama_cpp.llama_vocab_n_tokens(self.vocab)
        buf = ctypes.create_string_buffer(4096)
        out = []
        for t in range(n):
            k = self._llama_cpp.llama_token_to_piece(self.vocab, t, buf, len(buf), 0, True)
            assert 0 <= k <= len(buf), (t, k)
            out.append(buf.raw[:k])
        return out


def _ids(vocab: _LlamaVocab, strings: list[str]) -> dict:
    return {"plain": [vocab.tokenize(s, add_special=False, special=False) for s in strings],
            "special": [vocab.tokenize(s, add_special=False, special=True) for s in strings],
            "add_special": [vocab.tokenize(s, add_special=True, special=True) for s in strings]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, default=DEFAULT_MODEL, help="byte-level BPE GGUF")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = ap.parse_args()

    import gguf
    import llama_cpp

    reader = gguf.GGUFReader(str(args.model))
    meta = {k: f.contents() for k, f in reader.fields.items()}
    if meta.get("tokenizer.ggml.model") != "gpt2":
        print(f"{args.model} is not a byte-level BPE (gpt2) vocabulary", file=sys.stderr)
        return 1
    own_pre = meta.get("tokenizer.ggml.pre", "default")
    bpe_strings = TRICKY_STRINGS + random_strings(1, 150, BPE_ALPHABET, 16)

    result: dict = {"generator": "tools/llamacpp_tokens.py", "llama_cpp_python": llama_cpp.__version__}
    own = _LlamaVocab(args.model)
    bpe: dict = {"model": args.model.name, "sha256": file_sha256(args.model), "strings": bpe_strings,
                 "pieces_sha256": pieces_sha256(own.pieces()), "pre": {own_pre: _ids(own, bpe_strings)}}
    tok_meta = {k: v for k, v in meta.items() if k.startswith("tokenizer.ggml.")}
    with tempfile.TemporaryDirectory() as tmp:
        for pre in BPE_PRE_VARIANTS:
            path = Path(tmp) / f"vocab-{pre}.gguf"
            write_vocab_gguf(path, bpe_variant_metadata(tok_meta, pre))
            bpe["pre"][pre] = _ids(_LlamaVocab(path), bpe_strings)
        result["bpe"] = bpe

        spm_strings = SPM_STRINGS + random_strings(2, 120, SPM_ALPHABET, 12)
        path = Path(tmp) / "tiny-spm.gguf"
        write_vocab_gguf(path, spm_metadata())
        vocab = _LlamaVocab(path)
        result["spm"] = {"metadata": spm_metadata(), "strings": spm_strings,
                         "pieces_sha256": pieces_sha256(vocab.pieces()), **_ids(vocab, spm_strings)}

    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, ensure_ascii=False, separators=(",", ":")) + "\n", encoding="utf-8")
    n = sum(len(v["plain"]) for v in bpe["pre"].values()) + len(result["spm"]["plain"])
    print(f"wrote {args.out} ({n} strings x 3 modes, pre-tokenizers: {', '.join(bpe['pre'])}, tiny SPM)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
