"""Engine speed vs llama.cpp, side by side in one run (batch 1, CPU).

For each model (the demo SmolLM2-135M Q4_1 and a Q8_0 re-quantization of it) this measures
prefill tok/s over a fixed ~256-token prompt and greedy decode tok/s over a fixed number of
tokens, alternating specd and llama.cpp (llama-cpp-python, dev-only) for `--repeats` rounds
so that drift on a shared machine hits both alike; medians are reported, with the ratio.
Writes bench/results/engine_cpu_<date>.json and a PNG bar chart.

    pip install llama-cpp-python matplotlib   # built as in FACTS.md (no AMX)
    python bench/bench_engine.py [--threads 2] [--gen 128] [--repeats 3]
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

from machine import cpu_name  # bench/machine.py (scripts run from bench/)

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

PROMPT = (
    "The history of the printing press begins in the fifteenth century, when Johannes Gutenberg "
    "combined movable metal type, oil-based ink and a wooden press adapted from those used for wine. "
    "Books had been copied by hand for centuries, which made them rare and expensive; a single Bible "
    "could take a scribe more than a year. Within a few decades of Gutenberg's first prints, presses "
    "had spread to more than two hundred cities across Europe, and millions of volumes were in "
    "circulation. Scholars could now compare identical copies of a text, which changed how knowledge "
    "was checked and shared. Pamphlets carried political and religious arguments faster than any "
    "authority could suppress them, and vernacular languages gained standard spellings as printers "
    "chose one form for a whole region. Historians still debate how much of the scientific revolution "
    "depended on print, but few doubt that cheap, reliable copies of books mattered. In the centuries "
    "that followed, steam power, rotary presses and finally digital typesetting made printed matter "
    "cheaper still, until newspapers reached nearly every household. Today, the same questions about "
    "trust, speed and access return with every new way of sharing words, and"
)



def bench_specd(path: Path, prompt_ids: list[int], n_gen: int, threads: int) -> dict:
    from worker.engine import Engine
    from worker.model_file import open_model

    with Engine(open_model(path), n_ctx=1024, n_threads=threads) as eng:
        seq = eng.new_sequence()
        seq.set_sampling({"temperature": 0.0})
        t0 = time.perf_counter()
        seq.prefill(prompt_ids)
        t1 = time.perf_counter()
        tokens = [seq.step()[0]]  # sampled from the prefill logits: no forward
        t2 = time.perf_counter()
        while len(tokens) < n_gen:
            tokens += seq.step()
        t3 = time.perf_counter()
        seq.close()
    return {
        "prefill_tok_s": len(prompt_ids) / (t1 - t0),
        "decode_tok_s": (n_gen - 1) / (t3 - t2),
        "tokens": tokens,
    }


def _last_logits(llm) -> np.ndarray:
    """llama.cpp's logits of the last evaluated position (without logits_all, which would
    make its prefill compute the output head for every prompt position)."""
    import llama_cpp

    ptr = llama_cpp.llama_get_logits_ith(llm._ctx.ctx, -1)
    return np.ctypeslib.as_array(ptr, shape=(llm.n_vocab(),))


def bench_llamacpp(llm, prompt_ids: list[int], n_gen: int) -> dict:
    llm.reset()
    t0 = time.perf_counter()
    llm.eval(prompt_ids)
    t1 = time.perf_counter()
    tokens = [int(np.argmax(_last_logits(llm)))]
    t2 = time.perf_counter()
    while len(tokens) < n_gen:
        llm.eval([tokens[-1]])
        tokens.append(int(np.argmax(_last_logits(llm))))
    t3 = time.perf_counter()
    return {
        "prefill_tok_s": len(prompt_ids) / (t1 - t0),
        "decode_tok_s": (n_gen - 1) / (t3 - t2),
        "tokens": tokens,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--gen", type=int, default=128, help="greedy tokens to decode")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    args = ap.parse_args()

    import llama_cpp

    from worker.derive import derive_gguf
    from worker.models import pull_demo
    from worker.model_file import open_model
    from worker.tokenizer import Tokenizer

    demo = pull_demo(progress=True)
    q8 = demo.parent / "derived" / "SmolLM2-135M-Instruct.Q8_0.gguf"
    if not q8.exists():
        q8.parent.mkdir(parents=True, exist_ok=True)
        derive_gguf(demo, q8, weight_type="Q8_0", progress=True)
    models = {"SmolLM2-135M Q4_1 (demo)": demo, "SmolLM2-135M Q8_0": q8}

    tok = Tokenizer.from_metadata(open_model(demo).metadata)
    prompt_ids = tok.encode(PROMPT, add_special=True)
    results = []
    for label, path in models.items():
        llm = llama_cpp.Llama(model_path=str(path), n_ctx=1024, n_batch=512, n_threads=args.threads,
                              n_threads_batch=args.threads, verbose=False)
        runs = {"specd": [], "llama.cpp": []}
        for r in range(args.repeats):
            runs["specd"].append(bench_specd(path, prompt_ids, args.gen, args.threads))
            runs["llama.cpp"].append(bench_llamacpp(llm, prompt_ids, args.gen))
            print(f"  {label} round {r + 1}/{args.repeats}: "
                  f"specd decode {runs['specd'][-1]['decode_tok_s']:.1f} tok/s, "
                  f"llama.cpp {runs['llama.cpp'][-1]['decode_tok_s']:.1f} tok/s", flush=True)
        del llm
        row = {"model": label, "path": str(path), "prompt_tokens": len(prompt_ids), "gen_tokens": args.gen}
        for name, rs in runs.items():
            row[name] = {k: statistics.median(x[k] for x in rs) for k in ("prefill_tok_s", "decode_tok_s")}
            row[name]["all_decode_tok_s"] = [x["decode_tok_s"] for x in rs]
        s, l = runs["specd"][0]["tokens"], runs["llama.cpp"][0]["tokens"]
        row["greedy_tokens_equal_prefix"] = next((i for i, (a, b) in enumerate(zip(s, l)) if a != b), len(s))
        row["decode_ratio"] = row["specd"]["decode_tok_s"] / row["llama.cpp"]["decode_tok_s"]
        row["prefill_ratio"] = row["specd"]["prefill_tok_s"] / row["llama.cpp"]["prefill_tok_s"]
        results.append(row)

    print(f"\n{'model':28} {'engine':10} {'prefill tok/s':>14} {'decode tok/s':>13}")
    for row in results:
        for name in ("specd", "llama.cpp"):
            print(f"{row['model']:28} {name:10} {row[name]['prefill_tok_s']:14.1f} {row[name]['decode_tok_s']:13.1f}")
        print(f"{'':28} {'ratio':10} {row['prefill_ratio']:14.2f}x {row['decode_ratio']:12.2f}x"
              f"   (greedy tokens identical for the first {row['greedy_tokens_equal_prefix']})")

    from worker.engine import native

    stamp = dt.datetime.now(dt.timezone.utc)
    report = {
        "benchmark": "engine_cpu_vs_llamacpp",
        "date": stamp.isoformat(timespec="seconds"),
        "command": " ".join([Path(sys.executable).name] + sys.argv),
        "machine": {"cpu": cpu_name(), "cores": os.cpu_count(), "threads": args.threads,
                    "python": platform.python_version(), "simd": native.simd_path()},
        "peer": f"llama-cpp-python {llama_cpp.__version__}",
        "results": results,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    base = args.out / f"engine_cpu_{stamp:%Y%m%d}"
    base.with_suffix(".json").write_text(json.dumps(report, indent=2) + "\n")
    plot(results, base.with_suffix(".png"), report)
    print(f"\nwrote {base.with_suffix('.json')} and {base.with_suffix('.png')}")
    return 0


def plot(results: list[dict], path: Path, report: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, key, title in ((axes[0], "decode_tok_s", "decode (batch 1)"), (axes[1], "prefill_tok_s", "prefill")):
        x = np.arange(len(results))
        for i, (name, color) in enumerate((("specd", "#2a7"), ("llama.cpp", "#888"))):
            vals = [r[name][key] for r in results]
            bars = ax.bar(x + (i - 0.5) * 0.38, vals, 0.38, label=name, color=color)
            ax.bar_label(bars, fmt="%.0f", fontsize=8)
        ax.set_xticks(x, [r["model"] for r in results], fontsize=8)
        ax.set_ylabel("tokens / s")
        ax.set_title(title)
        ax.legend(loc="lower right", fontsize=8)
    fig.suptitle(f"specd vs llama.cpp, CPU {report['machine']['cores']} cores, {report['date'][:10]}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    raise SystemExit(main())
