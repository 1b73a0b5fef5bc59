"""Random raw weight bytes in every GGUF storage type, for op tests (CPU and GPU)."""

from __future__ import annotations

import numpy as np
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as T

# byte offsets of the fp16 fields (d, m / dmin) inside one block
HALF_FIELDS = {T.Q8_0: (0,), T.Q4_0: (0,), T.Q5_0: (0,), T.Q4_1: (0, 2), T.Q5_1: (0, 2),
               T.Q4_K: (0, 2), T.Q5_K: (0, 2), T.Q6_K: (208,)}


def random_weight(rng: np.random.Generator, qtype: T, n_out: int, n_in: int) -> np.ndarray:
    """Raw bytes of an [n_out, n_in] weight: random payload, finite nonzero fp16 scales of both signs."""
    if qtype == T.F32:
        return rng.standard_normal((n_out, n_in), dtype=np.float32).view(np.uint8).reshape(-1)
    if qtype == T.F16:
        return rng.standard_normal((n_out, n_in)).astype(np.float16).view(np.uint8).reshape(-1)
    if qtype == T.BF16:
        w = rng.standard_normal((n_out, n_in), dtype=np.float32).view(np.uint32) >> 16
        return w.astype(np.uint16).view(np.uint8).reshape(-1)
    block_elems, block_bytes = GGML_QUANT_SIZES[qtype]
    nblk = n_out * n_in // block_elems
    blocks = rng.integers(0, 256, size=(nblk, block_bytes), dtype=np.uint8)
    for off in HALF_FIELDS[qtype]:
        v = rng.uniform(0.5, 1.0, nblk) * 2.0 ** rng.integers(-8, 1, nblk) * rng.choice([-1.0, 1.0], nblk)
        blocks[:, off:off + 2] = v.astype(np.float16).view(np.uint8).reshape(nblk, 2)
    return blocks.reshape(-1)
