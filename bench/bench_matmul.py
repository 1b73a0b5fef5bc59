"""Micro-benchmark of the native matmul (dev tool, not a test): y[m, n_out] = x[m, n_in] @ W^T.

Two measurements, with native.set_num_threads(2) (--threads) and the median (and min) of
time.perf_counter() samples:

1. Per shape and type (the demo model's SmolLM2-135M shapes, plus every type on one
   shape), m = 1 and m = 64: the same weight timed repeatedly, so it is cache-warm (L2/L3):
   kernel speed, with ms, GB/s of weight bytes and GFLOP/s.
2. The demo model's matmuls (30 layers of Q4_1 + the Q8_0 output head, ~96 MB a token)
   over distinct weights, as the engine runs them: one decode token (m = 1), one
   speculative verify of 4 drafts (m = 5), one 64-token prefill chunk. Bounded by DRAM
   bandwidth and TLB misses; done on random weights and, when the demo GGUF is present, on
   its real memmapped weights (the engine's memory layout) and on a huge-page copy of them.

On the shared 2-core dev machine other processes inflate medians (they take one of the
two cores); the min is the quiet-machine figure.
Run: SPECD_NATIVE_DIR=build/dev-<name> python3 bench/bench_matmul.py [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import numpy as np

from worker.engine import native, ops

# ggml type ids and (block elements, block bytes, offsets of fp16 fields)
TYPES = {
    "F32": (0, 1, 4, ()), "F16": (1, 1, 2, ()), "BF16": (30, 1, 2, ()),
    "Q8_0": (8, 32, 34, (0,)), "Q4_0": (2, 32, 18, (0,)), "Q4_1": (3, 32, 20, (0, 2)),
    "Q5_0": (6, 32, 22, (0,)), "Q5_1": (7, 32, 24, (0, 2)),
    "Q4_K": (12, 256, 144, (0, 2)), "Q5_K": (13, 256, 176, (0, 2)), "Q6_K": (14, 256, 210, (208,)),
}
DIM, FFN, KV, VOCAB, LAYERS = 576, 1536, 192, 49152, 30
# (name, n_in, n_out) of one llama layer of the demo model
LAYER_SHAPES = [("q", DIM, DIM), ("k", DIM, KV), ("v", DIM, KV), ("o", DIM, DIM),
                ("gate", DIM, FFN), ("up", DIM, FFN), ("down", FFN, DIM)]
THREADS = 2  # --threads
DEMO_MODEL = os.path.expanduser("~/.cache/specd/models/SmolLM2-135M-Instruct.Q4_1.gguf")


def random_weight(rng: np.random.Generator, tname: str, n_in: int, n_out: int) -> np.ndarray:
    """Raw bytes of an [n_out, n_in] weight: random payload, finite fp16 scales."""
    _, be, bb, halves = TYPES[tname]
    if tname in ("F32", "F16", "BF16"):
        x = rng.standard_normal((n_out, n_in), dtype=np.float32)
        if tname == "F32":
            return x.view(np.uint8).reshape(-1)
        if tname == "F16":
            return x.astype(np.float16).view(np.uint8).reshape(-1)
        return (x.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8).reshape(-1)
    nblk = n_out * n_in // be
    blocks = rng.integers(0, 256, size=(nblk, bb), dtype=np.uint8)
    for off in halves:
        blocks[:, off:off + 2] = rng.uniform(-0.01, 0.01, nblk).astype(np.float16).view(np.uint8).reshape(nblk, 2)
    return blocks.reshape(-1)


def times(fn, reps: int) -> tuple[float, float]:
    """(median, min) seconds of reps calls after one warm-up call (threads, page faults).

    The median is the figure to quote; the min shows the machine's best when it is shared
    (other processes on the 2 cores inflate the median).
    """
    fn()
    samples = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples), min(samples)


def per_shape(rng: np.random.Generator, reps: int) -> list[dict]:
    cases = [(name, i, o, "Q4_1") for name, i, o in LAYER_SHAPES] + [("head", DIM, VOCAB, "Q8_0")]
    # every type on the FFN down shape (1536 is a multiple of the K-quants' 256)
    cases += [("down", FFN, DIM, t) for t in TYPES if t != "Q4_1"]
    rows = []
    for name, n_in, n_out, tname in cases:
        tid, be, bb, _ = TYPES[tname]
        w = random_weight(rng, tname, n_in, n_out)
        for m in (1, 64):
            x = rng.standard_normal((m, n_in), dtype=np.float32)
            t, t_min = times(lambda: ops.matmul(tid, w, n_in, n_out, x), reps if n_out < 10000 else max(3, reps // 10))
            rows.append({"name": name, "type": tname, "n_in": n_in, "n_out": n_out, "m": m, "ms": t * 1e3,
                         "min_ms": t_min * 1e3, "GB/s": w.nbytes / t / 1e9, "GFLOP/s": 2.0 * m * n_in * n_out / t / 1e9})
    return rows


Weight = tuple[int, np.ndarray, int, int]  # (type id, raw bytes, n_in, n_out)


def random_model() -> list[Weight]:
    """The demo model's matmul weights in call order, random, each its own allocation."""
    rng = np.random.default_rng(1)
    ws = [(TYPES["Q4_1"][0], random_weight(rng, "Q4_1", i, o), i, o) for _ in range(LAYERS) for _, i, o in LAYER_SHAPES]
    return ws + [(TYPES["Q8_0"][0], random_weight(rng, "Q8_0", DIM, VOCAB), DIM, VOCAB)]


def gguf_model(path: str) -> list[Weight]:
    """The real file's matmul weights in call order, memmapped as the engine gets them."""
    from gguf import GGUFReader

    tensors = {t.name: t for t in GGUFReader(path).tensors}
    names = [f"blk.{b}.{n}.weight" for b in range(LAYERS)
             for n in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")]
    names.append("output.weight" if "output.weight" in tensors else "token_embd.weight")  # tied output
    out = []
    for name in names:
        t = tensors[name]
        n_in, n_out = (int(v) for v in t.shape)
        out.append((int(t.tensor_type), np.asarray(t.data).reshape(-1), n_in, n_out))
    return out


def packed(weights: list[Weight]) -> list[Weight]:
    """The same weights copied into one anonymous allocation (>= 4 MiB: numpy asks the
    kernel for transparent huge pages), i.e. far fewer TLB misses than 4 KiB pages."""
    buf = np.empty(sum(w.nbytes for _, w, _, _ in weights), np.uint8)
    out, off = [], 0
    for tid, w, i, o in weights:
        buf[off:off + w.nbytes] = w
        out.append((tid, buf[off:off + w.nbytes], i, o))
        off += w.nbytes
    return out


def model_pass(weights: list[Weight], m: int, reps: int) -> tuple[float, float]:
    """(median, min) seconds for one forward's matmuls (m tokens) over the model's weights."""
    rng = np.random.default_rng(2)
    xs = {n: rng.standard_normal((m, n), dtype=np.float32) for n in (DIM, FFN)}

    def run():
        for tid, w, i, o in weights:
            ops.matmul(tid, w, i, o, xs[i])

    return times(run, reps)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=30, help="samples per measurement (median)")
    ap.add_argument("--json", help="also write the results to this JSON file")
    ap.add_argument("--model", default=DEMO_MODEL, help="GGUF to time for real (skipped when missing)")
    ap.add_argument("--threads", type=int, default=THREADS, help="native threads (default 2: this machine's cores)")
    args = ap.parse_args()
    threads = args.threads
    native.set_num_threads(threads)
    rng = np.random.default_rng(0)
    print(f"simd path: {native.simd_path()}, threads: {threads}")

    rows = per_shape(rng, args.reps)
    print(f"\n{'weight':6} {'type':5} {'n_in':>5} {'n_out':>6} {'m':>3} {'ms':>9} {'min ms':>9} {'GB/s':>7} {'GFLOP/s':>8}")
    for r in rows:
        print(f"{r['name']:6} {r['type']:5} {r['n_in']:5d} {r['n_out']:6d} {r['m']:3d} {r['ms']:9.4f} {r['min_ms']:9.4f} "
              f"{r['GB/s']:7.1f} {r['GFLOP/s']:8.1f}")

    # Python -> C++ cost of one ops.matmul call (included in every row above and below:
    # 211 calls per token here; the engine calls matmul from C++ and does not pay it)
    w1, x1 = random_weight(rng, "F32", 8, 1), np.ones((1, 8), np.float32)
    call_us = times(lambda: ops.matmul(0, w1, 8, 1, x1), 200)[1] * 1e6
    calls = LAYERS * len(LAYER_SHAPES) + 1
    wbytes = LAYERS * sum(i * o // 32 * 20 for _, i, o in LAYER_SHAPES) + DIM * VOCAB // 32 * 34
    flops = 2.0 * (LAYERS * sum(i * o for _, i, o in LAYER_SHAPES) + DIM * VOCAB)
    results = {}
    models = [("random weights, one allocation each", random_model)]
    if os.path.exists(args.model):
        models.append(("the real GGUF, memmapped (4 KiB page-cache pages)", lambda: gguf_model(args.model)))
        models.append(("the real GGUF copied into one buffer (numpy madvises 2 MiB huge pages)",
                       lambda: packed(gguf_model(args.model))))
    print(f"\ndemo model matmuls: {LAYERS} layers Q4_1 + Q8_0 head, {wbytes / 1e6:.1f} MB of weights per token, "
          f"{calls} calls (each with ~{call_us:.1f} us of Python call overhead)")
    for label, load in models:
        weights = load()
        decode = model_pass(weights, 1, max(5, args.reps // 2))
        verify = model_pass(weights, 5, max(5, args.reps // 4))
        prefill = model_pass(weights, 64, max(3, args.reps // 10))
        results[label] = {"decode_ms_per_token": decode[0] * 1e3, "decode_min_ms_per_token": decode[1] * 1e3,
                          "verify5_ms": verify[0] * 1e3, "verify5_min_ms": verify[1] * 1e3,
                          "prefill64_ms_per_token": prefill[0] / 64 * 1e3, "prefill64_min_ms_per_token": prefill[1] / 64 * 1e3}
        print(f"  {label}:")
        print(f"    decode  m=1 : median {decode[0] * 1e3:7.2f} ms/token (min {decode[1] * 1e3:6.2f}); "
              f"{wbytes / decode[0] / 1e9:5.1f} GB/s, {flops / decode[0] / 1e9:5.1f} GFLOP/s")
        print(f"    verify  m=5 : median {verify[0] * 1e3:7.2f} ms/pass  (min {verify[1] * 1e3:6.2f}) = "
              f"{verify[0] / decode[0]:.2f}x one decode")
        print(f"    prefill m=64: median {prefill[0] / 64 * 1e3:7.3f} ms/token (min {prefill[1] / 64 * 1e3:6.3f}); "
              f"{64 * flops / prefill[0] / 1e9:5.1f} GFLOP/s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"simd": native.simd_path(), "threads": threads, "per_shape": rows,
                       "call_overhead_us": call_us,
                       "model_passes": results}, f, indent=1)


if __name__ == "__main__":
    main()
