"""Where a decode step's time goes inside the captured graph, kernel by kernel (tools/device:
run on the GPU machine, with a SPECD_GPU_TRACE=1 build, cuda/trace.cuh).

    CUDAFLAGS=-DSPECD_GPU_TRACE=1 SPECD_BACKEND=cuda tools/dev_build.sh trace
    SPECD_NATIVE_DIR=build/dev-trace python3 tools/device/trace_decode.py MODEL.gguf [--pos0 64] [--reps 7]

Runs `reps` forwards of n positions (default 1: a decode step; 16: a speculative verify) after
pos0 positions (Engine.bench_forward, what bench_gpu.py times; the context fill's launches are
left out) with the traced kernels (the direct matrix-vector readers, the int8 MMA verify
readers and their x-digits kernel, the decode and chunked attention) writing each CTA's marks,
then prints per launch kind (a kernel with its K, its output buffer, out#, numbered as they
first appear, and its grid: e.g. every layer's wo) the medians over layers and replays, in
microseconds:

  start   first CTA's entry, from the previous traced launch's last exit (negative: it was
          resident early, programmatic dependent launch)
  wait    the grid dependency wait returned (median CTA), from that same exit
  prep    wait -> x prepared (median CTA's clock)      loop  prepared -> its rows done
          (attn_decode: prep = its stage, loop = scores and softmax, tail = the sum of V)
  tail    loop done -> the CTA's barrier at the exit    span  first entry -> last exit
  end_spread  last CTA's exit - the median CTA's exit
  gap     the part of the step between this launch's last exit and the previous one's that
          no traced CTA of this launch was computing in (wait + the spread of CTA ends)
The traced forward's own time (bench_forward) is printed with the sum of the spans, and
--json writes the table. Off the GPU machine, --plot A.json [B.json ...] --png OUT.png draws
tables written by --json side by side (stacked wait / prep / loop / tail / end spread per kind;
a kind is matched across tables by its name without the grid and its rank among that name's
kinds, so builds launching other CTA counts line up).
"""
import argparse
import json
import re
import sys
from collections import defaultdict
from pathlib import Path

import numpy as np

TAGS = {1: "direct", 2: "attn_decode", 3: "kq_digits", 4: "kq_mma", 5: "attn_chunk"}


def launches(rec: np.ndarray) -> list[dict]:
    """Records (cuda/trace.cuh) grouped into launches: sorted by entry, split where the
    (tag, key, grid) changes (every CTA of a launch starts before any of the next one's)."""
    rec = rec[np.argsort(rec[:, 0], kind="stable")]
    out: list[dict] = []
    for r in rec:
        sig = (int(r[5] >> 56), int(r[6]), int(r[7]))
        if not out or out[-1]["sig"] != sig:
            out.append({"sig": sig, "rows": []})
        out[-1]["rows"].append(r)
    for L in out:
        L["rows"] = np.array(L["rows"])
    return out


def forward_launches(one: np.ndarray, rec: np.ndarray, reps: int) -> tuple[list[dict], int]:
    """The launches of the `reps` forwards in rec (records of the context fill and then reps
    forwards; one: those of the fill and one forward), and how many launches a forward has."""
    n_one, ls = len(launches(one)), launches(rec)
    per_fwd = (len(ls) - n_one) // (reps - 1)
    if per_fwd <= 0 or per_fwd * reps > len(ls):
        raise SystemExit(f"trace_decode: {len(ls)} launches for fill + {reps} forwards, {n_one} for fill + 1")
    return ls[len(ls) - per_fwd * reps:], per_fwd


def summarize(L: dict, prev_end: int | None, ns_per_clock: float, outs: dict[int, int]) -> dict:
    r = L["rows"]
    g0, g4, g1 = r[:, 0].astype(np.int64), r[:, 1].astype(np.int64), r[:, 4].astype(np.int64)
    c1, c2 = (r[:, 2] & 0xFFFFFFFF).astype(np.int64), (r[:, 2] >> 32).astype(np.int64)
    c3, c4 = (r[:, 3] & 0xFFFFFFFF).astype(np.int64), (r[:, 3] >> 32).astype(np.int64)
    tag, key, grid = L["sig"]
    base = prev_end if prev_end is not None else int(g0.min())
    us = 1e-3
    out = outs.setdefault(key & ((1 << 48) - 1), len(outs))  # outputs numbered as they first appear
    return {
        "kind": f"{TAGS.get(tag, tag)} K={key >> 48} out#{out} grid={grid & 0xFFFFFFFF}x{grid >> 32}",
        "ctas": int(len(r)),
        "start": (int(g0.min()) - base) * us,
        "wait": (float(np.median(g1)) - base) * us,
        "prep": float(np.median(c2 - c1)) * ns_per_clock * us,
        "loop": float(np.median(c3 - c2)) * ns_per_clock * us,
        "tail": float(np.median(c4 - c3)) * ns_per_clock * us,
        "span": (int(g4.max()) - int(g0.min())) * us,
        "end_spread": (int(g4.max()) - float(np.median(g4))) * us,
        "gap": (int(g4.max()) - base) * us - float(np.median(c4 - c1)) * ns_per_clock * us,
        "end": int(g4.max()),
    }


PHASES = ("wait", "prep", "loop", "tail", "end_spread")


def slots(tables: list[dict]) -> tuple[list[tuple[str, int]], dict[tuple[str, int], str]]:
    """Pairs the launch kinds of tables for side-by-side bars: a kind's slot is its name
    without the grid and its rank among the table's kinds of that name, so builds whose grids
    differ (another CTA count) still line up launch for launch. Sets each kind's "slot" (what
    plot() looks the bars up by) and returns the slots in order and each slot's label (the
    name, then the grids of the tables, "/" between differing ones)."""
    order: list[tuple[str, int]] = []
    grids: dict[tuple[str, int], list[str]] = {}
    for t in tables:
        seen: dict[str, int] = {}
        for k in t["kinds"]:
            name, _, grid = k["kind"].partition(" grid=")
            slot = (name, seen.get(name, 0))
            seen[name] = slot[1] + 1
            k["slot"] = slot
            if slot not in grids:
                order.append(slot)
                grids[slot] = []
            if grid not in grids[slot]:
                grids[slot].append(grid)
    return order, {s: f"{s[0]}\n{' / '.join(g)}" for s, g in grids.items()}


def plot(paths: list[str], png: str) -> None:
    """Stacked phase bars per launch kind that runs in every layer, one bar per --json table."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tables = [json.load(open(p)) for p in paths]
    # per-layer kinds only (the output head, once per forward, would dwarf them); tables of an
    # older trace_decode.py have no out# in their kinds: then kinds match without it
    bare = any("out#" not in k["kind"] for t in tables for k in t["kinds"])
    for t in tables:
        t["kinds"] = [dict(k, kind=re.sub(r" out#\d+", "", k["kind"]) if bare else k["kind"])
                      for k in t["kinds"] if k["launches"] >= 2 * t["reps"]]
    kinds, labels = slots(tables)
    fig, ax = plt.subplots(figsize=(max(8, 1.6 * len(kinds)), 4.5))
    width = 0.8 / len(tables)
    colors = ("#4c72b0", "#dd8452", "#55a868", "#8172b3", "#c44e52")
    for ti, t in enumerate(tables):
        by = {k["slot"]: k for k in t["kinds"]}
        for ki, kind in enumerate(kinds):
            k, bottom = by.get(kind), 0.0
            if k is None:
                continue
            for ph, col in zip(PHASES, colors):
                ax.bar(ki + ti * width, k[ph], width * 0.95, bottom=bottom, color=col,
                       label=ph if (ti, ki) == (0, 0) else None, alpha=1.0 - 0.35 * ti)
                bottom += k[ph]
            ax.text(ki + ti * width, bottom, f"{bottom:.1f}", ha="center", va="bottom", fontsize=7)
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(kinds))])
    ax.set_xticklabels([labels[k] for k in kinds], fontsize=7)
    ax.set_ylabel("us per launch (median)")
    names = " | ".join(f"{Path(p).stem} (fwd {np.median(t['forward_us']):.0f} us)" for p, t in zip(paths, tables))
    ax.set_title(f"decode launch phases, left to right: {names}", fontsize=8)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    print(f"wrote {png}")


def main() -> None:
    if "--plot" in sys.argv:
        pp = argparse.ArgumentParser()
        pp.add_argument("--plot", nargs="+", required=True)
        pp.add_argument("--png", required=True)
        a = pp.parse_args()
        plot(a.plot, a.png)
        return
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("--pos0", type=int, default=64)
    ap.add_argument("--n", type=int, default=1, help="positions per forward (16: a speculative verify of 16)")
    ap.add_argument("--reps", type=int, default=7, help="forwards traced (at least 2)")
    ap.add_argument("--n-ctx", type=int, default=0,
                    help="the engine's context (default: the least that holds pos0 + n, at least 256; the decode "
                         "attention launches a block per 256 positions of it and KV head)")
    ap.add_argument("--json", default="")
    ap.add_argument("--raw", default="", help="also save the records (numpy .npy, [n, 8] uint64)")
    args = ap.parse_args()
    n_ctx = args.n_ctx or max(256, args.pos0 + args.n + 8)
    if n_ctx < args.pos0 + args.n + 8:
        ap.error(f"--n-ctx {n_ctx} does not hold --pos0 {args.pos0} + --n {args.n} (+ 8 spare)")
    from worker.engine import Engine, native
    from worker.model_file import open_model

    g = getattr(native, "gpu_ops", None)
    if g is None:
        sys.exit("trace_decode: this native module has no GPU backend")
    with Engine(open_model(args.model), device="cuda:0", n_ctx=n_ctx) as eng:
        n_layers = eng.model.config.n_layers
        eng.bench_forward(args.n, args.pos0, 3)  # captures the graph, warms up
        if not g.trace_begin(1 << 21):
            sys.exit("trace_decode: not a SPECD_GPU_TRACE=1 build (cuda/trace.cuh)")
        eng.bench_forward(args.n, args.pos0, 1)  # the context fill and one forward: the fill's launches
        one = g.trace_end()
        g.trace_begin(1 << 21)
        secs = eng.bench_forward(args.n, args.pos0, args.reps)
        rec = g.trace_end()
    if args.raw:
        np.save(args.raw, rec)
    ls, per_fwd = forward_launches(one, rec, args.reps)
    # clock64 -> ns from the CTAs' own entry-exit intervals
    allr = np.concatenate([L["rows"] for L in ls])
    c4 = (allr[:, 3] >> 32).astype(np.float64)
    dt = (allr[:, 1].astype(np.int64) - allr[:, 0].astype(np.int64)).astype(np.float64)
    ok = c4 > 2000
    ns_per_clock = float(np.median(dt[ok] / c4[ok])) if ok.any() else 1 / 1.98
    res = np.unique(np.diff(np.unique(allr[:, 0].astype(np.int64))))
    step = res[res > 0].min() if (res > 0).any() else 0
    print(f"{len(rec)} records, {len(ls)} launches of {args.reps} forwards of {args.n} position(s), "
          f"{n_layers} layers; clock {1 / ns_per_clock:.3f} GHz; smallest %globaltimer step {step} ns")
    rows, prev, outs = [], None, {}
    for i, L in enumerate(ls):
        s = summarize(L, prev if i % per_fwd else None, ns_per_clock, outs)
        prev = s["end"]
        rows.append(s)
    by = defaultdict(list)
    for s in rows:
        by[s["kind"]].append(s)
    cols = ("ctas", "start", "wait", "prep", "loop", "tail", "span", "end_spread", "gap")
    print(f"\n{'launch kind':50} {'n':>4} " + " ".join(f"{c:>10}" for c in cols))
    table = []
    for kind, ss in by.items():
        med = {c: float(np.median([s[c] for s in ss])) for c in cols}
        table.append({"kind": kind, "launches": len(ss), **med})
        print(f"{kind:50} {len(ss):4d} " + " ".join(f"{med[c]:10.2f}" for c in cols))
    fwd_spans = []  # each forward's first traced entry -> last traced exit
    for f in range(args.reps):
        fl = ls[f * per_fwd:(f + 1) * per_fwd]
        fwd_spans.append((max(int(L["rows"][:, 1].max()) for L in fl) - int(fl[0]["rows"][:, 0].min())) * 1e-3)
    print(f"\nforward (bench_forward) median {np.median(secs) * 1e6:.1f} us; traced launches first entry -> "
          f"last exit median {np.median(fwd_spans):.1f} us; per layer {np.median(fwd_spans) / n_layers:.2f} us")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"model": args.model, "pos0": args.pos0, "n": args.n, "n_ctx": n_ctx, "reps": args.reps,
                       "forward_us": [x * 1e6 for x in secs], "traced_span_us": fwd_spans, "kinds": table},
                      fh, indent=1)


if __name__ == "__main__":
    main()
