"""Speculative decoding on the CPU: plain greedy vs each drafter and k (batch 1).

Target: the demo model (SmolLM2-135M Q4_1). Drafters: three copies derived from it (Q8_0,
Q4_0, the first 25 of 30 layers; cached under <demo dir>/derived/) and n-gram prompt
lookup; k in {1, 2, 4, 8, 16}. Prompts: chat, code, and a repetitive editing prompt (the
model must copy a code block with one rename). Per run: greedy decode tok/s over --gen
tokens (engine step time, the first token excluded as in bench_engine.py), tau (mean
tokens per speculative step), speedup over a plain run timed right before it (the load of
a shared machine drifts), and whether the tokens equal plain greedy (they must:
speculation is lossless).

Also the verify cost: the time of one target forward over k+1 positions (all logits, as a
verify step runs it) relative to one plain decode step, at the prompt's context length.
On a GPU that ratio stays near 1 for small k (decode is memory-bound), which is where
speculation pays; on a 2-core CPU a 135M model is already compute-bound at a few
positions, so it grows quickly and caps the speedup here.

Writes bench/results/speculative_cpu_<date>.json and a PNG of speedup vs k.

    python bench/bench_speculative.py [--threads 2] [--gen 96] [--repeats 1]
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

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

KS = (1, 2, 4, 8, 16)
EDIT_CODE = (
    "def total(items):\n    result = 0\n    for item in items:\n        result = result + item.price * item.count\n"
    "    return result\n\n\ndef average(items):\n    result = total(items)\n    return result / len(items)\n"
)
PROMPTS = {
    "chat": "Write a short story about a robot who learns to paint.",
    "code": "Write a Python function that returns the n-th Fibonacci number, with a docstring.",
    "edit": "Rewrite the following code with the variable result renamed to acc. Output only the code.\n"
            "```python\n" + EDIT_CODE + "```",
}



def decode(eng, ids: list[int], n_gen: int, mode: str, k: int) -> dict:
    """Greedy decode of n_gen tokens; the engine's own decode clock (step() time)."""
    with eng.new_sequence() as seq:
        seq.set_sampling({"temperature": 0.0})
        if mode != "none":
            seq.set_speculation(mode, k)
        seq.prefill(ids)
        tokens = seq.step()  # sampled from the prefill logits: no forward
        t0 = time.perf_counter()
        while len(tokens) < n_gen:
            tokens += seq.step()
        seconds = time.perf_counter() - t0
        st = seq.stats()
    # Tokens past n_gen from the last step are not counted (a server would drop them).
    return {"tok_s": (n_gen - 1) / seconds, "tokens": tokens[:n_gen], "tau": st["acceptance_length"],
            "drafted": st["drafted"], "accepted": st["accepted"],
            "draft_seconds": st["draft_seconds"], "verify_seconds": st["verify_seconds"]}


def verify_cost(eng, ids: list[int], reps: int) -> dict:
    """Median time of a target forward over n positions (all logits) at context len(ids),
    for n = 1 (a plain decode step, last logits only) and n = k + 1."""
    out = {}
    with eng.new_sequence() as seq:
        seq.prefill(ids)
        n0 = len(ids)
        for n in (1,) + tuple(k + 1 for k in KS):
            times = []
            for _ in range(reps):
                toks = ids[:n]
                t0 = time.perf_counter()
                seq.prefill(toks, all_logits=n > 1)
                times.append(time.perf_counter() - t0)
                seq.truncate(n0)
            out[n] = statistics.median(times)
    base = out[1]
    return {"decode_step_ms": base * 1e3,
            "ratio": {str(n - 1): out[n] / base for n in out if n > 1},
            "ms": {str(n - 1): out[n] * 1e3 for n in out if n > 1}}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--gen", type=int, default=96, help="greedy tokens per run")
    ap.add_argument("--repeats", type=int, default=1, help="runs per cell (median reported)")
    ap.add_argument("--verify-reps", type=int, default=9)
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    args = ap.parse_args()

    from worker.derive import derive_gguf
    from worker.engine import Engine, native
    from worker.generate import Generator
    from worker.model_file import open_model
    from worker.models import pull_demo

    demo = pull_demo(progress=True)
    derived = demo.parent / "derived"
    derived.mkdir(parents=True, exist_ok=True)
    draft_paths = {}
    for label, kw in (("Q8_0", {"weight_type": "Q8_0"}), ("Q4_0", {"weight_type": "Q4_0"}),
                      ("25 layers", {"n_layers": 25})):
        stem = "L25" if "n_layers" in kw else kw["weight_type"]
        path = derived / f"SmolLM2-135M-Instruct.{stem}.gguf"
        if not path.exists():
            derive_gguf(demo, path, progress=True, **kw)
        draft_paths[label] = path

    gen = Generator(demo, n_threads=args.threads)
    target = gen.model_file
    prompt_ids = {name: gen.prompt_ids(text, chat=True) for name, text in PROMPTS.items()}
    engines = {"plain": gen.engine, "ngram": gen.engine}
    for label, path in draft_paths.items():
        engines[label] = Engine(target, draft_model=open_model(path), n_threads=args.threads, n_ctx=2048)

    runs = []
    for pname, ids in prompt_ids.items():
        # Plain is cheap and every speedup of the prompt divides by it: measure it 3+ times.
        plain = [decode(gen.engine, ids, args.gen, "none", 0) for _ in range(max(3, args.repeats))]
        plain_tok_s = statistics.median(r["tok_s"] for r in plain)
        ref = plain[0]["tokens"]
        runs.append({"prompt": pname, "drafter": "plain", "k": 0, "tok_s": plain_tok_s, "tau": 1.0, "speedup": 1.0,
                     "identical": True})
        print(f"{pname:5} plain          {plain_tok_s:7.1f} tok/s", flush=True)
        for drafter in ("Q8_0", "Q4_0", "25 layers", "ngram"):
            mode = "ngram" if drafter == "ngram" else "draft"
            for k in KS:
                # On a shared machine the load drifts: each cell is timed right after a plain
                # run of its own, and its speedup is over that adjacent plain run.
                rs, base = [], []
                for _ in range(args.repeats):
                    base.append(decode(gen.engine, ids, args.gen, "none", 0)["tok_s"])
                    rs.append(decode(engines[drafter], ids, args.gen, mode, k))
                row = {"prompt": pname, "drafter": drafter, "k": k,
                       "tok_s": statistics.median(r["tok_s"] for r in rs),
                       "plain_tok_s": statistics.median(base),
                       "tau": rs[0]["tau"], "drafted": rs[0]["drafted"], "accepted": rs[0]["accepted"],
                       "draft_seconds": rs[0]["draft_seconds"], "verify_seconds": rs[0]["verify_seconds"],
                       "identical": all(r["tokens"] == ref for r in rs)}
                row["speedup"] = statistics.median(r["tok_s"] / b for r, b in zip(rs, base))
                runs.append(row)
                print(f"{pname:5} {drafter:9} k={k:<2}  {row['tok_s']:7.1f} tok/s  tau {row['tau']:5.2f}  "
                      f"speedup {row['speedup']:5.2f}x  {'identical' if row['identical'] else 'DIFFERENT'}",
                      flush=True)

    vc = verify_cost(gen.engine, prompt_ids["code"], args.verify_reps)
    print(f"\nverify cost at context {len(prompt_ids['code'])}: one decode step {vc['decode_step_ms']:.1f} ms")
    for k in KS:
        print(f"  k={k:<2} forward of {k + 1:2} positions: {vc['ms'][str(k)]:6.1f} ms = {vc['ratio'][str(k)]:5.2f}x")

    print(f"\n{'prompt':6} {'drafter':10}" + "".join(f"   k={k:<2} tok/s  tau  x" for k in KS))
    for pname in PROMPTS:
        for drafter in ("Q8_0", "Q4_0", "25 layers", "ngram"):
            cells = {r["k"]: r for r in runs if r["prompt"] == pname and r["drafter"] == drafter}
            print(f"{pname:6} {drafter:10}" + "".join(
                f"  {cells[k]['tok_s']:7.1f} {cells[k]['tau']:4.1f} {cells[k]['speedup']:4.2f}" for k in KS))

    stamp = dt.datetime.now(dt.timezone.utc)
    report = {
        "benchmark": "speculative_cpu",
        "date": stamp.isoformat(timespec="seconds"),
        "command": " ".join([Path(sys.executable).name] + sys.argv),
        "machine": {"cpu": cpu_name(), "cores": os.cpu_count(), "threads": args.threads,
                    "python": platform.python_version(), "simd": native.simd_path(),
                    "loadavg": os.getloadavg()},
        "target": str(demo), "drafts": {k: str(v) for k, v in draft_paths.items()},
        "gen_tokens": args.gen, "repeats": args.repeats,
        "prompt_tokens": {k: len(v) for k, v in prompt_ids.items()},
        "verify_cost": vc,
        "runs": runs,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    base = args.out / f"speculative_cpu_{stamp:%Y%m%d}"
    base.with_suffix(".json").write_text(json.dumps(report, indent=2) + "\n")
    plot(runs, vc, base.with_suffix(".png"), report)
    print(f"\nwrote {base.with_suffix('.json')} and {base.with_suffix('.png')}")
    for label, eng in engines.items():
        if label not in ("plain", "ngram"):
            eng.close()
    gen.close()
    return 0


def plot(runs: list[dict], vc: dict, path: Path, report: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(PROMPTS) + 1, figsize=(4 * (len(PROMPTS) + 1), 3.8))
    colors = {"Q8_0": "#2a7", "Q4_0": "#27c", "25 layers": "#c72", "ngram": "#a3a"}
    for ax, pname in zip(axes, PROMPTS):
        for drafter, color in colors.items():
            rows = sorted((r for r in runs if r["prompt"] == pname and r["drafter"] == drafter), key=lambda r: r["k"])
            ax.plot([r["k"] for r in rows], [r["speedup"] for r in rows], "o-", color=color, label=drafter)
        ax.axhline(1.0, color="#888", lw=0.8, ls="--")
        ax.set_xscale("log", base=2)
        ax.set_xticks(KS, [str(k) for k in KS])
        ax.set_xlabel("k (draft tokens per step)")
        ax.set_ylabel("speedup over plain greedy")
        ax.set_title(f"prompt: {pname}", fontsize=9)
    axes[0].legend(fontsize=8)
    ax = axes[-1]
    ax.plot(KS, [vc["ratio"][str(k)] for k in KS], "o-", color="#444", label="forward(k+1) / decode step")
    ax.plot(KS, [k + 1 for k in KS], ":", color="#aaa", label="k + 1 (no batching gain)")
    ax.set_xscale("log", base=2)
    ax.set_xticks(KS, [str(k) for k in KS])
    ax.set_xlabel("k")
    ax.set_ylabel("time relative to one decode step")
    ax.set_title("verify cost", fontsize=9)
    ax.legend(fontsize=8)
    fig.suptitle(f"specd speculative decoding, SmolLM2-135M Q4_1 target, CPU {report['machine']['cores']} cores "
                 f"({report['machine']['threads']} threads), {report['date'][:10]}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    raise SystemExit(main())
