"""Derived GGUF files: re-quantized and layer-truncated copies of a model.

Used for benchmarks (a Q8_0 copy of the Q4_1 demo model) and as test drafts for
speculative decoding (a re-quantized or truncated copy shares the target's vocabulary).
Weights are dequantized with gguf's numpy code and re-quantized with it, so the result is
exactly what llama.cpp's tools would produce for the types gguf can write.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np

from worker.errors import ModelLoadError

# Types gguf.quants can write (it only dequantizes the K-quants).
WRITABLE_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1")
_BLOCK = re.compile(r"^blk\.(\d+)\.")


def derive_gguf(
    src: str | Path,
    dst: str | Path,
    *,
    weight_type: str | None = None,
    n_layers: int | None = None,
    progress: bool = True,
) -> Path:
    """Write a copy of `src` with 2-D weights re-quantized to `weight_type` (None keeps each
    tensor's type) and only the first `n_layers` blocks (None keeps all)."""
    import gguf

    if weight_type is not None and weight_type not in WRITABLE_TYPES:
        raise ModelLoadError(f"cannot write {weight_type!r}; writable types: {', '.join(WRITABLE_TYPES)}")
    reader = gguf.GGUFReader(str(src))
    arch = reader.fields["general.architecture"].contents()
    total_layers = int(reader.fields[f"{arch}.block_count"].contents())
    if n_layers is not None and not 1 <= n_layers <= total_layers:
        raise ModelLoadError(f"n_layers must be in 1..{total_layers}, got {n_layers}")

    writer = gguf.GGUFWriter(str(dst), arch)
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        vtype = gguf.GGUFValueType(field.types[0])
        sub = gguf.GGUFValueType(field.types[1]) if vtype == gguf.GGUFValueType.ARRAY else None
        value = field.contents()
        if key == f"{arch}.block_count" and n_layers is not None:
            value = n_layers
        if key == "general.file_type" and weight_type is not None:
            continue  # no longer describes the weights
        writer.add_key_value(key, value, vtype, sub_type=sub)

    target = gguf.GGMLQuantizationType[weight_type] if weight_type else None
    tensors = [t for t in reader.tensors if not _dropped(t.name, n_layers)]
    bar = _bar(len(tensors), f"writing {Path(dst).name}", progress)
    for t in tensors:
        kind = t.tensor_type
        if target is not None and len(t.shape) >= 2 and kind != target and t.name.endswith(".weight"):
            values = gguf.quants.dequantize(t.data, kind)  # float32 [rows, cols]
            if target == gguf.GGMLQuantizationType.F32:
                data, raw = values.astype(np.float32), None
            elif target == gguf.GGMLQuantizationType.F16:
                data, raw = values.astype(np.float16), None
            else:
                data, raw = gguf.quants.quantize(values, target), target
            writer.add_tensor(t.name, data, raw_shape=data.shape if raw else None, raw_dtype=raw)
        else:
            data = np.asarray(t.data)
            raw = None if kind in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16) else kind
            writer.add_tensor(t.name, data, raw_shape=data.shape if raw else None, raw_dtype=raw)
        bar.update(1)
    bar.close()
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file(progress=False)
    writer.close()
    return Path(dst)


def _dropped(name: str, n_layers: int | None) -> bool:
    m = _BLOCK.match(name)
    return n_layers is not None and m is not None and int(m.group(1)) >= n_layers


def _bar(total: int, desc: str, enabled: bool):
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="tensor", disable=not enabled)
