"""The float64 numpy reference forward pass of the llama family (llama, qwen2, qwen3).

It owns the oracle the engine's whole-model logits are compared with, so it shares no code
with the engine: weights are read with `gguf.GGUFReader`, dequantized with
`gguf.quants.dequantize` (float32 values, exact for every stored type), and every operation
after that is float64. `kv_round="f16"` rounds K (after RoPE) and V to float16 before
attention, as the engine's default fp16 KV cache does, so the cache's own error can be told
apart from the rest.

Conventions (GGUF / ggml):
- a matrix with ne = [n_in, n_out] reads as a numpy array (n_out, n_in): y = x @ W.T;
- RoPE "normal" (llama) rotates adjacent pairs (x[2i], x[2i+1]), "neox" (qwen2, qwen3)
  rotates (x[i], x[i + d/2]), with theta_i = pos * freq_scale * base^(-2i/d) / factor_i,
  d = rope.dimension_count; dims past d pass through unrotated.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import gguf
import numpy as np

ARCHS = ("llama", "qwen2", "qwen3")


def _field(reader: gguf.GGUFReader, key: str, default=None):
    f = reader.fields.get(key)
    if f is None:
        return default
    return f.contents()


@dataclass(frozen=True)
class RefConfig:
    arch: str
    n_layers: int
    dim: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    ffn_dim: int
    n_vocab: int
    norm_eps: float
    rope_dims: int
    rope_base: float
    rope_scale: float  # multiplies positions: 1 / linear scaling factor
    rope_mode: str  # "normal" | "neox"


def read_config(reader: gguf.GGUFReader) -> RefConfig:
    arch = _field(reader, "general.architecture")
    if arch not in ARCHS:
        raise ValueError(f"reference model supports {ARCHS}, file has {arch!r}")

    def need(key: str):
        v = _field(reader, f"{arch}.{key}")
        if v is None:
            raise ValueError(f"GGUF metadata lacks {arch}.{key}")
        return v

    dim = int(need("embedding_length"))
    n_heads = int(need("attention.head_count"))
    head_dim = int(_field(reader, f"{arch}.attention.key_length", dim // n_heads))
    n_vocab = _field(reader, f"{arch}.vocab_size")
    if n_vocab is None:
        n_vocab = len(reader.fields["tokenizer.ggml.tokens"].data)
    scale = 1.0
    scaling_type = _field(reader, f"{arch}.rope.scaling.type", "none")
    if scaling_type == "linear":
        scale = 1.0 / float(need("rope.scaling.factor"))
    elif scaling_type not in ("none", None):
        raise ValueError(f"reference model does not implement rope scaling {scaling_type!r}")
    elif _field(reader, f"{arch}.rope.scale_linear") is not None:  # older files
        scale = 1.0 / float(need("rope.scale_linear"))
    return RefConfig(
        arch=arch,
        n_layers=int(need("block_count")),
        dim=dim,
        n_heads=n_heads,
        n_kv_heads=int(_field(reader, f"{arch}.attention.head_count_kv", n_heads)),
        head_dim=head_dim,
        ffn_dim=int(need("feed_forward_length")),
        n_vocab=int(n_vocab),
        norm_eps=float(need("attention.layer_norm_rms_epsilon")),
        rope_dims=int(_field(reader, f"{arch}.rope.dimension_count", head_dim)),
        rope_base=float(_field(reader, f"{arch}.rope.freq_base", 10000.0)),
        rope_scale=scale,
        rope_mode="normal" if arch == "llama" else "neox",
    )


# ---- the ops, float64 ----

def rmsnorm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    """x: [..., d] float64; w: [d]. x / sqrt(mean(x^2) + eps) * w."""
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def rope(x: np.ndarray, pos: np.ndarray, cfg: RefConfig, factors: np.ndarray | None) -> np.ndarray:
    """x: [n, heads, head_dim]; pos: [n] absolute positions. Returns a rotated copy."""
    d = cfg.rope_dims
    half = d // 2
    inv = cfg.rope_base ** (-2.0 * np.arange(half, dtype=np.float64) / d)  # [d/2]
    if factors is not None:
        inv = inv / factors
    theta = (pos.astype(np.float64) * cfg.rope_scale)[:, None] * inv[None, :]  # [n, d/2]
    cos = np.cos(theta)[:, None, :]  # [n, 1, d/2]
    sin = np.sin(theta)[:, None, :]
    out = x.copy()
    if cfg.rope_mode == "normal":
        x0, x1 = x[..., 0:d:2], x[..., 1:d:2]
        out[..., 0:d:2] = x0 * cos - x1 * sin
        out[..., 1:d:2] = x0 * sin + x1 * cos
    else:
        x0, x1 = x[..., :half], x[..., half:d]
        out[..., :half] = x0 * cos - x1 * sin
        out[..., half:d] = x0 * sin + x1 * cos
    return out


def causal_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray) -> np.ndarray:
    """q: [n, H, hd]; k, v: [n, Hkv, hd]; query head h reads KV head h // (H / Hkv).
    Returns [n, H, hd]; position i attends to positions 0..i, scores scaled by 1/sqrt(hd)."""
    n, n_heads, hd = q.shape
    group = n_heads // k.shape[1]
    kk = np.repeat(k, group, axis=1).transpose(1, 2, 0)  # [H, hd, n]
    vv = np.repeat(v, group, axis=1).transpose(1, 0, 2)  # [H, n, hd]
    s = np.matmul(q.transpose(1, 0, 2), kk) / math.sqrt(hd)  # [H, n, n]
    s = np.where(np.tril(np.ones((n, n), dtype=bool))[None], s, -np.inf)
    s = s - s.max(axis=-1, keepdims=True)
    p = np.exp(s)
    p /= p.sum(axis=-1, keepdims=True)
    return np.matmul(p, vv).transpose(1, 0, 2)  # [n, H, hd]


def silu(x: np.ndarray) -> np.ndarray:
    return x / (1.0 + np.exp(-x))


# ---- the model ----

class ReferenceModel:
    """Float64 forward pass over a GGUF file's dequantized weights.

    Weights are kept as their exact float32 dequantized values (half the memory of float64)
    and widened to float64 at each use; every product and sum is float64.
    """

    def __init__(self, path: str, kv_round: str | None = None):
        if kv_round not in (None, "f16", "f32"):
            raise ValueError(f"kv_round must be None, 'f16' or 'f32', got {kv_round!r}")
        self.kv_round = kv_round
        reader = gguf.GGUFReader(path)
        self.cfg = read_config(reader)
        self.w: dict[str, np.ndarray] = {}
        for t in reader.tensors:
            vals = gguf.quants.dequantize(np.asarray(t.data), t.tensor_type)
            n_in = int(t.shape[0])
            self.w[t.name] = np.array(vals, dtype=np.float32).reshape(-1, n_in) if len(t.shape) > 1 \
                else np.array(vals, dtype=np.float32).reshape(-1)
        del reader
        c = self.cfg
        self.tied = "output.weight" not in self.w
        emb = self.w["token_embd.weight"]
        if emb.shape != (c.n_vocab, c.dim):
            raise ValueError(f"token_embd.weight is {emb.shape}, expected {(c.n_vocab, c.dim)}")
        self.rope_factors = self.w.get("rope_freqs.weight")
        if self.rope_factors is not None:
            self.rope_factors = self.rope_factors.astype(np.float64)
            if self.rope_factors.shape != (c.rope_dims // 2,):
                raise ValueError(f"rope_freqs.weight is {self.rope_factors.shape}, expected ({c.rope_dims // 2},)")

    def _t(self, name: str) -> np.ndarray:
        return self.w[name].astype(np.float64)

    def _linear(self, x: np.ndarray, name: str, bias: bool = False) -> np.ndarray:
        y = x @ self._t(name).T
        if bias and name.replace(".weight", ".bias") in self.w:
            y = y + self._t(name.replace(".weight", ".bias"))
        return y

    @staticmethod
    def _round_kv(x: np.ndarray, kv_round: str | None) -> np.ndarray:
        if kv_round == "f16":
            return x.astype(np.float16).astype(np.float64)
        if kv_round == "f32":
            return x.astype(np.float32).astype(np.float64)
        return x

    def logits(self, tokens, kv_round: str | None = "default") -> np.ndarray:
        """tokens: [n] ids at positions 0..n-1. Returns float64 [n, n_vocab].
        kv_round overrides the model's setting for this call (None, "f16" or "f32")."""
        c = self.cfg
        if kv_round == "default":
            kv_round = self.kv_round
        if kv_round not in (None, "f16", "f32"):
            raise ValueError(f"kv_round must be None, 'f16' or 'f32', got {kv_round!r}")
        tokens = np.asarray(tokens, dtype=np.int64)
        if tokens.ndim != 1 or tokens.size == 0:
            raise ValueError("tokens must be a non-empty 1-D sequence")
        if tokens.min() < 0 or tokens.max() >= c.n_vocab:
            raise ValueError(f"token ids must be in [0, {c.n_vocab})")
        n = tokens.size
        pos = np.arange(n)
        h = self.w["token_embd.weight"][tokens].astype(np.float64)  # [n, dim]
        qwen2 = c.arch == "qwen2"
        for il in range(c.n_layers):
            p = f"blk.{il}."
            a = rmsnorm(h, self._t(p + "attn_norm.weight"), c.norm_eps)
            q = self._linear(a, p + "attn_q.weight", bias=qwen2).reshape(n, c.n_heads, c.head_dim)
            k = self._linear(a, p + "attn_k.weight", bias=qwen2).reshape(n, c.n_kv_heads, c.head_dim)
            v = self._linear(a, p + "attn_v.weight", bias=qwen2).reshape(n, c.n_kv_heads, c.head_dim)
            if c.arch == "qwen3":  # RMSNorm over each head's head_dim values
                q = rmsnorm(q, self._t(p + "attn_q_norm.weight"), c.norm_eps)
                k = rmsnorm(k, self._t(p + "attn_k_norm.weight"), c.norm_eps)
            q = rope(q, pos, c, self.rope_factors)
            k = self._round_kv(rope(k, pos, c, self.rope_factors), kv_round)
            v = self._round_kv(v, kv_round)
            o = causal_attention(q, k, v).reshape(n, c.n_heads * c.head_dim)
            h = h + self._linear(o, p + "attn_output.weight")
            f = rmsnorm(h, self._t(p + "ffn_norm.weight"), c.norm_eps)
            g = silu(self._linear(f, p + "ffn_gate.weight")) * self._linear(f, p + "ffn_up.weight")
            h = h + self._linear(g, p + "ffn_down.weight")
        h = rmsnorm(h, self._t("output_norm.weight"), c.norm_eps)
        return self._linear(h, "token_embd.weight" if self.tied else "output.weight")


# ---- metrics used by the exactness tests ----

def log_softmax(logits: np.ndarray) -> np.ndarray:
    x = np.asarray(logits, dtype=np.float64)
    m = x.max(axis=-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis=-1, keepdims=True))


def perplexity(logits: np.ndarray, tokens) -> float:
    """exp(mean NLL) of tokens[1:] given logits[:-1] (logits row i predicts token i+1)."""
    tokens = np.asarray(tokens)
    lp = log_softmax(logits[:-1])
    nll = -lp[np.arange(len(tokens) - 1), tokens[1:]]
    return float(np.exp(nll.mean()))


def rel_rms(got: np.ndarray, ref: np.ndarray) -> float:
    """RMS(got - ref) / RMS(ref)."""
    return float(np.sqrt(np.mean((got - ref) ** 2) / np.mean(ref**2)))
