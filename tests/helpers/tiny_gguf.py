"""Writes tiny, valid GGUF models (llama, qwen2, qwen3) with random weights for tests.

`write_tiny_model` owns the file layout: architecture metadata, one tensor per GGUF name,
matrices stored in the requested weight type, norms and biases F32, and a small byte-level
BPE tokenizer section so code that builds a tokenizer from any model file works on them.

Weight types: the ones `gguf.quants.quantize` writes (F32, F16, BF16, Q8_0, Q4_0, Q4_1,
Q5_0, Q5_1; rows must be a multiple of 32 elements) are quantized from Gaussian weights;
K-quants (Q4_K, Q5_K, Q6_K; rows a multiple of 256), which gguf cannot quantize, are written
as random blocks with fp16 scales chosen so the dequantized weights have the same spread.
Spreads: token_embd ~ N(0, 1) (the residual stream starts O(1)); every other matrix has
std 1/sqrt(fan_in), so each projection of an RMS-normalised input stays O(1).
"""

from __future__ import annotations

import os

import gguf
import numpy as np

T = gguf.GGMLQuantizationType
QUANTIZABLE = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1")
K_QUANTS = ("Q4_K", "Q5_K", "Q6_K")
WEIGHT_TYPES = QUANTIZABLE + K_QUANTS
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")  # ids 0, 1, 2 as in SmolLM2
CHAT_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content']"
    " + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
_BPE_TEXT = (
    "the quick brown fox jumps over the lazy dog while the other dogs sleep in the sun and "
    "then the fox runs into the forest where there are trees and rivers and many other things "
    "to see in the morning and in the evening the animals return to their homes"
)


def block_elems(weight_type: str) -> int:
    """Elements per block: a matrix row length must be a multiple of it."""
    return gguf.GGML_QUANT_SIZES[T[weight_type]][0]


# ---- tokenizer section ----

def _byte_symbols() -> list[str]:
    """GPT-2 byte-level alphabet: byte b -> one printable unicode character."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    sym, extra = {}, 0
    for b in range(256):
        if b in printable:
            sym[b] = chr(b)
        else:
            sym[b] = chr(256 + extra)
            extra += 1
    return [sym[b] for b in range(256)]


def _merges(n: int) -> list[tuple[str, str]]:
    """n BPE merges: learnt greedily from a short English text, then (if it runs out)
    pairs of lowercase letters, so every merge's parts and result are in the vocabulary."""
    sym = _byte_symbols()
    words = [[sym[b] for b in (w if i == 0 else " " + w).encode()] for i, w in enumerate(_BPE_TEXT.split())]
    merges: list[tuple[str, str]] = []
    known = set(sym)
    while len(merges) < n:
        counts: dict[tuple[str, str], int] = {}
        for w in words:
            for pair in zip(w, w[1:]):
                counts[pair] = counts.get(pair, 0) + 1
        if not counts:
            break
        best = min(counts, key=lambda p: (-counts[p], p))
        merges.append(best)
        known.add(best[0] + best[1])
        for w in words:
            i = 0
            while i < len(w) - 1:
                if (w[i], w[i + 1]) == best:
                    w[i : i + 2] = [best[0] + best[1]]
                i += 1
    letters = "etaoinshrdlcumwfgypbvkjxqz"
    for a in letters:
        for b in letters:
            if len(merges) >= n:
                return merges
            if a + b not in known:
                merges.append((a, b))
                known.add(a + b)
    if len(merges) < n:
        raise ValueError(f"cannot make {n} merges; use a smaller vocab")
    return merges


def _add_tokenizer(w: gguf.GGUFWriter, vocab: int) -> None:
    n_merges = vocab - len(SPECIAL_TOKENS) - 256
    if n_merges < 0:
        raise ValueError(f"vocab must be >= {len(SPECIAL_TOKENS) + 256} (specials + 256 bytes), got {vocab}")
    merges = _merges(n_merges)
    tokens = list(SPECIAL_TOKENS) + _byte_symbols() + [a + b for a, b in merges]
    assert len(tokens) == vocab and len(set(tokens)) == vocab
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(tokens)
    w.add_token_types([gguf.TokenType.CONTROL] * len(SPECIAL_TOKENS) + [gguf.TokenType.NORMAL] * (vocab - len(SPECIAL_TOKENS)))
    w.add_token_merges([f"{a} {b}" for a, b in merges])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_pad_token_id(2)
    w.add_add_bos_token(False)
    w.add_chat_template(CHAT_TEMPLATE)


# ---- weights ----

# K-quant block layouts (bytes, in file order), see ggml's block_q4_K / block_q5_K / block_q6_K:
#   Q4_K (144): d f16, dmin f16, scales[12] (8 x 6-bit scale + 8 x 6-bit min), qs[128]
#   Q5_K (176): d f16, dmin f16, scales[12], qh[32], qs[128]
#   Q6_K (210): ql[128], qh[64], scales[16] (int8), d f16
# value = d * scale * q - dmin * min  (Q4_K, Q5_K, q unsigned)  |  d * scale * (q - 32)  (Q6_K)
# dmin = mean(q) * d centres each type's values near zero.
_KQ = {"Q4_K": (144, 7.5), "Q5_K": (176, 15.5), "Q6_K": (210, 0.0)}


def _kquant_blocks(rng: np.random.Generator, weight_type: str, n_blocks: int, d: np.ndarray) -> np.ndarray:
    """Random blocks [n_blocks, block_bytes] with per-block fp16 scale d: [n_blocks]."""
    nbytes, dmin_ratio = _KQ[weight_type]
    blocks = rng.integers(0, 256, size=(n_blocks, nbytes), dtype=np.uint8)
    d16 = d.astype(np.float16).reshape(-1, 1).view(np.uint8)
    if weight_type == "Q6_K":
        blocks[:, 208:210] = d16
    else:
        blocks[:, 0:2] = d16
        blocks[:, 2:4] = (d * dmin_ratio).astype(np.float16).reshape(-1, 1).view(np.uint8)
    return blocks


def _kquant_matrix(rng: np.random.Generator, weight_type: str, n_out: int, n_in: int, std: float) -> np.ndarray:
    """Raw bytes [n_out, n_in / 256 * block_bytes] whose dequantized values have spread ~std."""
    if n_in % 256:
        raise ValueError(f"{weight_type} rows need a multiple of 256 elements, got {n_in}")
    n_blocks = n_out * n_in // 256
    # measure the spread of unit-scale blocks, then scale d (and dmin with it) to hit std
    probe = gguf.quants.dequantize(_kquant_blocks(rng, weight_type, 64, np.ones(64)), T[weight_type])
    unit_std = float(np.sqrt(np.mean(probe.astype(np.float64) ** 2)))
    d = std / unit_std * rng.uniform(0.5, 1.5, size=n_blocks)
    return _kquant_blocks(rng, weight_type, n_blocks, d).reshape(n_out, -1)


def _matrix(w: gguf.GGUFWriter, rng: np.random.Generator, name: str, weight_type: str,
            n_out: int, n_in: int, std: float) -> None:
    """Adds a [n_out, n_in] matrix (ne = [n_in, n_out]) stored as weight_type."""
    if weight_type in K_QUANTS:
        w.add_tensor(name, _kquant_matrix(rng, weight_type, n_out, n_in, std), raw_dtype=T[weight_type])
        return
    if n_in % block_elems(weight_type):
        raise ValueError(f"{name}: {weight_type} rows need a multiple of {block_elems(weight_type)} elements, got {n_in}")
    x = (rng.standard_normal((n_out, n_in)) * std).astype(np.float32)
    if weight_type == "F32":
        w.add_tensor(name, x)
    elif weight_type == "F16":
        w.add_tensor(name, x.astype(np.float16))
    else:
        w.add_tensor(name, gguf.quants.quantize(x, T[weight_type]), raw_dtype=T[weight_type])


def _vector(w: gguf.GGUFWriter, name: str, x: np.ndarray) -> None:
    w.add_tensor(name, np.ascontiguousarray(x, dtype=np.float32))


def write_tiny_model(
    path: str | os.PathLike,
    arch: str,
    weight_type: str,
    *,
    n_layers: int = 2,
    dim: int = 64,
    n_heads: int = 4,
    n_kv_heads: int = 2,
    head_dim: int | None = None,
    ffn: int = 96,
    vocab: int = 300,
    tied: bool = False,
    seed: int = 0,
    rope_freqs: bool = False,
    rope_dims: int | None = None,
    rope_base: float = 10000.0,
    rope_linear_factor: float | None = None,
    norm_eps: float = 1e-5,
    ctx: int = 256,
    embd_type: str | None = None,
) -> str:
    """Writes a random-weight model to `path` and returns the path.

    weight_type: every matrix's storage type (token_embd too, unless `embd_type` is given).
    head_dim: defaults to dim / n_heads; when different, `attention.key_length` and
    `value_length` are written (qwen3 style). rope_freqs (llama): adds `rope_freqs.weight`,
    per-frequency divisors in [1, 8]. rope_linear_factor: writes linear rope scaling.
    """
    if arch not in ("llama", "qwen2", "qwen3"):
        raise ValueError(f"arch must be llama, qwen2 or qwen3, got {arch!r}")
    if weight_type not in WEIGHT_TYPES:
        raise ValueError(f"weight_type must be one of {WEIGHT_TYPES}, got {weight_type!r}")
    if dim % n_heads or n_heads % n_kv_heads:
        raise ValueError("dim must be a multiple of n_heads, n_heads of n_kv_heads")
    hd = head_dim if head_dim is not None else dim // n_heads
    n_rot = rope_dims if rope_dims is not None else hd
    rng = np.random.default_rng(seed)
    embd_type = embd_type or weight_type

    w = gguf.GGUFWriter(os.fspath(path), arch)
    w.add_name(f"tiny-{arch}-{weight_type}")
    w.add_block_count(n_layers)
    w.add_context_length(ctx)
    w.add_embedding_length(dim)
    w.add_feed_forward_length(ffn)
    w.add_head_count(n_heads)
    w.add_head_count_kv(n_kv_heads)
    if hd != dim // n_heads:
        w.add_key_length(hd)
        w.add_value_length(hd)
    w.add_layer_norm_rms_eps(norm_eps)
    w.add_rope_freq_base(rope_base)
    w.add_rope_dimension_count(n_rot)
    if rope_linear_factor is not None:
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(rope_linear_factor)
    w.add_vocab_size(vocab)
    _add_tokenizer(w, vocab)

    _matrix(w, rng, "token_embd.weight", embd_type, vocab, dim, 1.0)
    _vector(w, "output_norm.weight", 1.0 + 0.2 * rng.standard_normal(dim))
    if not tied:
        # 4x the usual spread: logits with a clear winner make top-1 comparisons meaningful
        _matrix(w, rng, "output.weight", weight_type, vocab, dim, 4.0 / np.sqrt(dim))
    if rope_freqs:
        _vector(w, "rope_freqs.weight", rng.uniform(1.0, 8.0, size=n_rot // 2))
    q_dim, kv_dim = n_heads * hd, n_kv_heads * hd
    for il in range(n_layers):
        p = f"blk.{il}."
        _vector(w, p + "attn_norm.weight", 1.0 + 0.2 * rng.standard_normal(dim))
        _matrix(w, rng, p + "attn_q.weight", weight_type, q_dim, dim, 1.0 / np.sqrt(dim))
        _matrix(w, rng, p + "attn_k.weight", weight_type, kv_dim, dim, 1.0 / np.sqrt(dim))
        _matrix(w, rng, p + "attn_v.weight", weight_type, kv_dim, dim, 1.0 / np.sqrt(dim))
        if arch == "qwen2":
            _vector(w, p + "attn_q.bias", 0.5 * rng.standard_normal(q_dim))
            _vector(w, p + "attn_k.bias", 0.5 * rng.standard_normal(kv_dim))
            _vector(w, p + "attn_v.bias", 0.5 * rng.standard_normal(kv_dim))
        if arch == "qwen3":
            _vector(w, p + "attn_q_norm.weight", 1.0 + 0.2 * rng.standard_normal(hd))
            _vector(w, p + "attn_k_norm.weight", 1.0 + 0.2 * rng.standard_normal(hd))
        _matrix(w, rng, p + "attn_output.weight", weight_type, dim, q_dim, 1.0 / np.sqrt(q_dim))
        _vector(w, p + "ffn_norm.weight", 1.0 + 0.2 * rng.standard_normal(dim))
        _matrix(w, rng, p + "ffn_gate.weight", weight_type, ffn, dim, 1.0 / np.sqrt(dim))
        _matrix(w, rng, p + "ffn_up.weight", weight_type, ffn, dim, 1.0 / np.sqrt(dim))
        _matrix(w, rng, p + "ffn_down.weight", weight_type, dim, ffn, 1.0 / np.sqrt(ffn))

    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return os.fspath(path)
