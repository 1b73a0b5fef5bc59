"""Adaptive speculation (SpeculationGovernor) against speculating on every step and against
plain decoding, through the Generator a worker uses (batch 1, greedy).

Target: the demo model (SmolLM2-135M-Instruct). Drafters: prompt lookup (n-gram) and a
Q4_0 copy of the target (derived once, cached under <demo dir>/derived/ as
bench_speculative.py does), k = --k. Prompts: bench_speculative.py's chat, code and
repetitive-edit prompts. For each (prompt, drafter) the three runs take turns, --repeats
times (the load of a shared machine drifts): plain (no drafter), always (adaptive=False) and
adaptive (the default); each reports the engine's decode rate (Stats.decode_tok_s: the time
of the step() calls) and whether its tokens equal plain greedy decoding's (they must).
The governor cannot beat the better of the other two; what it is for is never being much
slower than plain where speculation loses, while keeping most of the gain where it wins.

Writes bench/results/governor_<device>_<date>.json and a PNG (rates relative to plain).

    python bench/bench_governor.py [--device cpu] [--threads 2] [--gen 128] [--repeats 3] [--k 4]
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

from bench_speculative import PROMPTS  # (the same prompts; bench/ is the working directory)
from machine import cpu_name  # bench/machine.py

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

MODES = ("plain", "always", "adaptive")


def run(gen, ids: list[int], n: int, k: int) -> dict:
    from worker.protocol import SamplingParams

    r = gen.complete(ids, max_tokens=n, params=SamplingParams(temperature=0.0), draft_k=k)
    return {"tok_s": r.decode_tok_s, "tokens": r.tokens, "tau": r.acceptance_length, "drafted": r.drafted,
            "accepted": r.accepted}


def plot(rows: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    labels = [f"{r['prompt']}\n{r['drafter']}" for r in rows]
    x = np.arange(len(rows))
    fig, ax = plt.subplots(figsize=(max(6, 1.4 * len(rows)), 4.2))
    for i, (mode, color) in enumerate((("always", "#999999"), ("adaptive", "#22aa77"))):
        vals = [r[mode]["tok_s"] / r["plain"]["tok_s"] for r in rows]
        bars = ax.bar(x + (i - 0.5) * 0.38, vals, 0.38, label=f"{mode} / plain", color=color)
        for b, v in zip(bars, vals):
            ax.text(b.get_x() + b.get_width() / 2, v, f"{v:.2f}", ha="center", va="bottom", fontsize=8)
    ax.axhline(1.0, color="red", lw=0.8, ls="--")
    ax.set_xticks(x, labels, fontsize=8)
    ax.set_ylabel("decode tok/s relative to plain")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--gen", type=int, default=128, help="greedy tokens per run")
    ap.add_argument("--repeats", type=int, default=3, help="turns of the three runs (median reported)")
    ap.add_argument("--k", type=int, default=4, help="tokens drafted per step")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    args = ap.parse_args()

    from worker.derive import derive_gguf
    from worker.generate import NGRAM, Generator
    from worker.models import pull_demo

    start = time.monotonic()
    demo = pull_demo(progress=True)
    q4 = demo.parent / "derived" / "SmolLM2-135M-Instruct.Q4_0.gguf"
    if not q4.exists():
        q4.parent.mkdir(parents=True, exist_ok=True)
        derive_gguf(demo, q4, progress=True, weight_type="Q4_0")
    common = {"n_threads": args.threads, "device": args.device, "n_ctx": 2048}
    plain_gen = Generator(demo, **common)
    drafters = {"ngram": Generator(demo, draft=NGRAM, draft_k=args.k, **common),
                "Q4_0 draft": Generator(demo, draft=str(q4), draft_k=args.k, **common)}
    rows = []
    print(f"{'prompt':6} {'drafter':11} | {'plain':>7} {'always':>7} {'adaptive':>8} | "
          f"{'always/plain':>12} {'adaptive/plain':>14} | tau always / adaptive, drafted", flush=True)
    for pname, text in PROMPTS.items():
        ids = plain_gen.prompt_ids(text, chat=True)
        for dname, gen in drafters.items():
            runs: dict[str, list[dict]] = {m: [] for m in MODES}
            for _ in range(args.repeats):
                runs["plain"].append(run(plain_gen, ids, args.gen, args.k))
                gen.adaptive = False
                runs["always"].append(run(gen, ids, args.gen, args.k))
                gen.adaptive = True
                runs["adaptive"].append(run(gen, ids, args.gen, args.k))
            ref = runs["plain"][0]["tokens"]
            row = {"prompt": pname, "drafter": dname, "k": args.k, "n_prompt": len(ids)}
            for m in MODES:
                rs = runs[m]
                row[m] = {"tok_s": statistics.median(r["tok_s"] for r in rs), "samples_tok_s": [r["tok_s"] for r in rs],
                          "identical": all(r["tokens"] == ref for r in rs), "tau": rs[0]["tau"],
                          "drafted": rs[0]["drafted"], "accepted": rs[0]["accepted"]}
            rows.append(row)
            p, a, g = row["plain"]["tok_s"], row["always"]["tok_s"], row["adaptive"]["tok_s"]
            same = all(row[m]["identical"] for m in MODES)
            print(f"{pname:6} {dname:11} | {p:7.1f} {a:7.1f} {g:8.1f} | {a / p:12.2f} {g / p:14.2f} | "
                  f"{row['always']['tau']:.2f} / {row['adaptive']['tau']:.2f}, {row['always']['drafted']} / "
                  f"{row['adaptive']['drafted']}{'' if same else '  TOKENS DIFFER'}", flush=True)
    for g in (plain_gen, *drafters.values()):
        g.close()

    stamp = dt.datetime.now(dt.timezone.utc)
    report = {
        "benchmark": "speculation_governor",
        "date": stamp.isoformat(timespec="seconds"),
        "command": " ".join([Path(sys.executable).name] + sys.argv),
        "machine": {"cpu": cpu_name(), "cores": os.cpu_count(), "python": platform.python_version(),
                    "host": platform.node(), "device": args.device},
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "wall_s": time.monotonic() - start,
        "results": rows,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    base = args.out / f"governor_{args.device.replace(':', '')}_{stamp:%Y%m%d}"
    base.with_suffix(".json").write_text(json.dumps(report, indent=2) + "\n")
    try:
        plot(rows, base.with_suffix(".png"),
             f"speculation governor, demo model, k = {args.k}, {args.device} ({cpu_name()}), {stamp:%Y-%m-%d}")
    except Exception as exc:  # the numbers matter more than the picture
        print(f"plot failed: {type(exc).__name__}: {exc}", flush=True)
    print(f"wrote {base.with_suffix('.json')} and {base.with_suffix('.png')} ({time.monotonic() - start:.0f} s)")
    return 0 if all(r[m]["identical"] for r in rows for m in MODES) else 1


if __name__ == "__main__":
    sys.exit(main())
