"""Tokenizer built from GGUF metadata: text <-> token ids, token bytes, special and stop ids.

Owns the two vocabulary kinds llama.cpp calls BPE and SPM:
- `tokenizer.ggml.model == "gpt2"`: byte-level BPE. Text is split by the pre-tokenizer regexes that
  llama.cpp (src/llama-vocab.cpp) picks for `tokenizer.ggml.pre`, each piece is mapped byte -> printable
  char (GPT-2's bytes_to_unicode) and merged by merge rank. The `tokenizers` library runs the regexes and
  the merges (Rust); we build it from the metadata arrays.
- `tokenizer.ggml.model == "llama"`: SentencePiece-style. Spaces become U+2581, a space is prefixed after
  the start / each special token (`add_space_prefix`), then adjacent symbols are merged greedily, highest
  score of the merged piece first (ties: leftmost), exactly llama.cpp's llm_tokenizer_spm; a final symbol
  that is not a piece falls back to byte tokens <0xXX>.

Special tokens (llama.cpp's tokenizer_st_partition): before either algorithm, the text is cut at
occurrences of special-token texts, longest token text first. Control (type 3) and unknown (type 2)
tokens are cut only with `parse_special=True`; user-defined tokens (type 4) always, as llama.cpp and HF
tokenizers do. Token types follow the GGUF enum (gguf.TokenType).

Known, deliberate differences from llama.cpp: decode never applies llama.cpp's `clean_spaces`
(" ." -> ".") so that decode(encode(s)) == s; for SPM the one leading space the prefix added is
stripped from the first non-special token (HF's Metaspace rule) whether or not a BOS precedes it.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Iterable, Mapping, Sequence

from worker.errors import InvalidRequestError, ModelLoadError

# GGUF token types (gguf.TokenType); spelled out so this module needs no gguf import at run time.
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

# Token texts llama.cpp treats as end of generation (and forces to CONTROL type) whatever their
# metadata says; the eos / eot / eom ids from the metadata are added to these.
_STOP_TOKEN_TEXTS = (
    "<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|endoftext|>", "<|end|>", "<end_of_turn>", "<EOT>",
)

# --- pre-tokenizer regexes, copied verbatim (modulo C++ escaping) from llama.cpp's llm_tokenizer_bpe.
# Several regexes are applied in sequence: each splits the pieces the previous one produced, and text
# between matches stays a piece of its own (HF `Split(behavior="isolated")` does the same).
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3 = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|"
           r"\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2 = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|"
          r"\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")


@dataclass(frozen=True)
class _PreTokenizer:
    regexes: tuple[str, ...]
    ignore_merges: bool = False   # a word that is itself a token is taken whole (llama 3)
    add_bos: bool = False         # llama.cpp's default when tokenizer.ggml.add_bos_token is absent


_DEFAULT_PRE = _PreTokenizer((r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", r"[0-9][0-9][0-9]"))
_GPT2_PRE = _PreTokenizer((_GPT2,))
_DIGITS_GPT2_PRE = _PreTokenizer((r"\p{N}", _GPT2))
_LLAMA3_PRE = _PreTokenizer((_LLAMA3,), ignore_merges=True, add_bos=True)
_QWEN2_PRE = _PreTokenizer((_QWEN2,))

# `tokenizer.ggml.pre` name -> pre-tokenizer; names and groupings as in llama.cpp's llama_vocab::load.
PRE_TOKENIZERS: dict[str, _PreTokenizer] = {
    "default": _DEFAULT_PRE,
    "gpt-2": _GPT2_PRE, "gpt2": _GPT2_PRE, "phi-2": _GPT2_PRE, "mpt": _GPT2_PRE, "olmo": _GPT2_PRE,
    "smollm": _DIGITS_GPT2_PRE, "starcoder": _DIGITS_GPT2_PRE, "refact": _DIGITS_GPT2_PRE,
    "llama-bpe": _LLAMA3_PRE, "llama3": _LLAMA3_PRE, "llama-v3": _LLAMA3_PRE,
    "qwen2": _QWEN2_PRE, "deepseek-r1-qwen": _QWEN2_PRE,
}
SUPPORTED_MODELS = ("gpt2", "llama")


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable char map: printable latin-1 bytes map to themselves, the other 68
    bytes (controls, space, 0x7F-0xA0, 0xAD) to U+0100.. in byte order, so every byte has a visible,
    non-space stand-in and BPE never sees whitespace."""
    keep = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    table, extra = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


_BYTE_TO_CHAR = _bytes_to_unicode()
# char -> chr(byte): a token text translated through this is its bytes as latin-1. Latin-1 chars that are
# not stand-ins map to U+FFFF so that the latin-1 encode fails and the slow, exact path runs.
_CHAR_TO_LATIN1 = {ord(c): chr(b) for b, c in _BYTE_TO_CHAR.items()}
for _b, _c in _BYTE_TO_CHAR.items():
    if _c != chr(_b):
        _CHAR_TO_LATIN1.setdefault(_b, "\uffff")


def _byte_level_decode(text: str) -> bytes:
    """Bytes of a byte-level BPE token text (chars outside the map pass through as UTF-8)."""
    try:
        return text.translate(_CHAR_TO_LATIN1).encode("latin-1")
    except UnicodeEncodeError:
        out = bytearray()
        for ch in text:
            b = _CHAR_TO_LATIN1.get(ord(ch))
            out += b.encode("latin-1") if b is not None and b != "\uffff" else ch.encode("utf-8")
        return bytes(out)


def _check_model(model: object) -> None:
    if model not in SUPPORTED_MODELS:
        raise ModelLoadError(f"unsupported tokenizer model '{model}' (tokenizer.ggml.model); "
                             f"supported: {', '.join(SUPPORTED_MODELS)}")


def _meta_list(meta: Mapping, key: str, n: int | None, *, required: bool) -> list | None:
    value = meta.get(key)
    if value is None:
        if required:
            raise ModelLoadError(f"GGUF metadata has no '{key}'; the file carries no usable tokenizer")
        return None
    value = list(value)
    if n is not None and len(value) != n:
        raise ModelLoadError(f"GGUF metadata '{key}' has {len(value)} entries, expected {n} "
                             f"(one per token of tokenizer.ggml.tokens)")
    return value


class Tokenizer:
    """Encode/decode for one GGUF vocabulary. Build with `Tokenizer.from_metadata(meta)`.

    model: "gpt2" | "llama"; pre: the BPE pre-tokenizer name (None for SPM); bos_id, eos_id, unk_id,
    eot_id, eom_id: ids or None; add_bos / add_eos: what encode(add_special=True) adds; stop_ids: ids
    that end generation."""

    def __init__(self, *, model: str, tokens: list[str], token_types: list[int], scores: list[float] | None,
                 merges: list[str] | None, pre: str | None, special_ids: Mapping[str, int | None],
                 add_bos: bool | None, add_eos: bool | None, add_space_prefix: bool | None):
        _check_model(model)
        n = len(tokens)
        if n == 0:
            raise ModelLoadError("GGUF tokenizer.ggml.tokens is empty")
        self.model = model
        self._tokens = tokens
        self._types = list(token_types)
        self._token_to_id = {t: i for i, t in enumerate(tokens)}

        def valid(i: int | None) -> int | None:
            return i if i is not None and 0 <= int(i) < n else None

        if model == "llama":
            # llama.cpp's SPM defaults: <unk>=0, <s>=1, </s>=2, BOS added, a space prefixed.
            defaults = {"bos": 1, "eos": 2, "unk": 0}
            default_add_bos, default_space_prefix = True, True
            self._pre, self.pre = None, None
        else:
            defaults = {}
            pre_name = pre if pre else "default"
            self._pre = PRE_TOKENIZERS.get(pre_name)
            if self._pre is None:
                raise ModelLoadError(
                    f"unsupported BPE pre-tokenizer '{pre_name}' (tokenizer.ggml.pre); supported: "
                    f"{', '.join(sorted(PRE_TOKENIZERS))}")
            self.pre = pre_name
            default_add_bos, default_space_prefix = self._pre.add_bos, False
        ids = {}
        for k in ("bos", "eos", "unk", "eot", "eom"):
            v = special_ids.get(k)
            ids[k] = valid(defaults.get(k) if v is None else v)
        self.bos_id: int | None = ids["bos"]
        self.eos_id: int | None = ids["eos"]
        self.unk_id: int | None = ids["unk"]
        self.eot_id: int | None = ids["eot"]
        self.eom_id: int | None = ids["eom"]
        self.add_bos = default_add_bos if add_bos is None else bool(add_bos)
        self.add_eos = False if add_eos is None else bool(add_eos)
        self.add_space_prefix = default_space_prefix if add_space_prefix is None else bool(add_space_prefix)
        if self.add_bos and self.bos_id is None:
            raise ModelLoadError("tokenizer adds a BOS token (tokenizer.ggml.add_bos_token) but "
                                 "tokenizer.ggml.bos_token_id is missing or out of range")
        if self.add_eos and self.eos_id is None:
            raise ModelLoadError("tokenizer adds an EOS token (tokenizer.ggml.add_eos_token) but "
                                 "tokenizer.ggml.eos_token_id is missing or out of range")

        # Stop ids: eos/eot/eom plus the conventional end-of-turn token texts (forced to CONTROL, as
        # llama.cpp does, so they are parsed as specials and hidden by skip_special).
        stops = {i for i in (self.eos_id, self.eot_id, self.eom_id) if i is not None}
        for text in _STOP_TOKEN_TEXTS:
            i = self._token_to_id.get(text)
            if i is not None:
                stops.add(i)
                if self._types[i] != CONTROL:
                    self._types[i] = CONTROL
        self.stop_ids: frozenset[int] = frozenset(stops)

        types = self._types
        # Ids that skip_special hides (llama.cpp: CONTROL | UNKNOWN render only with special=true).
        self._hidden = frozenset(i for i, t in enumerate(types) if t in (CONTROL, UNKNOWN))
        # Special texts for the partition, longest first (ties by id for determinism).
        specials = sorted((i for i, t in enumerate(types) if t in (CONTROL, USER_DEFINED, UNKNOWN)
                           and tokens[i]), key=lambda i: (-len(tokens[i].encode("utf-8")), i))
        self._specials_all = [(tokens[i], i) for i in specials]
        self._specials_user = [(tokens[i], i) for i in specials if types[i] == USER_DEFINED]

        if model == "gpt2":
            self._pieces = [self._bpe_piece(i) for i in range(n)]
            self._hf = self._build_hf(merges or [])
        else:
            if scores is None:
                raise ModelLoadError("SPM tokenizer needs tokenizer.ggml.scores in the GGUF metadata")
            self._scores = [float(s) for s in scores]
            self._pieces = [self._spm_piece(i) for i in range(n)]
            self._byte_ids = [self._spm_byte_id(b) for b in range(256)]

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_metadata(cls, meta: Mapping[str, object]) -> "Tokenizer":
        """Build from {GGUF key: ReaderField.contents()}; raises ModelLoadError on anything unusable."""
        model = meta.get("tokenizer.ggml.model")
        if model is None:
            raise ModelLoadError("GGUF metadata has no 'tokenizer.ggml.model'; the file carries no tokenizer")
        _check_model(model)
        tokens = _meta_list(meta, "tokenizer.ggml.tokens", None, required=True)
        n = len(tokens)
        types = _meta_list(meta, "tokenizer.ggml.token_type", n, required=False) or [NORMAL] * n
        scores = _meta_list(meta, "tokenizer.ggml.scores", n, required=False)
        merges = _meta_list(meta, "tokenizer.ggml.merges", None, required=(model == "gpt2"))

        def opt(key):
            return meta.get(key)

        return cls(model=model, tokens=tokens, token_types=types, scores=scores, merges=merges,
                   pre=opt("tokenizer.ggml.pre"),
                   special_ids={"bos": opt("tokenizer.ggml.bos_token_id"),
                                "eos": opt("tokenizer.ggml.eos_token_id"),
                                "unk": opt("tokenizer.ggml.unknown_token_id"),
                                "eot": opt("tokenizer.ggml.eot_token_id"),
                                "eom": opt("tokenizer.ggml.eom_token_id")},
                   add_bos=opt("tokenizer.ggml.add_bos_token"), add_eos=opt("tokenizer.ggml.add_eos_token"),
                   add_space_prefix=opt("tokenizer.ggml.add_space_prefix"))

    def _build_hf(self, merges: list[str]):
        from tokenizers import Regex, models, pre_tokenizers
        from tokenizers import Tokenizer as HFTokenizer

        vocab = self._token_to_id
        pairs = []
        for m in merges:
            # llama.cpp splits at the first space after position 0 (a side is never empty).
            k = m.find(" ", 1)
            if k < 0:
                raise ModelLoadError(f"malformed BPE merge {m!r} in tokenizer.ggml.merges (expected 'a b')")
            a, b = m[:k], m[k + 1:]
            # HF refuses merges whose sides or result are not tokens; such a merge can never produce
            # a token in llama.cpp either, so dropping it changes nothing.
            if a in vocab and b in vocab and a + b in vocab:
                pairs.append((a, b))
        try:
            bpe = models.BPE(vocab=vocab, merges=pairs, ignore_merges=self._pre.ignore_merges)
        except Exception as e:  # noqa: BLE001 - the Rust error text is the useful part
            raise ModelLoadError(f"cannot build the BPE tokenizer from GGUF metadata: {e}") from e
        hf = HFTokenizer(bpe)
        hf.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in self._pre.regexes]
            + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
        return hf

    def _bpe_piece(self, i: int) -> bytes:
        t = self._types[i]
        if t in (CONTROL, UNKNOWN, USER_DEFINED):
            return self._tokens[i].encode("utf-8")       # stored verbatim, not byte-level encoded
        if t == NORMAL:
            return _byte_level_decode(self._tokens[i])
        return b""                                       # unused/byte/undefined: llama.cpp emits nothing

    def _spm_piece(self, i: int) -> bytes:
        t, text = self._types[i], self._tokens[i]
        if t in (CONTROL, UNKNOWN, USER_DEFINED):
            return text.encode("utf-8")
        if t == NORMAL:
            return text.replace("\u2581", " ").encode("utf-8")
        if t == BYTE:
            try:
                return bytes([int(text[3:5], 16)])     # "<0xAB>"
            except ValueError as e:
                raise ModelLoadError(f"byte token {i} has text {text!r}, expected '<0xXX>'") from e
        return b""

    def _spm_byte_id(self, b: int) -> int | None:
        """llama.cpp's byte_to_token: <0xXX>, else the one-char token, else <unk>."""
        i = self._token_to_id.get(f"<0x{b:02X}>")
        if i is None and b < 0x80:
            i = self._token_to_id.get(chr(b))
        return i if i is not None else self.unk_id

    # ------------------------------------------------------------------ properties
    @property
    def vocab_size(self) -> int:
        return len(self._tokens)

    def is_special(self, token_id: int) -> bool:
        """True for control and unknown tokens: the ones decode(skip_special=True) hides."""
        return token_id in self._hidden

    def token_text(self, token_id: int) -> str:
        """The token as stored in the vocabulary ('Ġhello', '▁hello', '<0x0A>'), for debugging."""
        self._check_id(token_id)
        return self._tokens[token_id]

    def token_bytes(self, token_id: int) -> bytes:
        """The raw bytes this token contributes to decoded text (specials: their text)."""
        self._check_id(token_id)
        return self._pieces[token_id]

    def token_id(self, text: str) -> int | None:
        """Id of the token whose vocabulary text is exactly `text`, or None."""
        return self._token_to_id.get(text)

    def _check_id(self, token_id: int) -> None:
        if not 0 <= token_id < len(self._tokens):
            raise InvalidRequestError(f"token id {token_id} is out of range; vocabulary has "
                                      f"{len(self._tokens)} tokens (0..{len(self._tokens) - 1})")

    # ------------------------------------------------------------------ encode
    def encode(self, text: str, *, add_special: bool = True, parse_special: bool = False) -> list[int]:
        """Token ids of `text`. add_special: BOS/EOS as the metadata asks (add_bos_token/add_eos_token);
        parse_special: control-token texts like '<|im_start|>' in `text` become their token."""
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:
            raise InvalidRequestError(f"text is not valid Unicode: lone surrogate at index {e.start}; "
                                      f"send UTF-8 text") from None
        out: list[int] = []
        if add_special and self.add_bos:
            out.append(self.bos_id)
        fragments = self._partition(text, parse_special)
        if self.model == "gpt2":
            hf = self._hf
            for f in fragments:
                if type(f) is int:
                    out.append(f)
                else:
                    out.extend(hf.encode(f, add_special_tokens=False).ids)
        else:
            prev_special = True                 # the start counts as "after a special": prefix a space
            for f in fragments:
                if type(f) is int:
                    out.append(f)
                    prev_special = True
                else:
                    if self.add_space_prefix and prev_special:
                        f = " " + f
                    self._spm_encode(f.replace(" ", "\u2581"), out)
                    prev_special = False
        if add_special and self.add_eos:
            out.append(self.eos_id)
        return out

    def _partition(self, text: str, parse_special: bool) -> list:
        """Cut text at special-token texts (longest first, leftmost non-overlapping occurrences of each,
        as llama.cpp's tokenizer_st_partition): a list of str fragments and int token ids."""
        if not text:
            return []
        fragments: list = [text]
        for special, tid in (self._specials_all if parse_special else self._specials_user):
            if special not in text:
                continue
            cut: list = []
            for f in fragments:
                if type(f) is str and special in f:
                    for k, part in enumerate(f.split(special)):
                        if k:
                            cut.append(tid)
                        if part:
                            cut.append(part)
                else:
                    cut.append(f)
            fragments = cut
        return fragments

    def _spm_encode(self, s: str, out: list[int]) -> None:
        """llama.cpp's llm_tokenizer_spm on one fragment (spaces already U+2581).

        Symbols start as single code points; symbol i always spans s[i : i + length[i]] (a left
        symbol absorbs its right neighbour). Every adjacent pair whose concatenation is a token is a
        candidate; the highest-scoring candidate (ties: leftmost) is merged first, then the new
        neighbour pairs are queued. Entries made stale by earlier merges are detected by their size."""
        n = len(s)
        if n == 0:
            return
        vocab, scores = self._token_to_id, self._scores
        length = [1] * n
        prev = list(range(-1, n - 1))
        nxt = list(range(1, n + 1))
        nxt[-1] = -1
        heap: list[tuple[float, int, int, int]] = []   # (-score, left, right, merged length)

        def push(left: int, right: int) -> None:
            if left < 0 or right < 0:
                return
            size = length[left] + length[right]
            tid = vocab.get(s[left:left + size])
            if tid is not None:
                heapq.heappush(heap, (-scores[tid], left, right, size))

        for i in range(1, n):
            push(i - 1, i)

        while heap:
            _, left, right, size = heapq.heappop(heap)
            if length[left] == 0 or length[right] == 0 or length[left] + length[right] != size:
                continue
            length[left] = size
            length[right] = 0
            nxt[left] = nxt[right]
            if nxt[right] >= 0:
                prev[nxt[right]] = left
            push(prev[left], left)
            push(left, nxt[left])

        i = 0
        while i != -1:
            piece = s[i:i + length[i]]
            tid = vocab.get(piece)
            if tid is not None:
                out.append(tid)
            else:
                for b in piece.encode("utf-8"):
                    bid = self._byte_ids[b]
                    if bid is None:
                        raise InvalidRequestError(f"cannot encode byte 0x{b:02X}: the vocabulary has no "
                                                  f"<0x{b:02X}> token and no <unk>")
                    out.append(bid)
            i = nxt[i]

    # ------------------------------------------------------------------ decode
    def decode(self, ids: Sequence[int] | Iterable[int], *, skip_special: bool = False) -> str:
        """Text of `ids`. skip_special hides control/unknown tokens. Bytes that never form valid UTF-8
        become U+FFFD. For SPM vocabularies with a space prefix, the first non-special token loses one
        leading space (the one encode added), so decode(encode(s)) == s."""
        ids = list(ids)
        if not ids:
            return ""
        n = len(self._tokens)
        if min(ids) < 0 or max(ids) >= n:
            bad = next(i for i in ids if not 0 <= i < n)
            self._check_id(bad)
        pieces, hidden = self._pieces, self._hidden
        chunks = [pieces[i] for i in ids if not (skip_special and i in hidden)]
        if self.add_space_prefix:
            # the first non-hidden token: chunks[0] when hidden ones were skipped, else at its own index
            k = next((k for k, i in enumerate(ids) if i not in hidden), None)
            if k is not None:
                j = 0 if skip_special else k
                if chunks[j].startswith(b" "):
                    chunks[j] = chunks[j][1:]
        return b"".join(chunks).decode("utf-8", errors="replace")
