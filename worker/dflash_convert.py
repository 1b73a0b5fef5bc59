"""The DFlash GGUF format (docs/dflash-gguf.md): converting a published checkpoint to it,
and reading its config back.

A DFlash drafter checkpoint is `config.json` (a qwen3-style config with a `dflash_config`
object) plus one or more `.safetensors` files. `convert()` writes one GGUF file of
architecture "dflash": the metadata of docs/dflash-gguf.md and every tensor renamed to
its GGUF name, matrices in the chosen type (f32, f16, bf16 or q8_0), norms F32. Tensors
are streamed one at a time, so memory stays at about one tensor. The safetensors format
(8-byte little-endian header length, a JSON header, raw little-endian data) is read here
with numpy memmaps; no torch or safetensors package is needed.

`read_dflash_config(metadata)` turns a DFlash GGUF's metadata back into the validated
`DFlashConfig` the native engine takes; `open_dflash(path)` opens such a file.

    python -m worker.dflash_convert CHECKPOINT_DIR -o drafter.gguf [--outtype bf16]

Every failure is a ModelLoadError saying what is wrong and what to do.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np

from worker.errors import ModelLoadError

ARCH = "dflash"
FORMAT_VERSION = 1  # dflash.format_version: bumped when the layout changes incompatibly
OUTTYPES = ("auto", "f32", "f16", "bf16", "q8_0")
_QT = gguf.GGMLQuantizationType

# ---------------------------------------------------------------- metadata keys

K_BLOCK_SIZE = f"{ARCH}.block_size"
K_MASK = f"{ARCH}.mask_token_id"
K_LAYER_IDS = f"{ARCH}.target_layer_ids"
K_TARGET_HIDDEN = f"{ARCH}.target_hidden_size"
K_EMBD_SCALE = f"{ARCH}.input_embedding_scale"
K_OUT_MULT = f"{ARCH}.output_multiplier"
K_SOFTCAP = f"{ARCH}.final_logit_softcapping"
K_VOCAB = f"{ARCH}.vocab_size"
K_LAYER_TYPES = f"{ARCH}.attention.layer_types"
K_CAUSAL = f"{ARCH}.attention.causal"
K_WINDOW = f"{ARCH}.attention.sliding_window"
K_FORMAT = f"{ARCH}.format_version"
LAYER_TYPES = ("full_attention", "sliding_attention")

# ---------------------------------------------------------------- tensor names

# safetensors name -> GGUF name; `{i}` is the layer index.
_GLOBAL_NAMES = {
    "fc.weight": "dflash_fc.weight",
    "hidden_norm.weight": "dflash_hidden_norm.weight",
    "norm.weight": "output_norm.weight",
}
_LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.bias": "attn_output.bias",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
_BIASES = ("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias", "self_attn.o_proj.bias")
_LAYER_RE = re.compile(r"^layers\.(\d+)\.(.+)$")
# Present in some checkpoints but unused: DFlash reads the target's embedding and head.
_IGNORED = ("embed_tokens.weight", "lm_head.weight")


def gguf_name(st_name: str) -> str | None:
    """The GGUF name of a safetensors tensor (None when it is not part of DFlash v1)."""
    if st_name.startswith("model."):
        st_name = st_name[len("model."):]
    if st_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[st_name]
    m = _LAYER_RE.match(st_name)
    if m and m.group(2) in _LAYER_NAMES:
        return f"blk.{int(m.group(1))}.{_LAYER_NAMES[m.group(2)]}"
    return None


# ---------------------------------------------------------------- the config


@dataclass(frozen=True)
class DFlashConfig:
    """A DFlash drafter's hyper-parameters; field names match the native config dict."""

    arch: str                 # always "dflash"
    n_layers: int
    dim: int                  # hidden size (= the target's embedding width)
    n_heads: int
    n_kv_heads: int
    head_dim: int
    ffn_dim: int
    n_vocab: int              # the vocabulary it was trained with (= the target's)
    n_ctx_train: int
    norm_eps: float
    rope_dims: int
    rope_base: float
    rope_scale: float         # position multiplier: 1 / linear scaling factor
    rope_mode: str            # always "neox" (qwen3 rotate-half)
    block_size: int           # positions per drafted block: 1 known token + block_size-1 masks
    mask_token_id: int
    target_layer_ids: tuple[int, ...]  # target blocks whose outputs are tapped, in fc order
    target_dim: int           # the target's hidden size
    input_embedding_scale: float
    output_multiplier: float
    logit_softcap: float      # 0 = off
    layer_causal: tuple[bool, ...]     # [n_layers]
    layer_window: tuple[int, ...]      # [n_layers] sliding window in positions, 0 = none

    def to_native(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["target_layer_ids"] = list(self.target_layer_ids)
        d["layer_causal"] = [bool(c) for c in self.layer_causal]
        d["layer_window"] = list(self.layer_window)
        return d

    @property
    def max_drafts(self) -> int:
        """Tokens one block can draft: block positions 1 .. block_size - 1."""
        return self.block_size - 1


def _fail(where: str, msg: str) -> ModelLoadError:
    return ModelLoadError(f"{where}: {msg}")


def read_dflash_config(md: dict[str, Any], where: str = "DFlash file") -> DFlashConfig:
    """The DFlashConfig of a DFlash GGUF's metadata (as decoded by GGUFReader field contents)."""
    if md.get("general.architecture") != ARCH:
        raise _fail(where, f"architecture is {md.get('general.architecture')!r}, expected {ARCH!r}")
    version = md.get(K_FORMAT, 1)
    if version != FORMAT_VERSION:
        raise _fail(where, f"{K_FORMAT} is {version}; this specd reads version {FORMAT_VERSION}; convert again")

    def get(key: str, kind: type = int, default: Any = None) -> Any:
        full = key if key.startswith(ARCH + ".") else f"{ARCH}.{key}"
        value = md.get(full, default)
        if value is None:
            raise _fail(where, f"metadata key {full!r} is missing; convert the checkpoint again")
        if kind is int and not (isinstance(value, int) and not isinstance(value, bool)):
            raise _fail(where, f"metadata key {full!r} should be an integer, got {value!r}")
        if kind is float and not isinstance(value, (int, float)):
            raise _fail(where, f"metadata key {full!r} should be a number, got {value!r}")
        if kind is list and not isinstance(value, list):
            raise _fail(where, f"metadata key {full!r} should be an array, got {value!r}")
        return value if kind is list else kind(value)

    n_layers = get("block_count")
    dim = get("embedding_length")
    n_heads = get("attention.head_count")
    head_dim = get("attention.key_length", default=dim // max(n_heads, 1))
    ids = get(K_LAYER_IDS, list)
    types = get(K_LAYER_TYPES, list, ["full_attention"] * n_layers)
    causal = get(K_CAUSAL, list, [t == "sliding_attention" for t in types])
    window = get(K_WINDOW, int, 0)
    if len(types) != n_layers or len(causal) != n_layers:
        raise _fail(where, f"{K_LAYER_TYPES} and {K_CAUSAL} need {n_layers} entries, got {len(types)}, {len(causal)}")
    bad = [t for t in types if t not in LAYER_TYPES]
    if bad:
        raise _fail(where, f"{K_LAYER_TYPES} holds {bad[0]!r}; known: {', '.join(LAYER_TYPES)}")
    if any(t == "sliding_attention" for t in types) and window <= 0:
        raise _fail(where, f"sliding_attention layers need {K_WINDOW} > 0")
    scaling = md.get(f"{ARCH}.rope.scaling.type", "none")
    if scaling not in ("none", "linear"):
        raise _fail(where, f"RoPE scaling {scaling!r} is not supported; supported: none, linear")
    rope_scale = 1.0 / get("rope.scaling.factor", float) if scaling == "linear" else 1.0
    cfg = DFlashConfig(
        arch=ARCH,
        n_layers=n_layers,
        dim=dim,
        n_heads=n_heads,
        n_kv_heads=get("attention.head_count_kv", default=n_heads),
        head_dim=head_dim,
        ffn_dim=get("feed_forward_length"),
        n_vocab=get(K_VOCAB),
        n_ctx_train=get("context_length"),
        norm_eps=get("attention.layer_norm_rms_epsilon", float),
        rope_dims=get("rope.dimension_count", default=head_dim),
        rope_base=get("rope.freq_base", float),
        rope_scale=rope_scale,
        rope_mode="neox",
        block_size=get(K_BLOCK_SIZE),
        mask_token_id=get(K_MASK),
        target_layer_ids=tuple(int(i) for i in ids),
        target_dim=get(K_TARGET_HIDDEN),
        input_embedding_scale=get(K_EMBD_SCALE, float, 1.0),
        output_multiplier=get(K_OUT_MULT, float, 1.0),
        logit_softcap=get(K_SOFTCAP, float, 0.0),
        layer_causal=tuple(bool(c) for c in causal),
        layer_window=tuple(window if t == "sliding_attention" else 0 for t in types),
    )
    _check_config(cfg, where)
    return cfg


def _check_config(c: DFlashConfig, where: str) -> None:
    """The checks a user can act on before the native engine sees the config."""
    for name in ("n_layers", "dim", "n_heads", "n_kv_heads", "head_dim", "ffn_dim", "n_vocab", "target_dim"):
        if getattr(c, name) <= 0:
            raise _fail(where, f"{name} must be positive, got {getattr(c, name)}")
    if c.n_heads % c.n_kv_heads:
        raise _fail(where, f"attention heads {c.n_heads} must be a multiple of KV heads {c.n_kv_heads}")
    if not 2 <= c.block_size <= 1024:
        raise _fail(where, f"block_size {c.block_size} is out of range [2, 1024] (one known token plus masks)")
    if not 0 <= c.mask_token_id < c.n_vocab:
        raise _fail(where, f"mask_token_id {c.mask_token_id} is outside the vocabulary [0, {c.n_vocab})")
    if not c.target_layer_ids or min(c.target_layer_ids) < 0:
        raise _fail(where, f"target_layer_ids must be non-empty layer indices >= 0, got {list(c.target_layer_ids)}")
    if c.target_dim != c.dim:
        raise _fail(
            where,
            f"target hidden size {c.target_dim} differs from the drafter's hidden size {c.dim}; DFlash feeds "
            "target token embeddings into its own residual stream, so they must be equal",
        )


def check_pair(draft: DFlashConfig, target: Any, where: str = "DFlash drafter") -> None:
    """Raises ModelLoadError unless `draft` can serve `target` (a worker.model_file.ModelConfig)."""
    if target.dim != draft.target_dim:
        raise _fail(
            where,
            f"it was trained on a target of hidden size {draft.target_dim}, this target has {target.dim}; "
            "use the DFlash drafter made for this target model",
        )
    if target.n_vocab != draft.n_vocab:
        raise _fail(
            where,
            f"its vocabulary has {draft.n_vocab} tokens, the target's {target.n_vocab}; drafter and target must "
            "share one vocabulary",
        )
    if max(draft.target_layer_ids) >= target.n_layers:
        raise _fail(
            where,
            f"it taps target layer {max(draft.target_layer_ids)} but the target has {target.n_layers} layers; "
            "use the DFlash drafter made for this target model",
        )


def open_dflash(path: str | os.PathLike[str]):
    """Opens a DFlash GGUF as a worker.model_file.ModelFile whose config is a DFlashConfig."""
    from worker import model_file  # its tensor views and metadata decoding; no second parser

    p = Path(path).expanduser()
    if not p.is_file():
        raise ModelLoadError(f"no such DFlash file: {p}")
    try:
        reader = gguf.GGUFReader(p, "r")
    except Exception as exc:
        raise ModelLoadError(f"{p} is not a readable GGUF file ({type(exc).__name__}: {exc})") from exc
    md = model_file._read_metadata(reader, p)
    config = read_dflash_config(md, str(p))
    tensors = model_file._tensor_views(reader, p, p.stat().st_size)
    version = int(reader.fields["GGUF.version"].contents())
    return model_file.ModelFile(path=p, config=config, metadata=md, tensors=tensors, gguf_version=version)


# ---------------------------------------------------------------- safetensors


_ST_DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16, "F64": np.float64}


class SafetensorsFile:
    """One .safetensors file, memmapped: header parsed, tensors read on demand."""

    def __init__(self, path: Path):
        self.path = path
        size = path.stat().st_size
        with open(path, "rb") as f:
            raw = f.read(8)
            if len(raw) < 8:
                raise ModelLoadError(f"{path}: too short to be a safetensors file")
            n = int.from_bytes(raw, "little")
            if n <= 0 or 8 + n > size:
                raise ModelLoadError(
                    f"{path}: header length {n} does not fit the file ({size} bytes); not a safetensors file?"
                )
            try:
                header = json.loads(f.read(n))
            except ValueError as exc:
                raise ModelLoadError(f"{path}: the safetensors header is not valid JSON ({exc})") from exc
        header.pop("__metadata__", None)
        self._base = 8 + n
        self._mm = np.memmap(path, dtype=np.uint8, mode="r") if size > self._base else np.zeros(0, np.uint8)
        self.entries: dict[str, tuple[str, tuple[int, ...], int, int]] = {}
        for name, info in header.items():
            dtype, shape, (b0, b1) = info["dtype"], tuple(int(s) for s in info["shape"]), info["data_offsets"]
            if dtype not in _ST_DTYPES:
                raise ModelLoadError(
                    f"{path}: tensor {name!r} is {dtype}; supported: {', '.join(_ST_DTYPES)}"
                )
            expect = int(np.prod(shape, dtype=np.int64)) * np.dtype(_ST_DTYPES[dtype]).itemsize
            if b1 - b0 != expect or self._base + b1 > size:
                raise ModelLoadError(f"{path}: tensor {name!r} has a bad byte range {b0}..{b1} (truncated file?)")
            self.entries[name] = (dtype, shape, b0, b1)

    def raw(self, name: str) -> tuple[str, np.ndarray]:
        """(safetensors dtype, array view): BF16 comes as its uint16 bit patterns."""
        dtype, shape, b0, b1 = self.entries[name]
        data = self._mm[self._base + b0 : self._base + b1].view(_ST_DTYPES[dtype]).reshape(shape)
        return dtype, data

    def float32(self, name: str) -> np.ndarray:
        dtype, data = self.raw(name)
        if dtype == "BF16":
            return (data.astype(np.uint32) << 16).view(np.float32)
        return data.astype(np.float32)


def _find_checkpoint(src: Path) -> tuple[dict[str, Any], list[Path]]:
    """config.json and the safetensors files of a checkpoint directory (or one file)."""
    if src.is_file():
        config_path, files = src.parent / "config.json", [src]
    elif src.is_dir():
        config_path = src / "config.json"
        index = src / "model.safetensors.index.json"
        if index.exists():
            weight_map = json.loads(index.read_text()).get("weight_map", {})
            files = sorted({src / f for f in weight_map.values()})
        else:
            files = sorted(src.glob("*.safetensors"))
        if not files:
            raise ModelLoadError(f"{src}: no .safetensors files; expected a DFlash checkpoint directory")
    else:
        raise ModelLoadError(f"no such checkpoint: {src}")
    if not config_path.exists():
        raise ModelLoadError(f"{config_path}: missing; a DFlash checkpoint needs its config.json next to the weights")
    try:
        config = json.loads(config_path.read_text())
    except ValueError as exc:
        raise ModelLoadError(f"{config_path}: not valid JSON ({exc})") from exc
    return config, files


# ---------------------------------------------------------------- config.json -> metadata


def _config_value(cfg: dict[str, Any], name: str, default: Any = None) -> Any:
    """As the reference: dflash_config[name], else the top-level config[name], else default."""
    dcfg = cfg.get("dflash_config") or {}
    return dcfg.get(name, cfg.get(name, default))


def _number(cfg: dict[str, Any], name: str, default: float, where: str) -> float:
    value = _config_value(cfg, name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not np.isfinite(value):
        raise _fail(where, f"dflash_config.{name} must be a finite number, got {value!r}")
    return float(value)


def metadata_from_config(cfg: dict[str, Any], where: str) -> dict[str, Any]:
    """The DFlash GGUF metadata (key -> value; lists are arrays) of a checkpoint's config.json."""
    if "dflash_config" not in cfg and "target_layer_ids" not in cfg:
        raise _fail(
            where,
            "no 'dflash_config' object (and no top-level target_layer_ids): this is not a DFlash drafter "
            "checkpoint; DFlash configs name block_size, mask_token_id and target_layer_ids there",
        )
    dcfg = cfg.get("dflash_config") or {}
    if any(k in dcfg or k in cfg for k in ("conv_kernel_size", "selector_rank")):
        raise _fail(where, "this is a DFlash2 checkpoint (dynamic convolutions, candidate selector); "
                    "specd supports DFlash v1 drafters only for now")

    def need(name: str) -> Any:
        if name not in cfg:
            raise _fail(where, f"config.json has no {name!r}, needed for a DFlash drafter")
        return cfg[name]

    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise _fail(where, f"hidden_act {act!r} is not supported; DFlash drafters use silu (SwiGLU)")
    n_layers, dim, n_heads = int(need("num_hidden_layers")), int(need("hidden_size")), int(need("num_attention_heads"))
    head_dim = int(cfg.get("head_dim") or dim // n_heads)
    ids = _config_value(cfg, "target_layer_ids")
    mask = _config_value(cfg, "mask_token_id")
    if ids is None:
        raise _fail(where, "dflash_config has no target_layer_ids (the target layers whose outputs it reads)")
    if mask is None:
        raise _fail(where, "dflash_config has no mask_token_id (the token that fills the block's draft slots)")
    if not isinstance(ids, list) or not ids or not all(isinstance(i, int) and i >= 0 for i in ids):
        raise _fail(where, f"target_layer_ids must be a non-empty list of layer indices, got {ids!r}")
    block_size = _config_value(cfg, "block_size", 16)
    if not isinstance(block_size, int) or not 2 <= block_size <= 1024:
        raise _fail(where, f"block_size {block_size!r} is out of range [2, 1024]")
    vocab = int(need("vocab_size"))
    if not isinstance(mask, int) or not 0 <= mask < vocab:
        raise _fail(where, f"mask_token_id {mask!r} is outside the vocabulary [0, {vocab})")
    target_dim = int(_config_value(cfg, "target_hidden_size", dim))
    if target_dim != dim:
        raise _fail(where, f"target_hidden_size {target_dim} differs from hidden_size {dim}; not supported")

    # RoPE: transformers v4 writes rope_theta / rope_scaling, v5 rope_parameters.
    rp = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    theta = float(rp.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    rope_type = rp.get("rope_type", rp.get("type", "default"))
    if rope_type not in ("default", "linear"):
        raise _fail(where, f"RoPE type {rope_type!r} is not supported yet; supported: default, linear")

    types = cfg.get("layer_types") or ["full_attention"] * n_layers
    if len(types) != n_layers or any(t not in LAYER_TYPES for t in types):
        raise _fail(where, f"layer_types must list {n_layers} of {LAYER_TYPES}, got {types!r}")
    is_causal = cfg.get("is_causal")  # absent: sliding layers causal, full layers not
    causal = [t == "sliding_attention" if is_causal is None else bool(is_causal) for t in types]
    window = int(cfg.get("sliding_window") or 0) if "sliding_attention" in types else 0
    if "sliding_attention" in types and window <= 0:
        raise _fail(where, "layer_types has sliding_attention layers but sliding_window is not set")

    md: dict[str, Any] = {
        "general.name": str(cfg.get("_name_or_path") or cfg.get("name") or "dflash-drafter"),
        K_FORMAT: FORMAT_VERSION,
        f"{ARCH}.block_count": n_layers,
        f"{ARCH}.context_length": int(cfg.get("max_position_embeddings") or 32768),
        f"{ARCH}.embedding_length": dim,
        f"{ARCH}.feed_forward_length": int(need("intermediate_size")),
        f"{ARCH}.attention.head_count": n_heads,
        f"{ARCH}.attention.head_count_kv": int(cfg.get("num_key_value_heads") or n_heads),
        f"{ARCH}.attention.key_length": head_dim,
        f"{ARCH}.attention.value_length": head_dim,
        f"{ARCH}.attention.layer_norm_rms_epsilon": float(cfg.get("rms_norm_eps", 1e-6)),
        f"{ARCH}.rope.freq_base": theta,
        f"{ARCH}.rope.dimension_count": head_dim,
        K_VOCAB: vocab,
        K_BLOCK_SIZE: block_size,
        K_MASK: mask,
        K_LAYER_IDS: [int(i) for i in ids],
        K_TARGET_HIDDEN: target_dim,
        K_EMBD_SCALE: _number(cfg, "input_embedding_scale", 1.0, where),
        K_OUT_MULT: _number(cfg, "output_multiplier", 1.0, where),
        K_SOFTCAP: max(0.0, _number(cfg, "final_logit_softcapping", 0.0, where)),  # <= 0 / null: off
        K_LAYER_TYPES: list(types),
        K_CAUSAL: causal,
        K_WINDOW: window,
    }
    if rope_type == "linear":
        md[f"{ARCH}.rope.scaling.type"] = "linear"
        md[f"{ARCH}.rope.scaling.factor"] = float(rp["factor"])
    return md


def expected_tensors(md: dict[str, Any], attention_bias: bool) -> dict[str, tuple[int, ...]]:
    """GGUF name -> numpy shape (n_out, n_in) / (n,) of every tensor a DFlash file holds."""
    n_layers, dim = md[f"{ARCH}.block_count"], md[f"{ARCH}.embedding_length"]
    hd, ffn = md[f"{ARCH}.attention.key_length"], md[f"{ARCH}.feed_forward_length"]
    q_dim, kv_dim = md[f"{ARCH}.attention.head_count"] * hd, md[f"{ARCH}.attention.head_count_kv"] * hd
    out = {
        "dflash_fc.weight": (dim, len(md[K_LAYER_IDS]) * md[K_TARGET_HIDDEN]),
        "dflash_hidden_norm.weight": (dim,),
        "output_norm.weight": (dim,),
    }
    for i in range(n_layers):
        p = f"blk.{i}."
        out |= {
            p + "attn_norm.weight": (dim,), p + "attn_q.weight": (q_dim, dim), p + "attn_k.weight": (kv_dim, dim),
            p + "attn_v.weight": (kv_dim, dim), p + "attn_output.weight": (dim, q_dim),
            p + "attn_q_norm.weight": (hd,), p + "attn_k_norm.weight": (hd,), p + "ffn_norm.weight": (dim,),
            p + "ffn_gate.weight": (ffn, dim), p + "ffn_up.weight": (ffn, dim), p + "ffn_down.weight": (dim, ffn),
        }
        if attention_bias:
            out |= {p + "attn_q.bias": (q_dim,), p + "attn_k.bias": (kv_dim,), p + "attn_v.bias": (kv_dim,),
                    p + "attn_output.bias": (dim,)}
    return out


# ---------------------------------------------------------------- conversion


def _out_type(outtype: str, src_dtype: str, shape: tuple[int, ...]) -> _QT:
    """The GGUF type of one tensor: vectors F32 always, matrices as asked."""
    if len(shape) == 1:
        return _QT.F32
    if outtype == "auto":
        return {"F32": _QT.F32, "F64": _QT.F32, "F16": _QT.F16, "BF16": _QT.BF16}[src_dtype]
    if outtype == "q8_0" and shape[-1] % 32:
        return _QT.F16  # Q8_0 needs rows of a multiple of 32 elements
    return {"f32": _QT.F32, "f16": _QT.F16, "bf16": _QT.BF16, "q8_0": _QT.Q8_0}[outtype]


def _encode(st: SafetensorsFile, name: str, qtype: _QT) -> np.ndarray:
    """The tensor's bytes in qtype: float arrays for F32/F16, uint8 blocks otherwise."""
    dtype, raw = st.raw(name)
    if qtype == _QT.BF16 and dtype == "BF16":
        return np.ascontiguousarray(raw).view(np.uint8)  # bit-exact copy, no rounding
    x = st.float32(name)
    if qtype == _QT.F32:
        return np.ascontiguousarray(x)
    if qtype == _QT.F16:
        return np.ascontiguousarray(x.astype(np.float16))
    return gguf.quants.quantize(np.ascontiguousarray(x), qtype)


def _add_metadata(w: gguf.GGUFWriter, md: dict[str, Any]) -> None:
    for key, value in md.items():
        if key == "general.name":
            w.add_name(value)
        elif isinstance(value, list):
            w.add_array(key, value)
        elif isinstance(value, bool):
            w.add_bool(key, value)
        elif isinstance(value, int) and value >= 0:
            w.add_uint32(key, value)
        elif isinstance(value, int):
            w.add_int32(key, value)
        elif isinstance(value, float):
            w.add_float32(key, value)
        else:
            w.add_string(key, str(value))


def convert(src: str | os.PathLike[str], out: str | os.PathLike[str], outtype: str = "auto",
            progress: bool = True) -> Path:
    """Converts a DFlash checkpoint (directory or .safetensors with config.json beside it)
    into a DFlash GGUF at `out`; returns its path. Raises ModelLoadError naming what is wrong."""
    if outtype not in OUTTYPES:
        raise ModelLoadError(f"outtype must be one of {', '.join(OUTTYPES)}, got {outtype!r}")
    src_p, out_p = Path(src).expanduser(), Path(out).expanduser()
    cfg, files = _find_checkpoint(src_p)
    where = str(src_p)
    md = metadata_from_config(cfg, where)

    sources: dict[str, tuple[SafetensorsFile, str]] = {}  # GGUF name -> (file, safetensors name)
    unknown: list[str] = []
    for f in files:
        st = SafetensorsFile(f)
        for name in st.entries:
            g = gguf_name(name)
            if g is None:
                if name.removeprefix("model.") not in _IGNORED:
                    unknown.append(name)
                continue
            if g in sources:
                raise _fail(where, f"tensor {name!r} appears twice")
            sources[g] = (st, name)
    if unknown:
        v2 = any("conv" in u or "selector" in u for u in unknown)
        hint = " (a DFlash2 checkpoint? not supported yet)" if v2 else ""
        raise _fail(where, f"unexpected tensors {unknown[:5]}{' ...' if len(unknown) > 5 else ''}{hint}")
    expected = expected_tensors(md, attention_bias=bool(cfg.get("attention_bias", False)))
    missing = [n for n in expected if n not in sources]
    if missing:
        st_names = {v: k for k, v in _GLOBAL_NAMES.items()}
        shown = [st_names.get(m, m) for m in missing[:5]]
        raise _fail(where, f"the checkpoint lacks {len(missing)} tensor(s), e.g. {shown}; is it complete?")
    extra = [n for n in sources if n not in expected]
    if extra:
        raise _fail(where, f"tensors {extra[:5]} do not fit config.json (attention_bias false?)")
    for g, shape in expected.items():
        st, name = sources[g]
        got = st.entries[name][1]
        if tuple(got) != shape:
            raise _fail(where, f"tensor {name!r} has shape {list(got)}, config.json implies {list(shape)}")

    out_p.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_p.with_name(out_p.name + ".part")
    w = gguf.GGUFWriter(os.fspath(tmp), ARCH)
    _add_metadata(w, md)
    plan: list[tuple[str, _QT]] = []
    for g, shape in expected.items():  # infos first (they fix the layout), then the data
        st, name = sources[g]
        qtype = _out_type(outtype, st.entries[name][0], shape)
        if qtype in (_QT.F32, _QT.F16):
            dt = np.dtype(np.float32 if qtype == _QT.F32 else np.float16)
            w.add_tensor_info(g, shape, dt, int(np.prod(shape)) * dt.itemsize)
        else:
            byte_shape = gguf.quants.quant_shape_to_byte_shape(shape, qtype)
            w.add_tensor_info(g, byte_shape, np.dtype(np.uint8), int(np.prod(byte_shape)), raw_dtype=qtype)
        plan.append((g, qtype))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    bar = _progress(sum(int(np.prod(expected[g])) for g, _ in plan), progress)
    try:
        for g, qtype in plan:
            st, name = sources[g]
            w.write_tensor_data(_encode(st, name, qtype))
            bar.update(int(np.prod(expected[g])))
    except BaseException:
        w.close()
        tmp.unlink(missing_ok=True)  # never leave a half-written file behind
        raise
    finally:
        bar.close()
    w.close()
    os.replace(tmp, out_p)  # appears complete or not at all
    return out_p


def _progress(total: int, enabled: bool):
    try:
        from tqdm import tqdm
    except ImportError:  # tqdm is a dependency; stay usable without it
        enabled = False
    if not enabled:
        class _Null:
            def update(self, n: int) -> None: ...
            def close(self) -> None: ...
        return _Null()
    return tqdm(total=total, unit="param", unit_scale=True, desc="converting", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m worker.dflash_convert",
        description="Convert a DFlash drafter checkpoint (config.json + safetensors) to a DFlash GGUF.",
    )
    ap.add_argument("checkpoint", help="checkpoint directory (config.json + *.safetensors) or a .safetensors file")
    ap.add_argument("-o", "--output", required=True, help="the GGUF file to write")
    ap.add_argument("--outtype", choices=OUTTYPES, default="auto",
                    help="matrix storage type; auto keeps the checkpoint's (bf16 stays bf16); norms are always f32")
    ap.add_argument("--quiet", action="store_true", help="no progress bar")
    args = ap.parse_args(argv)
    try:
        path = convert(args.checkpoint, args.output, args.outtype, progress=not args.quiet)
    except ModelLoadError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
