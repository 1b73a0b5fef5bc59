"""Serving-stack latency and throughput: OpenAI client -> gateway -> Redis/RQ -> workers.

Starts the real stack (worker/launcher.py: a private Redis, --workers CPU workers, the
gateway), then sweeps client concurrency (1, 2, 4, ... 64) over a fixed set of greedy chat
prompts, streaming with the official AsyncOpenAI client, and reports per level:
  TTFT p50/p99 (request sent -> first content delta), TPOT p50 (time per output token
  after the first: (t_last - t_first) / (tokens - 1)), inter-token latency p50/p99 (gaps
  between content deltas) and throughput (completion tokens / wall time of the level).
Concurrency 1 is measured in pairs: each request goes through the stack and then, the
same request, in-process through worker.generate.Generator (same threads as a worker),
alternating, so drift on a shared machine hits both alike. The stack's overhead is
reported as stack minus engine of TTFT p50 and TPOT p50, and as the median of the paired
differences (goal: <= 5 ms TTFT and <= 0.5 ms per token).

Writes bench/results/stack_cpu_<date>.json and .png. CPU-bound: run it on a quiet machine.

    python bench/bench_stack.py [--workers 2] [--max-tokens 64] [--levels 1,2,4,8,16,32,64]

On GPUs (`--device cuda:0[,cuda:1...]`: `specd up --device`, a worker per GPU; the in-process
engine of the pairs runs on the first one, while the stack's worker on it waits) it measures
what the stack costs per token next to a GPU engine, which decodes a token in well under a
millisecond: results in stack_<kind>_<date>.json (kind: cuda or hip). On the GPU machine, with
no network, the stack's packages travel as wheels (tools/device/stack_wheels.sh) and the model
is a file (tools/gen_gguf.py writes chat templates too).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

from machine import cpu_name, gpu_info  # bench/machine.py (scripts run from bench/)

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

PROMPTS = [
    "What is the capital of France?",
    "Write a short poem about the sea.",
    "Explain what a hash table is.",
    "Give three tips for learning a new language.",
    "Describe how photosynthesis works.",
    "What are the benefits of regular exercise?",
    "Summarize the plot of Romeo and Juliet.",
    "How does a bicycle stay upright?",
]



def pct(values: list[float], q: float) -> float:
    """Percentile by linear interpolation (numpy's default), q in [0, 100]."""
    if not values:
        return float("nan")
    v = sorted(values)
    pos = (len(v) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (pos - lo)


def summarize(records: list[dict], wall_s: float) -> dict:
    """records: per request {ttft, tpot, itl: [...], tokens}; seconds in, ms out."""
    ttft = [r["ttft"] * 1e3 for r in records]
    tpot = [r["tpot"] * 1e3 for r in records if r["tpot"] is not None]
    itl = [g * 1e3 for r in records for g in r["itl"]]
    tokens = sum(r["tokens"] for r in records)
    return {
        "requests": len(records),
        "completion_tokens": tokens,
        "wall_s": wall_s,
        "ttft_ms_p50": pct(ttft, 50), "ttft_ms_p99": pct(ttft, 99),
        "tpot_ms_p50": pct(tpot, 50), "tpot_ms_mean": statistics.fmean(tpot) if tpot else float("nan"),
        "itl_ms_p50": pct(itl, 50), "itl_ms_p99": pct(itl, 99),
        "throughput_tok_s": tokens / wall_s if wall_s > 0 else 0.0,
    }


# ---- through the stack ----

async def one_stream(client, model: str, prompt: str, max_tokens: int) -> dict:
    t0 = time.perf_counter()
    stamps: list[float] = []
    usage = rid = None
    stream = await client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": prompt}], max_tokens=max_tokens,
        temperature=0, stream=True, stream_options={"include_usage": True})
    async for chunk in stream:
        rid = chunk.id
        if chunk.choices and chunk.choices[0].delta.content:
            stamps.append(time.perf_counter())
        if chunk.usage is not None:
            usage = chunk.usage
    n = usage.completion_tokens if usage is not None else len(stamps)
    return {
        "ttft": stamps[0] - t0,
        "tpot": (stamps[-1] - stamps[0]) / (n - 1) if n > 1 and len(stamps) > 1 else None,
        "itl": [b - a for a, b in zip(stamps, stamps[1:])],
        "tokens": n,
        "id": rid,
    }


def worker_times(log_path: Path, ids: set[str]) -> dict:
    """From the workers' per-request log lines (worker/jobs.py JobRunner.summary):
    queued_ms (gateway enqueue -> worker took the job) and ttft_ms (took -> first token
    written), p50 over `ids`: splits the stack's TTFT into queue, worker and delivery."""
    queued, ttft = [], []
    for line in log_path.read_text(errors="replace").splitlines():
        fields = dict(kv.split("=", 1) for kv in line.split() if "=" in kv)
        if fields.get("request") in ids:
            if "queued_ms" in fields:
                queued.append(float(fields["queued_ms"]))
            if "ttft_ms" in fields:
                ttft.append(float(fields["ttft_ms"]))
    return {"queued_ms_p50": pct(queued, 50), "worker_ttft_ms_p50": pct(ttft, 50), "n": len(ttft)}


async def run_level(base_url: str, model: str, concurrency: int, n_requests: int, max_tokens: int) -> dict:
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=base_url, api_key="bench", timeout=600, max_retries=0)
    todo = [PROMPTS[i % len(PROMPTS)] for i in range(n_requests)]
    records: list[dict] = []

    async def lane() -> None:
        while todo:
            records.append(await one_stream(client, model, todo.pop(), max_tokens))

    t0 = time.perf_counter()
    await asyncio.gather(*(lane() for _ in range(concurrency)))
    wall = time.perf_counter() - t0
    await client.close()
    return summarize(records, wall)


# ---- in-process ----

def engine_request(gen, prompt: str, max_tokens: int) -> dict:
    from worker.protocol import SamplingParams

    t0 = time.perf_counter()
    stamps: list[float] = []
    n = 0
    for d in gen.generate([{"role": "user", "content": prompt}], chat=True, max_tokens=max_tokens,
                          params=SamplingParams(temperature=0)):
        n += len(d.token_ids)
        if d.text:
            stamps.append(time.perf_counter())
    return {
        "ttft": stamps[0] - t0,
        "tpot": (stamps[-1] - stamps[0]) / (n - 1) if n > 1 and len(stamps) > 1 else None,
        "itl": [b - a for a, b in zip(stamps, stamps[1:])],
        "tokens": n,
    }


async def paired_c1(base_url: str, model: str, gen, n_requests: int, max_tokens: int
                    ) -> tuple[dict, dict, dict]:
    """Concurrency 1, alternating stack and in-process on the same prompt."""
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=base_url, api_key="bench", timeout=600, max_retries=0)
    stack, engine = [], []
    wall_stack = wall_engine = 0.0
    for i in range(n_requests):
        prompt = PROMPTS[i % len(PROMPTS)]
        t = time.perf_counter()
        stack.append(await one_stream(client, model, prompt, max_tokens))
        wall_stack += time.perf_counter() - t
        t = time.perf_counter()
        engine.append(engine_request(gen, prompt, max_tokens))
        wall_engine += time.perf_counter() - t
    await client.close()
    d_ttft = [(a["ttft"] - b["ttft"]) * 1e3 for a, b in zip(stack, engine)]
    d_tpot = [(a["tpot"] - b["tpot"]) * 1e3 for a, b in zip(stack, engine)
              if a["tpot"] is not None and b["tpot"] is not None]
    paired = {"ttft_ms_median_diff": pct(d_ttft, 50), "tpot_ms_median_diff": pct(d_tpot, 50),
              "same_token_counts": all(a["tokens"] == b["tokens"] for a, b in zip(stack, engine))}
    paired["ids"] = [r["id"] for r in stack]
    return summarize(stack, wall_stack), summarize(engine, wall_engine), paired


# ---- report ----

def table(rows: list[tuple[str, dict]]) -> str:
    head = (f"{'run':>12} {'reqs':>5} {'TTFT p50':>9} {'TTFT p99':>9} {'TPOT p50':>9} "
            f"{'ITL p50':>8} {'ITL p99':>8} {'tok/s':>8}")
    lines = [head, "-" * len(head)]
    for name, r in rows:
        lines.append(f"{name:>12} {r['requests']:>5} {r['ttft_ms_p50']:>7.1f}ms {r['ttft_ms_p99']:>7.1f}ms "
                     f"{r['tpot_ms_p50']:>7.2f}ms {r['itl_ms_p50']:>6.2f}ms {r['itl_ms_p99']:>6.2f}ms "
                     f"{r['throughput_tok_s']:>8.1f}")
    return "\n".join(lines)


def plot(path: Path, levels: list[int], stack: dict, engine: dict, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rs = [stack[str(c)] for c in levels]
    fig, ax = plt.subplots(1, 3, figsize=(15, 4.5))
    ax[0].plot(levels, [r["ttft_ms_p50"] for r in rs], "o-", label="stack p50")
    ax[0].plot(levels, [r["ttft_ms_p99"] for r in rs], "s--", label="stack p99")
    ax[0].axhline(engine["ttft_ms_p50"], color="gray", ls=":", label="in-process p50 (c=1)")
    ax[0].set(xscale="log", yscale="log", xlabel="concurrent streams", ylabel="ms", title="time to first token")
    ax[1].plot(levels, [r["itl_ms_p50"] for r in rs], "o-", label="ITL p50")
    ax[1].plot(levels, [r["itl_ms_p99"] for r in rs], "s--", label="ITL p99")
    ax[1].plot(levels, [r["tpot_ms_p50"] for r in rs], "^-", label="TPOT p50")
    ax[1].axhline(engine["tpot_ms_p50"], color="gray", ls=":", label="in-process TPOT p50 (c=1)")
    ax[1].set(xscale="log", xlabel="concurrent streams", ylabel="ms", title="per output token")
    ax[2].plot(levels, [r["throughput_tok_s"] for r in rs], "o-", label="stack")
    ax[2].axhline(engine["throughput_tok_s"], color="gray", ls=":", label="in-process (c=1)")
    ax[2].set(xscale="log", xlabel="concurrent streams", ylabel="completion tokens / s", title="throughput")
    for a in ax:
        a.set_xticks(levels, [str(c) for c in levels])
        a.grid(alpha=0.3)
        a.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    from worker.launcher import Stack, StackError, UpConfig, default_threads
    from worker.redis_local import free_port

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="demo")
    p.add_argument("--device", default="cpu", help="the workers' devices, as specd up --device (cpu, cuda:0,cuda:1, ...)")
    p.add_argument("--workers", type=int, default=None, help="CPU workers where --device lists cpu (default 2)")
    p.add_argument("--threads-per-worker", type=int, default=None, help="default: cores // workers")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--levels", default="1,2,4,8,16,32,64")
    p.add_argument("--min-requests", type=int, default=8, help="requests per level: max(this, concurrency)")
    p.add_argument("--pairs", type=int, default=16, help="stack/in-process request pairs at concurrency 1")
    p.add_argument("--redis-url", default=None, help="default: start a private redis-server")
    p.add_argument("--out", default=str(ROOT / "bench" / "results"))
    args = p.parse_args()
    levels = [int(x) for x in args.levels.split(",")]   # 1 is always measured (paired)
    load_before = os.getloadavg()
    device_list = tuple(d.strip() for d in args.device.split(","))
    if args.workers is None:
        args.workers = 2 if "cpu" in device_list else 1
    threads = args.threads_per_worker or default_threads(args.workers)

    env = {k: v for k, v in os.environ.items() if k not in ("SPECD_REDIS_URL", "REDIS_URL")}
    config = UpConfig(model=args.model, port=free_port(), workers=args.workers, redis_url=args.redis_url,
                      threads_per_worker=threads, prefix=f"bench-{os.getpid()}",
                      devices=device_list)
    try:
        config.validate()
    except StackError as exc:
        p.error(str(exc))
    devices = config.worker_devices()
    device = devices[0]  # the pairs' in-process engine
    kind = device.split(":")[0]
    import tempfile

    log_path = Path(tempfile.mkdtemp(prefix="specd-bench-")) / "stack.log"
    log_file = log_path.open("w")
    stack = Stack(config, env=env, log=log_file, progress=True)
    results: dict[str, dict] = {}
    engine = paired = None
    try:
        print(f"starting the stack: {stack.describe_workers()} ...", file=sys.stderr)
        stack.start()
        model = stack.served_models[0]
        base = f"{stack.url}/v1"
        asyncio.run(run_level(base, model, len(devices), len(devices) * 2, 8))  # warm every worker
        from worker.generate import Generator

        with Generator(args.model, n_threads=threads if kind == "cpu" else None, device=device) as gen:
            engine_request(gen, PROMPTS[0], 4)   # warm, as the workers are
            n1 = max(args.min_requests, args.pairs)
            print(f"concurrency 1: {n1} requests, stack and in-process alternating ...", file=sys.stderr)
            results["1"], engine, paired = asyncio.run(paired_c1(base, model, gen, n1, args.max_tokens))
        for c in levels:
            if c == 1:
                continue
            n = max(args.min_requests, c)
            print(f"concurrency {c}: {n} requests ...", file=sys.stderr)
            results[str(c)] = asyncio.run(run_level(base, model, c, n, args.max_tokens))
    finally:
        stack.stop()
        log_file.close()
    levels = sorted(int(c) for c in results)
    breakdown = worker_times(log_path, set(paired.pop("ids"))) if paired else None

    c1 = results.get("1")
    overhead = None
    if c1 is not None:
        overhead = {
            "ttft_ms_p50": c1["ttft_ms_p50"] - engine["ttft_ms_p50"],
            "tpot_ms_p50": c1["tpot_ms_p50"] - engine["tpot_ms_p50"],
            "paired": paired,
            "stack_ttft_breakdown_c1": breakdown,
            "goal_ttft_ms": 5.0,
            "goal_tpot_ms": 0.5,
        }
    rows = [(f"stack c={c}", results[str(c)]) for c in levels] + [("engine c=1", engine)]
    print(table(rows))
    if overhead:
        print(f"stack overhead at concurrency 1: TTFT p50 {overhead['ttft_ms_p50']:+.2f} ms (goal <= 5), "
              f"per token {overhead['tpot_ms_p50']:+.3f} ms (goal <= 0.5); median of paired differences: "
              f"TTFT {paired['ttft_ms_median_diff']:+.2f} ms, per token {paired['tpot_ms_median_diff']:+.3f} ms")
        if breakdown and breakdown["n"]:
            rest = c1["ttft_ms_p50"] - breakdown["queued_ms_p50"] - breakdown["worker_ttft_ms_p50"]
            print(f"stack TTFT p50 {c1['ttft_ms_p50']:.1f} ms ~ queued {breakdown['queued_ms_p50']:.1f} ms "
                  f"(gateway enqueue -> worker takes it) + worker {breakdown['worker_ttft_ms_p50']:.1f} ms "
                  f"(takes it -> first token written; in-process TTFT {engine['ttft_ms_p50']:.1f} ms) "
                  f"+ {rest:.1f} ms (HTTP, gateway, client)")

    date = dt.date.today().strftime("%Y%m%d")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    machine = {"cpu": cpu_name(), "cores": os.cpu_count(), "platform": platform.platform(),
               "python": platform.python_version(),
               "loadavg_1_5_15_before": load_before, "loadavg_1_5_15_after": os.getloadavg()}
    if kind != "cpu":
        machine["gpu"] = gpu_info()
    record = {
        "benchmark": f"stack_{kind}",
        "date": dt.datetime.now().isoformat(timespec="seconds"),
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "machine": machine,
        "config": {"model": args.model, "devices": devices, "workers": args.workers, "threads_per_worker": threads,
                   "max_tokens": args.max_tokens, "levels": levels, "prompts": PROMPTS,
                   "sampling": "greedy (temperature 0)", "client": "openai.AsyncOpenAI, stream=True"},
        "stack": results,
        "engine_in_process_c1": engine,
        "overhead_c1": overhead,
    }
    name = f"stack_{kind}_{date}"
    (out / f"{name}.json").write_text(json.dumps(record, indent=2) + "\n")
    where = f"{cpu_name()} ({os.cpu_count()} cores)" if kind == "cpu" else machine["gpu"].get("name", kind)
    title = (f"specd stack, {Path(args.model).name}, {stack.describe_workers()}, max_tokens {args.max_tokens}, "
             f"{where}, {date}")
    plot(out / f"{name}.png", levels, results, engine, title)
    print(f"wrote {out / f'{name}.json'} and .png", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
