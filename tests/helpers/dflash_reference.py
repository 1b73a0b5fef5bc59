"""The float64 numpy reference of the DFlash block drafter, written from DFLASH.md.

It is the oracle the C++ DFlash forward is compared with, so it shares no code with the
engine or the converter: it reads the checkpoint's own names (`fc.weight`,
`layers.i.self_attn.q_proj.weight`, ...) and its HF `config.json` dict, and recomputes
every step from scratch in float64 (no draft KV cache: the engine's incremental cache
must give the same answer).

The maths (DFLASH.md):
- context features: the target's residual stream after each layer of target_layer_ids,
  concatenated per position, then ctx = hidden_norm(fc(features));
- block input: target embeddings of [last token, MASK x (B-1)] x input_embedding_scale;
- per layer: h = input_layernorm(x); q = q_norm(q_proj(h)) per head; keys k_norm(k_proj(.))
  and values v_proj(.) over [ctx; h]; RoPE (neox: rotate halves) with the context
  positions then the block positions; attention of every block query over all keys
  (non-causal), or causal/windowed where the config says so; o_proj; residual;
  post_attention_layernorm; SwiGLU MLP; residual;
- norm, the target's head, x output_multiplier, optional tanh soft-cap.

`target_hidden_states` gives the context features from tests/helpers/reference.py's
float64 target model.
"""

from __future__ import annotations

import math

import numpy as np

from tests.helpers import reference as ref


def _rms(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def _rope_neox(x: np.ndarray, pos: np.ndarray, base: float, scale: float) -> np.ndarray:
    """x: [n, heads, hd]; rotates (x[i], x[i + hd/2]) by pos * scale * base^(-2i/hd)."""
    hd = x.shape[-1]
    half = hd // 2
    inv = base ** (-2.0 * np.arange(half, dtype=np.float64) / hd)
    theta = (pos.astype(np.float64) * scale)[:, None, None] * inv[None, None, :]  # [n, 1, hd/2]
    c, s = np.cos(theta), np.sin(theta)
    a, b = x[..., :half], x[..., half:]
    return np.concatenate([a * c - b * s, a * s + b * c], axis=-1)


def _round(x: np.ndarray, kv_round: str | None) -> np.ndarray:
    if kv_round == "f16":
        return x.astype(np.float16).astype(np.float64)
    if kv_round == "f32":
        return x.astype(np.float32).astype(np.float64)
    return x


class DFlashReference:
    """config: the checkpoint's config.json dict; weights: its tensors by safetensors name
    (any float dtype; matrices [out, in] as torch stores them)."""

    def __init__(self, config: dict, weights: dict[str, np.ndarray]):
        self.cfg = config
        d = config.get("dflash_config", {})
        self.w = {k: np.asarray(v, dtype=np.float64) for k, v in weights.items()}
        self.n_layers = config["num_hidden_layers"]
        self.dim = config["hidden_size"]
        self.n_heads = config["num_attention_heads"]
        self.n_kv = config.get("num_key_value_heads", self.n_heads)
        self.hd = config.get("head_dim") or self.dim // self.n_heads
        self.eps = config.get("rms_norm_eps", 1e-6)
        self.theta = config.get("rope_theta", 10000.0)
        self.block_size = d.get("block_size", 16)
        self.mask = d["mask_token_id"]
        self.layer_ids = list(d["target_layer_ids"])
        self.embd_scale = d.get("input_embedding_scale", 1.0)
        self.out_mult = d.get("output_multiplier", 1.0)
        self.softcap = d.get("final_logit_softcapping")
        types = config.get("layer_types") or ["full_attention"] * self.n_layers
        is_causal = config.get("is_causal")
        self.causal = [t == "sliding_attention" if is_causal is None else bool(is_causal) for t in types]
        self.window = [config.get("sliding_window") if t == "sliding_attention" else None for t in types]

    def _lin(self, x: np.ndarray, name: str) -> np.ndarray:
        y = x @ self.w[name + ".weight"].T
        if name + ".bias" in self.w:
            y = y + self.w[name + ".bias"]
        return y

    def context(self, features: np.ndarray) -> np.ndarray:
        """features [n, m, target_dim] (or [n, m * target_dim], layers concatenated in
        target_layer_ids order) -> ctx [n, dim] = hidden_norm(fc(features))."""
        f = np.asarray(features, np.float64)
        f = f.reshape(f.shape[0], -1)
        return _rms(f @ self.w["fc.weight"].T, self.w["hidden_norm.weight"], self.eps)

    def _visible(self, layer: int, qpos: np.ndarray, kpos: np.ndarray) -> np.ndarray:
        """[n_q, n_k] bool: which keys each block query attends to in this layer."""
        dq = qpos[:, None] - kpos[None, :]  # query pos - key pos
        vis = np.ones(dq.shape, dtype=bool)
        if self.causal[layer]:
            vis &= dq >= 0
        w = self.window[layer]
        if w is not None:
            vis &= dq < w
            if not self.causal[layer]:
                vis &= -dq < w
        return vis

    def hidden(self, features: np.ndarray, block_embd: np.ndarray, kv_round: str | None = None) -> np.ndarray:
        """features [P, m, target_dim] of positions 0..P-1; block_embd [B, dim] at positions
        P..P+B-1. Returns the block's hidden states after the final norm, [B, dim].
        kv_round rounds every K (after RoPE) and V to float16/float32, as a draft cache would."""
        P, B = features.shape[0], block_embd.shape[0]
        ctx = self.context(features)
        x = np.asarray(block_embd, np.float64)
        cpos, bpos = np.arange(P), np.arange(P, P + B)
        kpos = np.concatenate([cpos, bpos])
        group = self.n_heads // self.n_kv
        for il in range(self.n_layers):
            p = f"layers.{il}."
            h = _rms(x, self.w[p + "input_layernorm.weight"], self.eps)
            q = self._lin(h, p + "self_attn.q_proj").reshape(B, self.n_heads, self.hd)
            q = _rope_neox(_rms(q, self.w[p + "self_attn.q_norm.weight"], self.eps), bpos, self.theta, 1.0)
            kv_in = np.concatenate([ctx, h], axis=0)  # [P + B, dim]
            k = self._lin(kv_in, p + "self_attn.k_proj").reshape(P + B, self.n_kv, self.hd)
            k = _rope_neox(_rms(k, self.w[p + "self_attn.k_norm.weight"], self.eps), kpos, self.theta, 1.0)
            v = self._lin(kv_in, p + "self_attn.v_proj").reshape(P + B, self.n_kv, self.hd)
            k, v = _round(k, kv_round), _round(v, kv_round)
            kk = np.repeat(k, group, axis=1)  # [P+B, H, hd]
            vv = np.repeat(v, group, axis=1)
            s = np.einsum("qhd,khd->hqk", q, kk) / math.sqrt(self.hd)  # [H, B, P+B]
            s = np.where(self._visible(il, bpos, kpos)[None], s, -np.inf)
            s = s - s.max(axis=-1, keepdims=True)
            a = np.exp(s)
            a /= a.sum(axis=-1, keepdims=True)
            o = np.einsum("hqk,khd->qhd", a, vv).reshape(B, self.n_heads * self.hd)
            x = x + self._lin(o, p + "self_attn.o_proj")
            f = _rms(x, self.w[p + "post_attention_layernorm.weight"], self.eps)
            g = self._lin(f, p + "mlp.gate_proj")
            x = x + self._lin(g / (1.0 + np.exp(-g)) * self._lin(f, p + "mlp.up_proj"), p + "mlp.down_proj")
        return _rms(x, self.w["norm.weight"], self.eps)

    def block_input(self, embd: np.ndarray, last_token: int, B: int) -> np.ndarray:
        """[B, dim]: embd rows of [last_token, MASK x (B-1)] x input_embedding_scale."""
        ids = [last_token] + [self.mask] * (B - 1)
        return np.asarray(embd, np.float64)[ids] * self.embd_scale

    def logits(self, hidden: np.ndarray, head: np.ndarray) -> np.ndarray:
        out = hidden @ np.asarray(head, np.float64).T * self.out_mult
        if self.softcap:
            out = np.tanh(out / self.softcap) * self.softcap
        return out

    def draft_logits(self, features: np.ndarray, embd: np.ndarray, head: np.ndarray, last_token: int,
                     B: int | None = None, kv_round: str | None = None) -> np.ndarray:
        """Logits of block rows 1..B-1 (the draft tokens), [B-1, n_vocab]."""
        B = self.block_size if B is None else B
        h = self.hidden(features, self.block_input(embd, last_token, B), kv_round)
        return self.logits(h[1:], head)


def target_hidden_states(model: ref.ReferenceModel, tokens, layers: list[int],
                         kv_round: str | None = None) -> tuple[np.ndarray, np.ndarray]:
    """The float64 target forward of tests/helpers/reference.py over tokens (positions 0..n-1),
    also returning the residual stream after each block in `layers`.
    Returns (features [n, len(layers), dim], logits [n, n_vocab]); the logits let a test
    confirm this loop is the reference model's own."""
    c = model.cfg
    tokens = np.asarray(tokens, dtype=np.int64)
    n = tokens.size
    pos = np.arange(n)
    h = model.w["token_embd.weight"][tokens].astype(np.float64)
    taps: dict[int, np.ndarray] = {}
    for il in range(c.n_layers):
        p = f"blk.{il}."
        a = ref.rmsnorm(h, model._t(p + "attn_norm.weight"), c.norm_eps)
        bias = c.arch == "qwen2"
        q = model._linear(a, p + "attn_q.weight", bias=bias).reshape(n, c.n_heads, c.head_dim)
        k = model._linear(a, p + "attn_k.weight", bias=bias).reshape(n, c.n_kv_heads, c.head_dim)
        v = model._linear(a, p + "attn_v.weight", bias=bias).reshape(n, c.n_kv_heads, c.head_dim)
        if c.arch == "qwen3":
            q = ref.rmsnorm(q, model._t(p + "attn_q_norm.weight"), c.norm_eps)
            k = ref.rmsnorm(k, model._t(p + "attn_k_norm.weight"), c.norm_eps)
        q = ref.rope(q, pos, c, model.rope_factors)
        k = _round(ref.rope(k, pos, c, model.rope_factors), kv_round)
        v = _round(v, kv_round)
        o = ref.causal_attention(q, k, v).reshape(n, c.n_heads * c.head_dim)
        h = h + model._linear(o, p + "attn_output.weight")
        f = ref.rmsnorm(h, model._t(p + "ffn_norm.weight"), c.norm_eps)
        g = ref.silu(model._linear(f, p + "ffn_gate.weight")) * model._linear(f, p + "ffn_up.weight")
        h = h + model._linear(g, p + "ffn_down.weight")
        taps[il] = h.copy()
    out = ref.rmsnorm(h, model._t("output_norm.weight"), c.norm_eps)
    logits = out @ model._t("token_embd.weight" if model.tied else "output.weight").T
    return np.stack([taps[i] for i in layers], axis=1), logits
