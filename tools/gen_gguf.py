"""Random-weight GGUF files in real model shapes, for speed work without downloading a model.

    python tools/gen_gguf.py qwen3-0.6b Q4_K_M [-o DIR] [--layers N] [--seed S]
    python tools/gen_gguf.py qwen3-8b F16 llama-3.2-1b BF16 ...     (pairs: shape type)

Shapes (`SHAPES`): qwen3-0.6b, qwen3-8b, llama-3.2-1b (the published hyper-parameters), tiny and
tiny-llama (for tests); `--layers N` keeps the first N blocks (quick local copies). Types
(`TYPES`): F16, BF16, Q8_0 (every matrix in that type) and Q4_K_M, llama.cpp's mix
(src/llama-quant.cpp, llama_tensor_get_type for LLAMA_FTYPE_MOSTLY_Q4_K_M, arch not falcon, no
imatrix, no experts):
  - output.weight Q6_K; token_embd Q6_K when tied (it is the output head), else Q4_K;
  - attn_v and ffn_down of layer i Q6_K when use_more_bits(i, n_layers), else Q4_K, with
    use_more_bits(i, n) = i < n/8 or i >= 7n/8 or (i - n/8) % 3 == 2;
  - every other matrix Q4_K; norms (and llama's rope_freqs) F32 in every type.

Values: matrices ~ N(0, 0.02) (HF's initializer_range; dequantized quant blocks have that spread),
norm weights 1 + N(0, 0.02), llama's rope_freqs the real Llama-3 factors (factor 32, low/high 1/4,
original context 8192). Quant blocks are random bytes with every fp16 field (d, dmin) written as
a finite positive scale: value = d*s*q - dmin*m (Q4_K, s, m in 0..63, q in 0..15, dmin = 7.5 d
centres it), d*s*(q - 32) (Q6_K, s int8), d*q (Q8_0, q int8), d calibrated so the spread is 0.02.

Fast enough for an 8B F16 file (16 GB): one pool of random units per storage type (fp16 values,
bf16 bit patterns, whole quant blocks; at most `pool_mib` MiB each) is drawn once, and each tensor
is a slice of it at a random offset (a view, no copy, unless the tensor is larger than the pool);
tensors are streamed to disk one by one (written to PATH.part, renamed when complete).

Metadata: the architecture keys worker/model_file.py and llama.cpp read (key_length always,
vocab_size, rope base / dims, file_type, quantization_version) and a byte-level BPE tokenizer
(tokenizer.ggml.model gpt2, pre qwen2 / llama-bpe) of exactly `vocab` tokens: the 256 byte
symbols, tokens built breadth-first from 63 common symbols with merges 'a b' for the first 4096
of them (a, b and ab all tokens; the rest stay unreachable, which is legal and keeps gguf's
reader fast), then the control tokens at the end as in the real vocabularies (Qwen3:
<|endoftext|> ... ids from 151643; Llama-3: <|begin_of_text|> ... ids from 128000), bos/eos ids
and a chat template. Deterministic given (shape, type, layers, seed, pool_mib).
"""

from __future__ import annotations

import argparse
import functools
import math
import os
import struct
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path

import gguf
import numpy as np

T = gguf.GGMLQuantizationType
STD = 0.02  # spread of every matrix (HF initializer_range)
TYPES = ("F16", "BF16", "Q8_0", "Q4_K_M")
_FILE_TYPE = {"F16": gguf.LlamaFileType.MOSTLY_F16, "BF16": gguf.LlamaFileType.MOSTLY_BF16,
              "Q8_0": gguf.LlamaFileType.MOSTLY_Q8_0, "Q4_K_M": gguf.LlamaFileType.MOSTLY_Q4_K_M}

QWEN_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
LLAMA3_SPECIALS = ("<|begin_of_text|>", "<|end_of_text|>", "<|reserved_special_token_0|>",
                   "<|reserved_special_token_1|>", "<|finetune_right_pad_id|>", "<|reserved_special_token_2|>",
                   "<|start_header_id|>", "<|end_header_id|>", "<|eom_id|>", "<|eot_id|>", "<|python_tag|>")
CHATML_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content']"
    " + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
LLAMA3_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'"
    " + message['content'] + '<|eot_id|>' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)


@dataclass(frozen=True)
class Shape:
    """One model's hyper-parameters (names as in worker/model_file.ModelConfig)."""

    arch: str                 # "qwen3" | "llama"
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    ffn: int
    vocab: int
    tied: bool                # no output.weight: token_embd is the output head
    rope_base: float
    norm_eps: float
    ctx: int                  # trained context length
    specials: tuple[str, ...]  # named control tokens, first ids of the special block
    n_special: int            # control tokens at the end of the vocabulary (named + reserved)
    bos: str                  # bos / eos token texts
    eos: str
    add_bos: bool
    pre: str                  # tokenizer.ggml.pre
    template: str
    llama3_rope: bool = False  # write rope_freqs.weight with Llama-3's frequency factors


SHAPES: dict[str, Shape] = {
    "qwen3-0.6b": Shape("qwen3", 1024, 28, 16, 8, 128, 3072, 151936, True, 1e6, 1e-6, 40960,
                        QWEN_SPECIALS, 151936 - 151643, "<|endoftext|>", "<|im_end|>", False, "qwen2",
                        CHATML_TEMPLATE),
    "qwen3-8b": Shape("qwen3", 4096, 36, 32, 8, 128, 12288, 151936, False, 1e6, 1e-6, 40960,
                      QWEN_SPECIALS, 151936 - 151643, "<|endoftext|>", "<|im_end|>", False, "qwen2",
                      CHATML_TEMPLATE),
    "llama-3.2-1b": Shape("llama", 2048, 16, 32, 8, 64, 8192, 128256, True, 5e5, 1e-5, 131072,
                          LLAMA3_SPECIALS, 256, "<|begin_of_text|>", "<|eot_id|>", True, "llama-bpe",
                          LLAMA3_TEMPLATE, llama3_rope=True),
    # test shapes: K-quant rows need multiples of 256; tiny has head_dim != dim / n_heads like Qwen3
    "tiny": Shape("qwen3", 256, 2, 4, 2, 128, 512, 1024, True, 1e6, 1e-6, 4096,
                  QWEN_SPECIALS, 3, "<|endoftext|>", "<|im_end|>", False, "qwen2", CHATML_TEMPLATE),
    "tiny-llama": Shape("llama", 256, 2, 4, 2, 64, 512, 1024, False, 5e5, 1e-5, 4096,
                        LLAMA3_SPECIALS, 16, "<|begin_of_text|>", "<|eot_id|>", True, "llama-bpe",
                        LLAMA3_TEMPLATE, llama3_rope=True),
}


# ---------------------------------------------------------------- tensor plan


@dataclass(frozen=True)
class TensorSpec:
    name: str
    ggml_type: str        # "F32" | "F16" | "BF16" | "Q8_0" | "Q4_K" | "Q6_K"
    shape: tuple[int, ...]  # numpy order: (n_out, n_in) for matrices, (n,) for vectors
    kind: str             # "matrix" | "norm" | "rope_freqs"

    @property
    def nbytes(self) -> int:
        block, size = gguf.GGML_QUANT_SIZES[T[self.ggml_type]]
        return math.prod(self.shape) // block * size


def use_more_bits(i_layer: int, n_layers: int) -> bool:
    """llama.cpp's rule for the layers whose attn_v / ffn_down get more bits in *_K_M."""
    return i_layer < n_layers // 8 or i_layer >= 7 * n_layers // 8 or (i_layer - n_layers // 8) % 3 == 2


def matrix_type(ftype: str, name: str, i_layer: int, n_layers: int, tied: bool) -> str:
    """Storage type of one matrix in a file of type `ftype` (the module docstring has the rule)."""
    if ftype != "Q4_K_M":
        return ftype
    if name == "output.weight" or (tied and name == "token_embd.weight"):
        return "Q6_K"
    if name.endswith(("attn_v.weight", "ffn_down.weight")) and use_more_bits(i_layer, n_layers):
        return "Q6_K"
    return "Q4_K"


def tensor_plan(shape: Shape, ftype: str) -> list[TensorSpec]:
    """Every tensor of the file, in file order (llama.cpp's converter order)."""
    s, n = shape, shape.n_layers
    q_dim, kv_dim = s.n_heads * s.head_dim, s.n_kv_heads * s.head_dim

    def mat(name: str, n_out: int, n_in: int, il: int = -1) -> TensorSpec:
        return TensorSpec(name, matrix_type(ftype, name, il, n, s.tied), (n_out, n_in), "matrix")

    def vec(name: str, size: int, kind: str = "norm") -> TensorSpec:
        return TensorSpec(name, "F32", (size,), kind)

    plan = [mat("token_embd.weight", s.vocab, s.dim), vec("output_norm.weight", s.dim)]
    if not s.tied:
        plan.append(mat("output.weight", s.vocab, s.dim))
    if s.llama3_rope:
        plan.append(vec("rope_freqs.weight", s.head_dim // 2, "rope_freqs"))
    for il in range(n):
        p = f"blk.{il}."
        plan += [vec(p + "attn_norm.weight", s.dim), mat(p + "attn_q.weight", q_dim, s.dim, il),
                 mat(p + "attn_k.weight", kv_dim, s.dim, il), mat(p + "attn_v.weight", kv_dim, s.dim, il)]
        if s.arch == "qwen3":
            plan += [vec(p + "attn_q_norm.weight", s.head_dim), vec(p + "attn_k_norm.weight", s.head_dim)]
        plan += [mat(p + "attn_output.weight", s.dim, q_dim, il), vec(p + "ffn_norm.weight", s.dim),
                 mat(p + "ffn_gate.weight", s.ffn, s.dim, il), mat(p + "ffn_up.weight", s.ffn, s.dim, il),
                 mat(p + "ffn_down.weight", s.dim, s.ffn, il)]
    for t in plan:
        block = gguf.GGML_QUANT_SIZES[T[t.ggml_type]][0]
        if t.shape[-1] % block:
            raise ValueError(f"{t.name}: {t.ggml_type} rows need a multiple of {block} elements, got {t.shape[-1]}")
    return plan


def llama3_rope_factors(head_dim: int, base: float, factor: float = 32.0, low: float = 1.0, high: float = 4.0,
                        original_ctx: int = 8192) -> np.ndarray:
    """Llama-3's per-frequency divisors [head_dim / 2] (rope_freqs.weight): 1 for short
    wavelengths, `factor` for long ones, a smooth blend between."""
    freqs = base ** -(np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    wavelen = 2 * np.pi / freqs
    smooth = (original_ctx / wavelen - low) / (high - low)
    out = 1.0 / ((1 - smooth) / factor + smooth)
    out = np.where(wavelen < original_ctx / high, 1.0, np.where(wavelen > original_ctx / low, factor, out))
    return out.astype(np.float32)


# ---------------------------------------------------------------- random pools

# Block layouts (bytes in file order), see ggml's block_q8_0 / block_q4_K / block_q6_K:
#   Q8_0 (34):  d f16, qs[32] int8
#   Q4_K (144): d f16, dmin f16, scales[12] (8 x 6-bit scale, 8 x 6-bit min), qs[128] (4-bit)
#   Q6_K (210): ql[128], qh[64], scales[16] int8, d f16
_D_OFFSET = {"Q8_0": 0, "Q4_K": 0, "Q6_K": 208}
_DMIN_RATIO = 7.5  # Q4_K: dmin = 7.5 d puts the block mean near 0 (E[s] = E[m], E[q] = 7.5)


@dataclass
class _Pools:
    """One pool of random units per storage type; tensors are slices at random offsets."""

    rng: np.random.Generator
    max_units: dict[str, int]          # pool length per type (units: elements or blocks)
    pools: dict[str, np.ndarray] = field(default_factory=dict)

    def _make(self, ggml_type: str, n: int) -> np.ndarray:
        if ggml_type in ("F16", "BF16"):
            x = _normal(self.rng, n) * np.float32(STD)
            if ggml_type == "F16":
                return x.astype(np.float16)
            u = x.view(np.uint32)
            return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)  # round to nearest even
        return _quant_blocks(self.rng, ggml_type, n)

    def take(self, ggml_type: str, n_units: int) -> np.ndarray:
        """n_units consecutive units starting at a random offset (wrapping around the pool)."""
        pool = self.pools.get(ggml_type)
        if pool is None:
            pool = self.pools[ggml_type] = self._make(ggml_type, self.max_units[ggml_type])
        size = len(pool)
        if n_units <= size:
            start = int(self.rng.integers(0, size - n_units + 1))
            return pool[start:start + n_units]
        start, parts, left = int(self.rng.integers(0, size)), [], n_units
        while left:
            k = min(left, size - start)
            parts.append(pool[start:start + k])
            left -= k
            start = 0
        return np.concatenate(parts)


def _random_bytes(rng: np.random.Generator, n: int) -> np.ndarray:
    """n random bytes (writable), straight from the bit generator: ~10x faster than rng.bytes."""
    return rng.bit_generator.random_raw((n + 7) // 8).view(np.uint8)[:n]


def _normal(rng: np.random.Generator, n: int) -> np.ndarray:
    """n standard-normal float32 values, fast: 16 random bits index a table of 65536 sorted
    normal draws (an empirical inverse CDF), ~10x faster than rng.standard_normal."""
    table = np.sort(rng.standard_normal(1 << 16, dtype=np.float32))
    return table[_random_bytes(rng, 2 * n).view(np.uint16)]


def _quant_blocks(rng: np.random.Generator, ggml_type: str, n: int) -> np.ndarray:
    """n random blocks [n, block_bytes] of ggml_type whose dequantized values have spread STD."""
    size = gguf.GGML_QUANT_SIZES[T[ggml_type]][1]
    probe_n = 256
    probe = _random_bytes(rng, probe_n * size).reshape(probe_n, size)
    _set_scales(probe, ggml_type, np.ones(probe_n, np.float32))
    values = gguf.quants.dequantize(probe, T[ggml_type]).astype(np.float64)
    unit_std = float(np.sqrt(np.mean(values**2)))
    blocks = _random_bytes(rng, n * size).reshape(n, size)
    d = (STD / unit_std) * rng.uniform(0.5, 1.5, size=n).astype(np.float32)
    _set_scales(blocks, ggml_type, d)
    return blocks


def _set_scales(blocks: np.ndarray, ggml_type: str, d: np.ndarray) -> None:
    """Writes the fp16 d (and Q4_K's dmin) fields of blocks [n, block_bytes] in place."""
    o = _D_OFFSET[ggml_type]
    d16 = d.astype(np.float16)
    if not (np.isfinite(d16).all() and (d16 > 0).all()):
        raise ValueError(f"{ggml_type}: block scales must be finite and positive")
    blocks[:, o:o + 2] = d16.reshape(-1, 1).view(np.uint8)
    if ggml_type == "Q4_K":
        blocks[:, 2:4] = (d * _DMIN_RATIO).astype(np.float16).reshape(-1, 1).view(np.uint8)


def _units(t: TensorSpec) -> int:
    """Pool units a matrix takes: elements (F16, BF16) or blocks."""
    return math.prod(t.shape) // gguf.GGML_QUANT_SIZES[T[t.ggml_type]][0]


# ---------------------------------------------------------------- tokenizer


def _byte_symbols() -> list[str]:
    """GPT-2's byte-level alphabet: byte b -> one printable character (space -> 'Ġ')."""
    keep = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    out, extra = [], 0
    for b in range(256):
        if b in keep:
            out.append(chr(b))
        else:
            out.append(chr(256 + extra))
            extra += 1
    return out


MAX_MERGES = 4096


@functools.lru_cache(maxsize=4)
def vocabulary(shape: Shape) -> tuple[list[str], list[int], list[str]]:
    """(tokens, token types, merges) of exactly shape.vocab tokens (module docstring); cached:
    callers must not modify the lists."""
    n_regular = shape.vocab - shape.n_special
    n_merges = n_regular - 256
    if n_merges < 0 or shape.n_special < len(shape.specials):
        raise ValueError(f"vocab {shape.vocab} too small for 256 byte tokens and {shape.n_special} specials")
    base = ["\u0120"] + [chr(c) for c in range(ord("a"), ord("z") + 1)] + \
        [chr(c) for c in range(ord("A"), ord("Z") + 1)] + [chr(c) for c in range(ord("0"), ord("9") + 1)]
    tokens = _byte_symbols()
    known = set(tokens)
    frontier = base
    while len(tokens) < n_regular:  # breadth-first: every left part was made (or is a symbol) before
        nxt = []
        for a in frontier:
            for b in base:
                if len(tokens) == n_regular:
                    break
                if a + b not in known:
                    known.add(a + b)
                    tokens.append(a + b)
                    nxt.append(a + b)
        frontier = nxt
    # merges for the first MAX_MERGES merged tokens only: later tokens stay unreachable by BPE
    # (legal), and a short list keeps gguf's reader fast (it parses ~30k strings a second)
    merges = [f"{t[:-1]} {t[-1]}" for t in tokens[256:256 + min(n_merges, MAX_MERGES)]]
    specials = list(shape.specials)
    specials += [f"<|reserved_special_token_{i}|>" for i in range(len(specials), shape.n_special)]
    types = [gguf.TokenType.NORMAL] * len(tokens) + [gguf.TokenType.CONTROL] * len(specials)
    tokens += specials
    assert len(tokens) == shape.vocab and len(set(tokens)) == shape.vocab
    return tokens, [int(t) for t in types], merges


def _add_tokenizer(w: gguf.GGUFWriter, shape: Shape) -> None:
    tokens, types, merges = vocabulary(shape)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(shape.pre)
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(tokens.index(shape.bos))
    w.add_eos_token_id(tokens.index(shape.eos))
    w.add_pad_token_id(tokens.index(shape.bos) if shape.arch == "qwen3" else tokens.index(shape.eos))
    w.add_add_bos_token(shape.add_bos)
    w.add_chat_template(shape.template)


# ---------------------------------------------------------------- writing


class _Writer(gguf.GGUFWriter):
    """GGUFWriter whose metadata arrays of strings or ints (the tokenizer's 150k-entry lists)
    are packed in one pass: gguf packs item by item, ~10 s per file for a Qwen vocabulary."""

    def _pack_val(self, val, vtype, add_vtype, sub_type=None):  # type: ignore[override]
        V = gguf.GGUFValueType
        if vtype == V.ARRAY and sub_type is None and isinstance(val, list) and len(val) > 1000:
            head = struct.pack("<I", int(V.ARRAY)) if add_vtype else b""
            if all(type(x) is str for x in val):
                enc = [x.encode("utf-8") for x in val]
                body = b"".join(struct.pack("<Q", len(e)) + e for e in enc)
                return head + struct.pack("<IQ", int(V.STRING), len(val)) + body
            if all(type(x) is int for x in val):
                return head + struct.pack("<IQ", int(V.INT32), len(val)) + np.asarray(val, "<i4").tobytes()
        return super()._pack_val(val, vtype, add_vtype, sub_type)



def resolve_shape(name: str, layers: int | None = None) -> Shape:
    if name not in SHAPES:
        raise ValueError(f"unknown shape {name!r}; known: {', '.join(SHAPES)}")
    shape = SHAPES[name]
    if layers is not None:
        if not 1 <= layers <= shape.n_layers:
            raise ValueError(f"--layers must be in 1..{shape.n_layers} for {name}, got {layers}")
        shape = replace(shape, n_layers=layers)
    return shape


def default_filename(shape_name: str, ftype: str, layers: int | None = None) -> str:
    return f"{shape_name}{f'-L{layers}' if layers else ''}-{ftype}.random.gguf"


def write_model(path: str | os.PathLike, shape_name: str, ftype: str, *, layers: int | None = None,
                seed: int = 0, pool_mib: float = 64, progress: bool = False) -> Path:
    """Writes a random-weight model of shape `shape_name` (optionally its first `layers`
    blocks) stored as `ftype` to `path`; returns the path. Written to PATH.part, then renamed."""
    if ftype not in TYPES:
        raise ValueError(f"unknown type {ftype!r}; known: {', '.join(TYPES)}")
    shape = resolve_shape(shape_name, layers)
    plan = tensor_plan(shape, ftype)
    path = Path(path)
    part = path.with_name(path.name + ".part")
    rng = np.random.default_rng(seed)

    # pool length per storage type: its total, capped at pool_mib MiB
    need: dict[str, int] = {}
    for t in plan:
        if t.kind == "matrix":
            need[t.ggml_type] = need.get(t.ggml_type, 0) + _units(t)
    unit_bytes = {k: gguf.GGML_QUANT_SIZES[T[k]][1] for k in need}
    cap = {k: min(n, max(1, int(pool_mib * 2**20) // unit_bytes[k])) for k, n in need.items()}
    pools = _Pools(rng, cap)

    w = _Writer(part, shape.arch)
    w.add_type("model")
    w.add_name(f"{shape_name}{f' ({layers} layers)' if layers else ''} random {ftype}")
    w.add_file_type(int(_FILE_TYPE[ftype]))
    if ftype.startswith("Q"):
        w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    w.add_block_count(shape.n_layers)
    w.add_context_length(shape.ctx)
    w.add_embedding_length(shape.dim)
    w.add_feed_forward_length(shape.ffn)
    w.add_head_count(shape.n_heads)
    w.add_head_count_kv(shape.n_kv_heads)
    w.add_key_length(shape.head_dim)
    w.add_value_length(shape.head_dim)
    w.add_layer_norm_rms_eps(shape.norm_eps)
    w.add_rope_freq_base(shape.rope_base)
    w.add_rope_dimension_count(shape.head_dim)
    w.add_vocab_size(shape.vocab)
    w.add_string("specd.random.shape", shape_name)
    w.add_string("specd.random.type", ftype)
    w.add_uint64("specd.random.seed", seed)
    _add_tokenizer(w, shape)

    for t in plan:
        if t.ggml_type in ("F32", "F16"):
            w.add_tensor_info(t.name, t.shape, np.dtype(np.float32 if t.ggml_type == "F32" else np.float16), t.nbytes)
        else:  # raw: shape given in elements (dtype not uint8, so gguf does not convert it)
            w.add_tensor_info(t.name, t.shape, np.dtype(np.float32), t.nbytes, raw_dtype=T[t.ggml_type])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()

    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=sum(t.nbytes for t in plan), unit="B", unit_scale=True, desc=path.name, leave=True)
    try:
        for t in plan:
            if t.kind == "norm":
                data = (1.0 + STD * rng.standard_normal(t.shape)).astype(np.float32)
            elif t.kind == "rope_freqs":
                data = llama3_rope_factors(shape.head_dim, shape.rope_base)
            else:
                data = pools.take(t.ggml_type, _units(t))
            assert data.nbytes == t.nbytes, (t.name, data.nbytes, t.nbytes)
            w.write_tensor_data(data)
            if bar is not None:
                bar.update(t.nbytes)
    finally:
        w.close()
        if bar is not None:
            bar.close()
    os.replace(part, path)
    return path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 epilog=f"shapes: {', '.join(SHAPES)}; types: {', '.join(TYPES)}")
    ap.add_argument("pairs", nargs="+", metavar="SHAPE TYPE", help="one or more shape/type pairs")
    ap.add_argument("-o", "--out-dir", type=Path, default=Path("."))
    ap.add_argument("--layers", type=int, default=None, help="keep only the first N blocks")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--pool-mib", type=float, default=64, help="random pool per storage type (MiB)")
    ap.add_argument("--force", action="store_true", help="overwrite existing files")
    ap.add_argument("-q", "--quiet", action="store_true")
    ap.add_argument("--dry-run", action="store_true", help="print each file's tensor bytes, write nothing")
    args = ap.parse_args(argv)
    if len(args.pairs) % 2:
        ap.error("give shape/type pairs, e.g. qwen3-0.6b Q4_K_M")
    if not args.dry_run:
        args.out_dir.mkdir(parents=True, exist_ok=True)
    for shape_name, ftype in zip(args.pairs[::2], args.pairs[1::2]):
        path = args.out_dir / default_filename(shape_name, ftype, args.layers)
        if args.dry_run:
            try:
                plan = tensor_plan(resolve_shape(shape_name, args.layers), ftype)
            except (ValueError, KeyError) as exc:
                print(f"error: {exc}", file=sys.stderr)
                return 2
            print(sum(t.nbytes for t in plan), path)
            continue
        if path.exists() and not args.force:
            print(f"exists, kept: {path}", flush=True)
            continue
        try:
            write_model(path, shape_name, ftype, layers=args.layers, seed=args.seed, pool_mib=args.pool_mib,
                        progress=not args.quiet)
        except ValueError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        print(f"wrote {path} ({path.stat().st_size / 1e9:.2f} GB)", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
