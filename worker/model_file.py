"""Opening a GGUF model file: its metadata, the model config, and zero-copy tensor views.

`open_model(path)` memmaps the file with `gguf.GGUFReader` (the one GGUF parser specd
uses), derives the validated `ModelConfig` the C++ engine needs from the metadata, and
lists every tensor as `(name, type_id, ne, view)` where `view` is a numpy view of the
memmapped bytes: nothing is copied or dequantised here. Every failure is a
`ModelLoadError` saying what is wrong with the file and, where it helps, what to do.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np

from worker.errors import ModelLoadError

SUPPORTED_ARCHS = ("llama", "qwen2", "qwen3")
# llama GGUFs store Q/K rows permuted for adjacent-pair RoPE; qwen ones use halves (neox).
_ROPE_MODE = {"llama": "normal", "qwen2": "neox", "qwen3": "neox"}
_GGUF_MAGIC = b"GGUF"


@dataclass(frozen=True)
class ModelConfig:
    """The hyper-parameters the engine needs; field names match the native config dict."""

    arch: str          # "llama" | "qwen2" | "qwen3"
    n_layers: int
    dim: int           # embedding width (n_embd)
    n_heads: int
    n_kv_heads: int
    head_dim: int      # per-head width of Q and K (qwen3 may differ from dim / n_heads)
    ffn_dim: int
    n_vocab: int
    n_ctx_train: int   # tokens the model was trained on
    norm_eps: float    # RMSNorm epsilon
    rope_dims: int     # rotated dims per head (<= head_dim)
    rope_base: float   # theta base
    rope_scale: float  # position multiplier: 1 / linear scaling factor
    rope_mode: str     # "normal" (adjacent pairs) | "neox" (halves)

    def to_native(self) -> dict[str, Any]:
        """The dict `native.Engine` takes (see config_from_dict in bindings/module.cpp)."""
        return dataclasses.asdict(self)


# (name, type_id, ne, view): ne[0] is the row length (fastest-varying), as in GGUF.
TensorEntry = tuple[str, int, list[int], np.ndarray]


@dataclass(frozen=True, eq=False)
class ModelFile:
    """One opened GGUF file. The views in `tensors` keep the memmap alive."""

    path: Path
    config: ModelConfig
    metadata: dict[str, Any]     # every key/value pair of the file, decoded
    tensors: list[TensorEntry]
    gguf_version: int

    @property
    def file_type(self) -> str:
        """The quantisation the file declares (`general.file_type`), e.g. 'MOSTLY_Q4_1'."""
        ft = self.metadata.get("general.file_type")
        if ft is None:
            return "unknown"
        try:
            return gguf.LlamaFileType(int(ft)).name
        except ValueError:
            return f"file_type {ft}"

    @property
    def n_params(self) -> int:
        return sum(int(np.prod(ne)) for _, _, ne, _ in self.tensors)

    @property
    def name(self) -> str:
        return str(self.metadata.get("general.name") or self.path.stem)

    def tensor(self, name: str) -> TensorEntry:
        for entry in self.tensors:
            if entry[0] == name:
                return entry
        raise KeyError(f"the model file has no tensor {name!r}")

    def description(self) -> str:
        c = self.config
        return (
            f"{self.name} ({c.arch}, {self.n_params / 1e6:.0f}M params, {self.file_type}): "
            f"{c.n_layers} layers, dim {c.dim}, {c.n_heads} heads / {c.n_kv_heads} KV heads "
            f"of {c.head_dim}, ffn {c.ffn_dim}, vocab {c.n_vocab}, trained context {c.n_ctx_train}"
        )


def open_model(path: str | os.PathLike[str]) -> ModelFile:
    """Opens and checks a GGUF model file; raises ModelLoadError with a clear message."""
    p = Path(path).expanduser()
    if not p.exists():
        raise ModelLoadError(f"no such model file: {p}")
    if not p.is_file():
        raise ModelLoadError(f"model path {p} is not a file")
    size = p.stat().st_size
    with open(p, "rb") as f:
        magic = f.read(4)
    if magic != _GGUF_MAGIC:
        raise ModelLoadError(
            f"{p} is not a GGUF file: it starts with {magic!r}, a GGUF file with {_GGUF_MAGIC!r} "
            "(bad magic); specd loads GGUF models only"
        )
    try:
        reader = gguf.GGUFReader(p, "r")
    except Exception as exc:  # gguf reports damage as ValueError, IndexError, KeyError, ...
        raise ModelLoadError(
            f"{p} is truncated or corrupt ({type(exc).__name__}: {exc}); download it again"
        ) from exc

    metadata = _read_metadata(reader, p)
    if metadata.get("general.architecture") == "dflash":  # a DFlash block drafter (docs/dflash-gguf.md)
        from worker.dflash_convert import read_dflash_config

        config = read_dflash_config(metadata, str(p))
    else:
        config = _config_from_metadata(metadata, reader, p)
    tensors = _tensor_views(reader, p, size)
    version = int(reader.fields["GGUF.version"].contents())
    return ModelFile(path=p, config=config, metadata=metadata, tensors=tensors, gguf_version=version)


# ---------------------------------------------------------------- metadata -> config


def _read_metadata(reader: gguf.GGUFReader, path: Path) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):  # the reader's header pseudo-fields, not file metadata
            continue
        try:
            out[key] = field.contents()
        except Exception as exc:  # e.g. undecodable UTF-8
            raise ModelLoadError(f"{path}: metadata key {key!r} is corrupt ({exc})") from exc
    return out


def _config_from_metadata(md: dict[str, Any], reader: gguf.GGUFReader, path: Path) -> ModelConfig:
    arch = md.get("general.architecture")
    if arch is None:
        raise ModelLoadError(f"{path}: metadata key 'general.architecture' is missing")
    if arch not in SUPPORTED_ARCHS:
        raise ModelLoadError(
            f"{path}: architecture {arch!r} is not supported; supported: {', '.join(SUPPORTED_ARCHS)}"
        )

    def get(key: str, default: Any = None, *, kind: type = int) -> Any:
        full = f"{arch}.{key}"
        value = md.get(full, default)
        if value is None:
            raise ModelLoadError(f"{path}: metadata key {full!r} is missing (needed for a {arch} model)")
        if isinstance(value, list):
            raise ModelLoadError(
                f"{path}: metadata key {full!r} holds a per-layer list; specd supports one value for all layers"
            )
        if kind is int and not (isinstance(value, int) and not isinstance(value, bool)):
            raise ModelLoadError(f"{path}: metadata key {full!r} should be an integer, got {value!r}")
        if kind is float and not isinstance(value, (int, float)):
            raise ModelLoadError(f"{path}: metadata key {full!r} should be a number, got {value!r}")
        return kind(value)

    dim = get("embedding_length")
    n_heads = get("attention.head_count")
    if n_heads <= 0:
        raise ModelLoadError(f"{path}: {arch}.attention.head_count must be positive, got {n_heads}")
    n_kv_heads = get("attention.head_count_kv", n_heads)
    if f"{arch}.attention.key_length" not in md and dim % n_heads != 0:
        raise ModelLoadError(
            f"{path}: {arch}.embedding_length {dim} is not a multiple of attention.head_count {n_heads} "
            f"and {arch}.attention.key_length is missing"
        )
    head_dim = get("attention.key_length", dim // n_heads)
    value_length = md.get(f"{arch}.attention.value_length", head_dim)
    if value_length != head_dim:
        raise ModelLoadError(
            f"{path}: attention.value_length {value_length} differs from key_length {head_dim}; not supported"
        )

    scaling = md.get(f"{arch}.rope.scaling.type", "none")
    if scaling == "none":
        rope_scale = 1.0
        if f"{arch}.rope.scale_linear" in md:  # older files: a linear factor without a type
            rope_scale = 1.0 / get("rope.scale_linear", kind=float)
    elif scaling == "linear":
        rope_scale = 1.0 / get("rope.scaling.factor", 1.0, kind=float)
    else:
        raise ModelLoadError(
            f"{path}: RoPE scaling {scaling!r} ({arch}.rope.scaling.type) is not supported yet; "
            "supported: none, linear"
        )

    n_vocab = md.get(f"{arch}.vocab_size")
    if n_vocab is None and "tokenizer.ggml.tokens" in md:
        n_vocab = len(md["tokenizer.ggml.tokens"])
    if n_vocab is None:
        embd = next((t for t in reader.tensors if t.name == "token_embd.weight"), None)
        if embd is None or len(embd.shape) < 2:
            raise ModelLoadError(
                f"{path}: cannot tell the vocabulary size: no {arch}.vocab_size, no tokenizer.ggml.tokens "
                "and no 2-D token_embd.weight"
            )
        n_vocab = int(embd.shape[1])

    return ModelConfig(
        arch=arch,
        n_layers=get("block_count"),
        dim=dim,
        n_heads=n_heads,
        n_kv_heads=n_kv_heads,
        head_dim=head_dim,
        ffn_dim=get("feed_forward_length"),
        n_vocab=int(n_vocab),
        n_ctx_train=get("context_length"),
        norm_eps=get("attention.layer_norm_rms_epsilon", kind=float),
        rope_dims=get("rope.dimension_count", head_dim),
        rope_base=get("rope.freq_base", 10000.0, kind=float),
        rope_scale=rope_scale,
        rope_mode=_ROPE_MODE[arch],
    )


# ---------------------------------------------------------------- tensors


def _supported_type_ids() -> dict[int, str]:
    from worker.engine import native  # the one importer of the native module

    names = [n.strip() for n in native.supported_types().split(",")]
    return {int(gguf.GGMLQuantizationType[n]): n for n in names}


def _tensor_views(reader: gguf.GGUFReader, path: Path, file_size: int) -> list[TensorEntry]:
    supported = _supported_type_ids()
    out: list[TensorEntry] = []
    for t in reader.tensors:
        type_id = int(t.tensor_type)
        if type_id not in supported:
            raise ModelLoadError(
                f"{path}: tensor {t.name!r} is stored as {t.tensor_type.name}, which specd does not support; "
                f"supported types: {', '.join(supported.values())}"
            )
        end = int(t.data_offset) + int(t.n_bytes)
        if end > file_size or t.data.nbytes != t.n_bytes:
            raise ModelLoadError(
                f"{path}: tensor {t.name!r} ends at byte {end} but the file has {file_size} bytes "
                "(truncated); download it again"
            )
        data = t.data
        if not data.flags.c_contiguous:  # never for a memmapped GGUF; copying would defeat the point
            raise ModelLoadError(f"{path}: tensor {t.name!r} is not contiguous in the file")
        out.append((t.name, type_id, [int(x) for x in t.shape], data))
    return out
