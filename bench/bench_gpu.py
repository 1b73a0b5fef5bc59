"""GPU speed of specd's engine on realistic model shapes, side by side with llama.cpp (batch 1).

For each model file (given, or generated on the spot by tools/gen_gguf.py with --generate),
specd's engine on the GPU measures, in a child process of its own (a crash or an out-of-memory
error is recorded and the next model runs):
  - decode tok/s: greedy generation (a 64-token random prompt, then 128 `step()`s; with the
    engine's run-ahead, the GPU default of two forwards queued ahead, and alternately with one,
    decode_gen_ahead1, and none, decode_gen_no_ahead) and
    `bench_forward(1, 64)` (one forward of one position after 64, device-synchronised);
  - prefill tok/s: `bench_forward(n, 0, all_rows=False)` for n in 512, 4096;
  - verify cost: `bench_forward(k, 64)` / `bench_forward(1, 64)` for k in 2, 4, 8, 16, 17, 32
    (k positions, argmax of every row on the device: a speculative verify);
  - decode at depth (--depth, default 1000 and 4000 positions): greedy generation of
    --depth-gen tokens after a random prompt of that many tokens (the engine's default
    run-ahead), what llama-bench's `-d D -n N` times (its context filled with D tokens first);
  - memory (`engine.memory()`) and load time;
  - with --spec K,..: self-speculation (the file as its own draft model: every draft accepted),
    greedy tok/s and tau per k against plain steps of the same speculating engine.
Bandwidth floor: a decode step reads every weight once (all matrices and norms, and the
output head; a tied token_embd counted once, as the head; an untied one not at all: one row is
gathered), so decode tok/s <= the GPU's bandwidth / those bytes: its device-to-device copy bandwidth
measured at the start (bench/machine.py; 4.27e12 B/s on the H200), or --bandwidth B/s.

With --llama-bench PATH, llama-bench runs on the same files (`-p 16,512,4096 -n 128 -fa 1
-ngl 99 -o json`): pp512/pp4096 prefill, tg128 decode, and its verify cost = time(pp16) /
time(one tg step) = 16 * tg / pp16 (llama-bench's pp16 outputs one logits row, a verify 16:
the output head is read once either way); with --depth, a second run `-p 0 -n DEPTH_GEN -d
D,...` for decode at those depths. Ratios are specd / llama.cpp (> 1: specd faster; for verify
cost < 1 is better).

With --variant NAME:VAR=VALUE[,VAR=VALUE] (repeatable), specd runs once more per model with
those environment settings, forwards and verify widths only (with --variant-prefill also the
prefill lengths; e.g. nopdl:SPECD_GPU_PDL=0, tc:SPECD_GPU_TC=f16, notc:SPECD_GPU_TC=0), and a
second table compares them to the default run.

Writes OUT/gpu_<machine>_<date>.json (machine, command, every sample) and a PNG.

    python bench/bench_gpu.py MODEL.gguf ... [--llama-bench build/bin/llama-bench] [--out DIR]
    python bench/bench_gpu.py --generate qwen3-0.6b:F16,Q4_K_M --scratch /tmp/m --device cuda:0
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import mmap
import os
import platform
import re
import statistics
import struct
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

from machine import cpu_name, gpu_info, measured_bandwidth, slug  # bench/machine.py (scripts run from bench/)

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tools"))

H200_BANDWIDTH = 4.27e12  # B/s, the H200's device-to-device copy (FACTS.md): where none can be measured
PROMPT = 64          # prompt tokens before decoding; pos0 of the decode / verify forwards
ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")  # what --variant may set


# ---------------------------------------------------------------- model files


def gguf_summary(path: Path, bandwidth: float = H200_BANDWIDTH) -> dict:
    """Reads a GGUF header fast (no tokenizer parsing): scalar metadata and each tensor's
    bytes; returns {name, arch, file_type, shape, type, tensor_bytes, bytes_per_token, ...}."""
    import gguf

    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
        if m[:4] != b"GGUF":
            raise ValueError(f"{path} is not a GGUF file")
        _, n_tensors, n_kv = struct.unpack_from("<IQQ", m, 4)
        pos = 24
        scalars = {1: "<b", 0: "<B", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}

        def string(p: int) -> tuple[str, int]:
            (n,) = struct.unpack_from("<Q", m, p)
            return m[p + 8:p + 8 + n].decode("utf-8", "replace"), p + 8 + n

        def skip_value(vtype: int, p: int) -> tuple[object, int]:
            if vtype == 8:
                return string(p)
            if vtype == 9:
                etype, count = struct.unpack_from("<IQ", m, p)
                p += 12
                if etype in scalars:
                    return None, p + count * struct.calcsize(scalars[etype])
                for _ in range(count):
                    _, p = skip_value(etype, p)
                return None, p
            fmt = scalars[vtype]
            return struct.unpack_from(fmt, m, p)[0], p + struct.calcsize(fmt)

        meta: dict[str, object] = {}
        for _ in range(n_kv):
            key, pos = string(pos)
            (vtype,) = struct.unpack_from("<I", m, pos)
            value, pos = skip_value(vtype, pos + 4)
            if value is not None:
                meta[key] = value
        tensors: dict[str, int] = {}
        for _ in range(n_tensors):
            name, pos = string(pos)
            (n_dims,) = struct.unpack_from("<I", m, pos)
            dims = struct.unpack_from(f"<{n_dims}Q", m, pos + 4)
            ttype, _ = struct.unpack_from("<IQ", m, pos + 4 + 8 * n_dims)
            pos += 4 + 8 * n_dims + 12
            block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(ttype)]
            tensors[name] = math.prod(dims) // block * size
    read = sum(b for n, b in tensors.items() if n != "token_embd.weight" or "output.weight" not in tensors)
    ftype = meta.get("general.file_type")
    try:
        ftype_name = gguf.LlamaFileType(int(ftype)).name.replace("MOSTLY_", "") if ftype is not None else "?"
    except ValueError:
        ftype_name = str(ftype)
    return {
        "name": meta.get("general.name", path.stem),
        "arch": meta.get("general.architecture"),
        "shape": meta.get("specd.random.shape", path.stem),
        "type": meta.get("specd.random.type", ftype_name),
        "file_bytes": path.stat().st_size,
        "tensor_bytes": sum(tensors.values()),
        "bytes_per_token": read,
        "floor_tok_s": bandwidth / read,
    }


def generate_models(specs: list[str], scratch: Path, layers: int | None) -> list[Path]:
    """--generate 'shape:TYPE,TYPE' entries -> files written into scratch (kept if present)."""
    import gen_gguf

    out = []
    for spec in specs:
        shape, _, types = spec.partition(":")
        for ftype in (types or "Q4_K_M").split(","):
            path = scratch / gen_gguf.default_filename(shape, ftype, layers)
            if not path.exists():
                t0 = time.perf_counter()
                gen_gguf.write_model(path, shape, ftype, layers=layers, progress=True)
                print(f"generated {path.name} ({path.stat().st_size / 1e9:.2f} GB) in "
                      f"{time.perf_counter() - t0:.0f} s", flush=True)
            out.append(path)
    return out


# ---------------------------------------------------------------- specd (child process)


def _bench_forward(eng, n: int, pos0: int, reps: int, all_rows: bool) -> tuple[list[float], str]:
    """Seconds per forward of n positions from pos0: the engine's bench_forward, else (an
    engine without it, e.g. an older CPU build) timed prefills on a scratch sequence."""
    why = "engine has no bench_forward"
    if hasattr(eng, "bench_forward"):
        try:
            try:
                return list(eng.bench_forward(n, pos0, reps, all_rows=all_rows)), "bench_forward"
            except TypeError:  # an API without all_rows
                return list(eng.bench_forward(n, pos0, reps)), "bench_forward"
        except (AttributeError, NotImplementedError) as exc:  # the native engine lacks it
            why = f"bench_forward failed: {type(exc).__name__}: {exc}"
    import numpy as np

    rng = np.random.default_rng(n)
    seq = eng.new_sequence()
    try:
        if pos0:
            seq.prefill(rng.integers(0, eng.n_vocab, pos0))
        out = []
        for _ in range(reps):
            toks = rng.integers(0, eng.n_vocab, n)
            t0 = time.perf_counter()
            seq.prefill(toks, all_logits=all_rows)
            out.append(time.perf_counter() - t0)
            seq.truncate(pos0)
        return out, f"emulated by prefill + truncate ({why})"
    finally:
        seq.close()


def measure_specd(path: Path, args: argparse.Namespace, res: dict) -> None:
    """Every specd number for one model file, into `res` (runs in the child process). A phase
    that fails is recorded in res["errors"] and the next one runs (a failed load ends it)."""
    import numpy as np

    from worker.engine import Engine
    from worker.model_file import open_model

    res.update(phases={}, errors={})
    n_ctx = max(max(args.prefill), PROMPT + max(args.verify) + 1, PROMPT + args.gen + 1,
                max(args.depth, default=0) + args.depth_gen + 1)
    n_ctx = -(-(n_ctx + 16) // 256) * 256
    t0 = time.perf_counter()
    mf = open_model(path)
    t1 = time.perf_counter()
    kwargs = {"n_ctx": n_ctx, "max_batch": args.max_batch}
    if args.device != "cpu":
        kwargs["device"] = args.device
    eng = Engine(mf, **kwargs)
    t2 = time.perf_counter()
    res.update(open_s=t1 - t0, engine_s=t2 - t1, n_ctx=n_ctx, max_batch=args.max_batch,
               device=getattr(eng, "device", args.device))
    print(f"  specd: opened in {t1 - t0:.1f} s, engine on {res['device']} in {t2 - t1:.1f} s", flush=True)

    def fwd(n: int, pos0: int, reps: int, all_rows: bool = True) -> dict:
        samples, method = _bench_forward(eng, n, pos0, reps, all_rows)
        res["forward_method"] = method
        med = statistics.median(samples)
        return {"n": n, "pos0": pos0, "all_rows": all_rows, "median_s": med, "min_s": min(samples),
                "tok_s": n / med, "samples_s": samples}

    def phase(name: str, fn) -> None:
        tp = time.perf_counter()
        try:
            fn()
        except Exception as exc:  # recorded; later phases still run
            traceback.print_exc()
            res["errors"][name] = f"{type(exc).__name__}: {exc}"
            print(f"  specd: {name} FAILED: {res['errors'][name][:300]}", flush=True)
        res["phases"][name + "_s"] = time.perf_counter() - tp

    def memory() -> None:
        res["memory"] = dict(eng.memory())

    def forward() -> None:
        fwd(1, PROMPT, 3)  # warm-up: first launches, lazy allocations
        fwd(max(args.verify), PROMPT, 2)
        res["decode_forward"] = fwd(1, PROMPT, args.reps_decode)
        res["verify"] = {}
        for k in args.verify:
            res["verify"][str(k)] = fwd(k, PROMPT, args.reps_verify)
        base = res["decode_forward"]["median_s"]
        res["verify_cost"] = {k: v["median_s"] / base for k, v in res["verify"].items()}
        print(f"  specd: forward(1) {1 / base:.1f} tok/s, verify cost k=16 "
              f"{res['verify_cost'].get('16', float('nan')):.2f}x", flush=True)

    def prefill(n: int) -> None:
        fwd(n, 0, 1, all_rows=False)  # warm-up at this size (scratch buffers)
        res.setdefault("prefill", {})[str(n)] = fwd(n, 0, args.reps_prefill, all_rows=False)
        print(f"  specd: prefill {n}: {res['prefill'][str(n)]['tok_s']:.0f} tok/s", flush=True)

    def greedy(rng, prompt_len: int, tokens: int) -> dict:
        """One greedy generation through Sequence: a random prompt of prompt_len tokens, then
        `tokens` tokens (the first sampled from the prefill's logits, so tokens - 1 forwards
        are timed): {"prompt_s", "decode_tok_s"}."""
        seq = eng.new_sequence()
        try:
            seq.set_sampling({"temperature": 0})
            prompt = rng.integers(0, eng.n_vocab, prompt_len)
            t_a = time.perf_counter()
            seq.prefill(prompt)
            t_b = time.perf_counter()
            seq.step()  # sampled from the prefill logits: no forward
            steps = 1
            t_c = time.perf_counter()
            while steps < tokens:
                seq.step()
                steps += 1
            t_d = time.perf_counter()
        finally:
            seq.close()
        return {"prompt_s": t_b - t_a, "decode_tok_s": (steps - 1) / (t_d - t_c)}

    def depth() -> None:
        """Decode deep in a context (--depth): greedy runs of --depth-gen tokens after a random
        prompt of D tokens (positions D .. D + depth_gen - 1, as llama-bench's `-d D -n N`), with
        the engine's default run-ahead; the median of --gen-repeats runs after one warm-up."""
        rng = np.random.default_rng(2)
        out = res.setdefault("decode_depth", {})
        for d in args.depth:
            greedy(rng, d, 8)  # warm-up at this depth
            runs = [greedy(rng, d, args.depth_gen) for _ in range(args.gen_repeats)]
            out[str(d)] = {"prompt": d, "tokens": args.depth_gen, "runs": runs,
                           "tok_s": statistics.median(x["decode_tok_s"] for x in runs)}
            print(f"  specd: decode at depth {d}: {out[str(d)]['tok_s']:.1f} tok/s", flush=True)

    def generate() -> None:
        """The serving path: greedy steps through Sequence, a host round trip per token; with
        the engine's run-ahead (the default on a GPU: each step queues the returned token's
        forward and the one after it), as "decode_gen_ahead1" with one forward queued ahead and
        as "decode_gen_no_ahead" without (the same engine, runs alternating)."""
        rng = np.random.default_rng(0)
        default = getattr(eng, "run_ahead", None)
        modes = ([("decode_gen", default)] + ([("decode_gen_ahead1", 1)] if default and default > 1 else [])
                 + ([("decode_gen_no_ahead", 0)] if default else []))
        runs: dict[str, list] = {key: [] for key, _ in modes}
        for r in range(args.gen_repeats + 1):  # the first run warms up
            for key, ahead in modes:
                if ahead is not None:
                    eng.run_ahead = ahead
                run = greedy(rng, PROMPT, args.gen if r else 16)
                if r:
                    runs[key].append(run)
        if default is not None:
            eng.run_ahead = default
        for key, ahead in modes:
            res[key] = {"tokens": args.gen, "prompt": PROMPT, "run_ahead": ahead, "runs": runs[key],
                        "tok_s": statistics.median(x["decode_tok_s"] for x in runs[key])}
        plain = res.get("decode_gen_no_ahead", {}).get("tok_s")
        one = res.get("decode_gen_ahead1", {}).get("tok_s")
        print(f"  specd: greedy decode {res['decode_gen']['tok_s']:.1f} tok/s"
              + (f" (one forward ahead {one:.1f})" if one else "")
              + (f" (without run-ahead {plain:.1f})" if plain else ""), flush=True)

    def speculate() -> None:
        """Self-speculation (--spec): the same file loaded again as the draft model, so every
        draft is accepted (up to the target's tensor-core numerics on F16): the most a draft
        of this cost can give. Greedy through Sequence in an engine that speculates (its target
        reads F16 on tensor cores, its draft on the CUDA cores), plain steps (k = 0) and each
        k: tok/s and tau (tokens per target forward)."""
        rng = np.random.default_rng(1)
        out: dict = {}
        with Engine(mf, draft_model=open_model(path), **kwargs) as se:
            for k in [0, *args.spec]:
                runs = []
                for r in range(args.gen_repeats + 1):  # the first run warms up
                    seq = se.new_sequence()
                    seq.set_sampling({"temperature": 0})
                    if k:
                        seq.set_speculation("draft", k)
                    seq.prefill(rng.integers(0, se.n_vocab, PROMPT))
                    seq.step()  # from the prefill logits: no forward
                    made = 0
                    t0 = time.perf_counter()
                    while made < (args.gen if r else 16):
                        made += len(seq.step())
                    dt = time.perf_counter() - t0
                    st = seq.stats()
                    seq.close()
                    if r:
                        runs.append({"tokens": made, "tok_s": made / dt,
                                     "tau": st["spec_tokens"] / st["spec_steps"] if st["spec_steps"] else 1.0,
                                     **{key: st[key] for key in ("decode_seconds", "draft_seconds", "verify_seconds",
                                                                 "spec_steps", "n_steps")}})
                out[str(k)] = {"runs": runs, "tok_s": statistics.median(x["tok_s"] for x in runs),
                               "tau": statistics.median(x["tau"] for x in runs)}
                print(f"  specd: self-speculation k={k}: {out[str(k)]['tok_s']:.1f} tok/s, "
                      f"tau {out[str(k)]['tau']:.2f}", flush=True)
        res["self_speculation"] = out

    if hasattr(eng, "memory"):
        phase("memory", memory)
    phase("forward", forward)
    if args.forward_only and not args.variant_prefill:
        eng.close()
        return
    for n in args.prefill:
        phase(f"prefill_{n}", lambda n=n: prefill(n))
    if not args.forward_only:
        phase("generate", generate)
        if args.depth:
            phase("depth", depth)
    eng.close()
    if args.spec and not args.forward_only:
        phase("speculate", speculate)


def child_main(args: argparse.Namespace) -> int:
    res: dict = {}
    try:
        measure_specd(Path(args.child), args, res)
        out = {"ok": not res.get("errors"), **res}
        if res.get("errors"):
            out["error"] = "; ".join(f"{k}: {v}" for k, v in res["errors"].items())
    except Exception as exc:  # a failed load: recorded, the parent moves on to the next model
        traceback.print_exc()
        out = {**res, "ok": False, "error": f"{type(exc).__name__}: {exc}"}
    Path(args.child_out).write_text(json.dumps(out))
    return 0


def run_specd(path: Path, args: argparse.Namespace, timeout: float, variant: dict | None = None) -> dict:
    """measure_specd in a child process; a crash, timeout or error comes back as ok=False.
    variant: environment settings of an extra run (--variant), which measures forwards only."""
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        out = Path(f.name)
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", str(path), "--child-out", str(out),
           *sys.argv[1:]]
    env = None
    if variant is not None:
        cmd.append("--forward-only")
        env = {**os.environ, **variant}
    try:
        proc = subprocess.run(cmd, timeout=timeout, env=env)
        text = out.read_text() if out.exists() else ""
        if text:
            return json.loads(text)
        return {"ok": False, "error": f"child exited with status {proc.returncode} and no result (crash?)"}
    except subprocess.TimeoutExpired:
        return {"ok": False, "error": f"timed out after {timeout:.0f} s"}
    finally:
        out.unlink(missing_ok=True)


# ---------------------------------------------------------------- llama.cpp


def llama_rate(row: dict) -> float:
    """tok/s of one llama-bench test: the median of its repetitions, as specd's numbers are
    (llama-bench's avg_ts is their mean, and its first repetition of a prompt size can be far
    slower: pp512 25k against 67-70k tok/s on the 0.6B F16, H200, 2026-12-01)."""
    samples = row.get("samples_ts") or []
    return statistics.median(samples) if samples else row["avg_ts"]


def _llama_rows(cmd: list[str], timeout: float) -> list[dict] | str:
    """Runs llama-bench (-o json): its rows, or the reason it gave none."""
    print("  llama.cpp: " + " ".join(cmd), flush=True)
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=max(timeout, 1))
    except subprocess.TimeoutExpired:
        return f"timed out after {timeout:.0f} s"
    if proc.returncode != 0:
        return f"exit {proc.returncode}: {proc.stderr[-2000:]}"
    try:
        return json.loads(proc.stdout)
    except json.JSONDecodeError as exc:
        return f"unparsable JSON ({exc}): {proc.stdout[:500]}"


def run_llama_bench(exe: str, path: Path, args: argparse.Namespace, timeout: float) -> dict:
    """llama-bench's pp16 / pp<prefill> / tg<gen> on one file; tok/s by test, verify cost; with
    --depth, tg<depth_gen> at each depth from a second run (a failure there is recorded in
    depth_error, the first run's numbers stand)."""
    end = time.monotonic() + timeout
    prompts = sorted({16, *args.prefill})
    cmd = [exe, "-m", str(path), "-p", ",".join(map(str, prompts)), "-n", str(args.gen), "-fa", "1",
           "-ngl", "99", "-r", str(args.llama_reps), "-o", "json"]
    rows = _llama_rows(cmd, timeout)
    if isinstance(rows, str):
        return {"ok": False, "error": rows, "command": cmd}
    res: dict = {"ok": True, "command": cmd, "prefill": {}, "raw": rows}
    if getattr(args, "depth", None):
        dcmd = [exe, "-m", str(path), "-p", "0", "-n", str(args.depth_gen), "-d", ",".join(map(str, args.depth)),
                "-fa", "1", "-ngl", "99", "-r", str(args.llama_reps), "-o", "json"]
        drows = _llama_rows(dcmd, end - time.monotonic())
        res["depth_command"] = dcmd
        if isinstance(drows, str):
            res["depth_error"] = drows
        else:
            res["raw_depth"] = drows
            res["decode_depth"] = {str(r["n_depth"]): {"tok_s": llama_rate(r), "mean_tok_s": r["avg_ts"],
                                                       "samples_tok_s": r.get("samples_ts"), "tokens": r["n_gen"],
                                                       "prompt": r["n_depth"]}
                                   for r in drows if r.get("n_gen", 0) > 0 and r.get("n_prompt", 0) == 0}
    for r in rows:
        rate = {"tok_s": llama_rate(r), "mean_tok_s": r["avg_ts"], "samples_tok_s": r.get("samples_ts")}
        if r["n_gen"] == 0 and r["n_prompt"] > 0:
            res["prefill"][str(r["n_prompt"])] = rate
        elif r["n_prompt"] == 0 and r["n_gen"] > 0:
            res["decode"] = {**rate, "n_gen": r["n_gen"]}
        res.setdefault("build", f"{r.get('build_commit')} ({r.get('build_number')})")
        res.setdefault("gpu_info", r.get("gpu_info"))
        res.setdefault("backends", r.get("backends"))
    if "decode" in res and "16" in res["prefill"]:
        res["verify_cost_16"] = 16 * res["decode"]["tok_s"] / res["prefill"]["16"]["tok_s"]
    dec = res.get("decode", {}).get("tok_s")
    print(f"  llama.cpp: decode {dec or float('nan'):.1f} tok/s, "
          + ", ".join(f"pp{k} {v['tok_s']:.0f}" for k, v in res["prefill"].items())
          + "".join(f", depth {k} {v['tok_s']:.1f} tok/s" for k, v in res.get("decode_depth", {}).items()), flush=True)
    return res


# ---------------------------------------------------------------- machine, report


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a and b else None


def summarize(row: dict, prefill: list[int], depths: list[int] = ()) -> None:
    """Adds the headline numbers (None where a side failed) to a result row."""
    s, l, floor = row.get("specd", {}), row.get("llama", {}), row["floor_tok_s"]
    h = {
        "decode_gen_tok_s": s.get("decode_gen", {}).get("tok_s"),
        "decode_gen_ahead1_tok_s": s.get("decode_gen_ahead1", {}).get("tok_s"),
        "decode_gen_no_ahead_tok_s": s.get("decode_gen_no_ahead", {}).get("tok_s"),
        "decode_fwd_tok_s": s.get("decode_forward", {}).get("tok_s"),
        "llama_decode_tok_s": l.get("decode", {}).get("tok_s"),
        "verify_cost_16": s.get("verify_cost", {}).get("16"),
        "llama_verify_cost_16": l.get("verify_cost_16"),
    }
    for n in map(str, prefill):
        h[f"prefill_{n}_tok_s"] = s.get("prefill", {}).get(n, {}).get("tok_s")
        h[f"llama_prefill_{n}_tok_s"] = l.get("prefill", {}).get(n, {}).get("tok_s")
        h[f"prefill_{n}_ratio"] = ratio(h[f"prefill_{n}_tok_s"], h[f"llama_prefill_{n}_tok_s"])
    for k in ("decode_gen_tok_s", "decode_fwd_tok_s", "llama_decode_tok_s"):
        h[k.replace("tok_s", "pct_floor")] = 100 * h[k] / floor if h[k] else None
    h["decode_ratio"] = ratio(h["decode_gen_tok_s"], h["llama_decode_tok_s"])
    for d in map(str, depths):
        h[f"decode_depth_{d}_tok_s"] = s.get("decode_depth", {}).get(d, {}).get("tok_s")
        h[f"llama_decode_depth_{d}_tok_s"] = l.get("decode_depth", {}).get(d, {}).get("tok_s")
        h[f"decode_depth_{d}_ratio"] = ratio(h[f"decode_depth_{d}_tok_s"], h[f"llama_decode_depth_{d}_tok_s"])
    h["verify_cost_ratio"] = ratio(h["verify_cost_16"], h["llama_verify_cost_16"])
    row["headline"] = h


def print_table(rows: list[dict], prefill: list[int], depths: list[int] = ()) -> None:
    def f(x: float | None, fmt: str) -> str:
        width = int(fmt.split(".")[0])
        return format(x, fmt) if x is not None else "-".rjust(width)

    print(f"\n{'model':24} {'MB/tok':>7} {'floor':>6} | {'decode':>7} {'%fl':>4} {'fwd1':>7} | {'llama':>7} {'%fl':>4} "
          f"{'ratio':>5} " + "".join(f"| {'pp' + str(n):>7} {'ratio':>5} " for n in prefill)
          + f"| {'ver16':>5} {'llama':>5}")
    for r in rows:
        h = r.get("headline", {})
        print(f"{r['label'][:24]:24} {r['bytes_per_token'] / 1e6:7.0f} {r['floor_tok_s']:6.0f} | "
              f"{f(h.get('decode_gen_tok_s'), '7.1f')} {f(h.get('decode_gen_pct_floor'), '4.0f')} "
              f"{f(h.get('decode_fwd_tok_s'), '7.1f')} | {f(h.get('llama_decode_tok_s'), '7.1f')} "
              f"{f(h.get('llama_decode_pct_floor'), '4.0f')} {f(h.get('decode_ratio'), '5.2f')} "
              + "".join(f"| {f(h.get(f'prefill_{n}_tok_s'), '7.0f')} {f(h.get(f'prefill_{n}_ratio'), '5.2f')} "
                        for n in prefill)
              + f"| {f(h.get('verify_cost_16'), '5.2f')} {f(h.get('llama_verify_cost_16'), '5.2f')}")
        for side in ("specd", "llama"):
            if r.get(side) and not r[side].get("ok", True):
                print(f"{'':24}   {side} failed: {r[side]['error'][:150]}")
        if "error" in r:
            print(f"{'':24}   unreadable: {r['error'][:150]}")
    if any(r.get("variants") for r in rows):
        print(f"\n{'model':24} {'variant':12} | {'fwd1':>7} {'x base':>6} | verify cost k=" + ",".join(
            str(k) for k in sorted({int(k) for r in rows for v in [r.get("specd", {})] for k in v.get("verify_cost", {})})))
        for r in rows:
            base = r.get("specd", {}).get("decode_forward", {}).get("tok_s")
            for name, v in [("(default)", r.get("specd", {})), *r.get("variants", {}).items()]:
                tok = v.get("decode_forward", {}).get("tok_s")
                costs = " ".join(f"{c:5.2f}" for _, c in sorted((int(k), c) for k, c in v.get("verify_cost", {}).items()))
                pp = "".join(f" | pp{k} {f(p.get('tok_s'), '7.0f')}" for k, p in v.get("prefill", {}).items())
                print(f"{r['label'][:24]:24} {name[:12]:12} | {f(tok, '7.1f')} {f(ratio(tok, base), '6.2f')} | "
                      + (costs + pp if v.get("ok", True) else "failed: " + str(v.get("error"))[:80]))
    if depths:
        print(f"\n{'decode vs context':24} " + "".join(f"| {'d=' + str(d):>8} {'llama':>7} {'ratio':>5} " for d in depths))
        for r in rows:
            h = r.get("headline", {})
            print(f"{r['label'][:24]:24} " + "".join(
                f"| {f(h.get(f'decode_depth_{d}_tok_s'), '8.1f')} {f(h.get(f'llama_decode_depth_{d}_tok_s'), '7.1f')} "
                f"{f(h.get(f'decode_depth_{d}_ratio'), '5.2f')} " for d in depths))
            if r.get("llama", {}).get("depth_error"):
                print(f"{'':24}   llama.cpp at depth failed: {r['llama']['depth_error'][:150]}")
    print("decode: greedy steps (tok/s, % of the bandwidth floor); fwd1: bench_forward(1, 64); ratio: specd / "
          "llama.cpp; ppN: prefill tok/s; ver16: cost of a 16-position forward in decode steps"
          + ("; d=D: greedy tok/s after a D-token prompt (llama-bench -d D)" if depths else ""))


def plot(rows: list[dict], path: Path, report: dict, pp: int, depths: list[int] = ()) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, axes = plt.subplots(1, 4 if depths else 3, figsize=(21 if depths else 16, 4.8))
    x = np.arange(len(rows))
    labels = [r["label"] for r in rows]
    for ax, key, ylabel, title in (
        (axes[0], "pct_floor", "% of bandwidth floor",
         f"decode, batch 1 (% of the {report['bandwidth_B_s'] / 1e12:.2f} TB/s floor)"),
        (axes[1], "prefill", "tokens / s", f"prefill {pp} tokens"),
    ):
        pairs = ((("decode_gen_pct_floor", "specd"), ("llama_decode_pct_floor", "llama.cpp")) if key == "pct_floor"
                 else ((f"prefill_{pp}_tok_s", "specd"), (f"llama_prefill_{pp}_tok_s", "llama.cpp")))
        for i, ((k, name), color) in enumerate(zip(pairs, ("#2a7", "#888"))):
            vals = [r.get("headline", {}).get(k) or 0.0 for r in rows]
            bars = ax.bar(x + (i - 0.5) * 0.38, vals, 0.38, label=name, color=color)
            ax.bar_label(bars, fmt="%.0f", fontsize=7)
        if key == "pct_floor":
            ax.axhline(100, color="#c33", lw=0.8, ls="--")
        else:  # 0.6B and 8B models differ by ~10x
            ax.set_yscale("log")
        ax.set_xticks(x, labels, fontsize=7, rotation=30, ha="right")
        ax.set_ylabel(ylabel)
        ax.set_title(title, fontsize=10)
        ax.legend(fontsize=8)
    ax = axes[2]
    for r in rows:
        vc = r.get("specd", {}).get("verify_cost")
        if vc:
            ks = sorted(int(k) for k in vc)
            line, = ax.plot([1] + ks, [1.0] + [vc[str(k)] for k in ks], marker="o", ms=3, label=r["label"])
            lv = r.get("headline", {}).get("llama_verify_cost_16")
            if lv:
                ax.plot([16], [lv], marker="x", ms=8, color=line.get_color())
    ax.set_xlabel("positions per forward (k)")
    ax.set_ylabel("cost in decode steps")
    ax.set_title("verify cost (lines: specd; x: llama.cpp pp16)", fontsize=10)
    ax.legend(fontsize=6)
    if depths:  # decode against the context before it, % of the floor (the first point: a 64-token prompt)
        ax = axes[3]
        xs = [PROMPT, *depths]
        for r in rows:
            h, floor, color = r.get("headline", {}), r["floor_tok_s"], None
            for keys, style, who in ((["decode_gen_tok_s"] + [f"decode_depth_{d}_tok_s" for d in depths], "-o", "specd"),
                                     (["llama_decode_tok_s"] + [f"llama_decode_depth_{d}_tok_s" for d in depths], "--x",
                                      "llama.cpp")):
                pts = [(x, 100 * h[k] / floor) for x, k in zip(xs, keys) if h.get(k) and floor]
                if pts:
                    line, = ax.plot(*zip(*pts), style, ms=4, label=f"{r['label']} {who}",
                                    **({"color": color} if color else {}))
                    color = line.get_color()
        ax.set_xlabel("prompt tokens before the decoded ones")
        ax.set_ylabel("% of bandwidth floor")
        ax.set_title("decode vs context (solid: specd; dashed: llama.cpp -d)", fontsize=10)
        ax.legend(fontsize=6)
    gpu = report["machine"].get("gpu", {}).get("name", f"the CPU ({report['machine']['cpu']}, a dry run)")
    fig.suptitle(f"specd vs llama.cpp on {gpu}, {report['date'][:10]} (random-weight models)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


# ---------------------------------------------------------------- main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("models", nargs="*", type=Path, help="GGUF files")
    ap.add_argument("--generate", action="append", default=[], metavar="SHAPE:TYPE,TYPE",
                    help="generate random models with tools/gen_gguf.py (e.g. qwen3-0.6b:F16,Q4_K_M)")
    ap.add_argument("--layers", type=int, default=None, help="generated models: keep the first N blocks")
    ap.add_argument("--scratch", type=Path, default=Path(tempfile.gettempdir()) / "specd-models")
    ap.add_argument("--device", default="cuda:0", help="specd device (cpu: a dry run on the CPU engine)")
    ap.add_argument("--llama-bench", default=None, metavar="PATH", help="llama-bench executable")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    ap.add_argument("--bandwidth", type=float, default=None, metavar="B/S",
                    help="the bandwidth floors divide by (default: the GPU's copy bandwidth, measured)")
    ap.add_argument("--gen", type=int, default=128, help="greedy tokens to decode")
    ap.add_argument("--prefill", default="512,4096", help="prefill lengths (comma-separated)")
    ap.add_argument("--verify", default="2,4,8,16,17,32", help="verify widths k (comma-separated)")
    ap.add_argument("--depth", default="1000,4000",
                    help="decode after prompts of these lengths (comma-separated; empty: skipped)")
    ap.add_argument("--depth-gen", type=int, default=64, help="greedy tokens decoded at each --depth")
    ap.add_argument("--spec", default="", help="self-speculation draft lengths k (comma-separated; none: skipped)")
    ap.add_argument("--max-batch", type=int, default=512, help="specd positions per prefill chunk (llama.cpp ubatch)")
    ap.add_argument("--reps-decode", type=int, default=50)
    ap.add_argument("--reps-verify", type=int, default=20)
    ap.add_argument("--reps-prefill", type=int, default=5)
    ap.add_argument("--gen-repeats", type=int, default=3)
    ap.add_argument("--llama-reps", type=int, default=5)
    ap.add_argument("--model-timeout", type=float, default=300, help="seconds per model and side")
    ap.add_argument("--deadline", type=float, default=None, help="seconds for the whole run; later models skipped")
    ap.add_argument("--variant", action="append", default=[], metavar="NAME:VAR=VALUE[,VAR=VALUE]",
                    help="an extra specd run per model with these environment settings (forward and verify "
                         "only), e.g. nopdl:SPECD_GPU_PDL=0")
    ap.add_argument("--variant-prefill", action="store_true", help="variants also measure the prefill lengths")
    ap.add_argument("--forward-only", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--child-out", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    args.prefill = [int(x) for x in args.prefill.split(",") if x]
    args.verify = [int(x) for x in args.verify.split(",") if x]
    args.spec = [int(x) for x in args.spec.split(",") if x]
    args.depth = [int(x) for x in args.depth.split(",") if x]
    if any(d < 1 for d in args.depth) or args.depth_gen < 2:
        ap.error("--depth lengths must be >= 1 and --depth-gen >= 2 (one token comes from the prompt's logits)")
    variants = {}
    for v in args.variant:
        name, _, settings = v.partition(":")
        pairs = [kv.split("=", 1) for kv in settings.split(",") if kv]
        if not name or not pairs or any(len(kv) != 2 or not ENV_NAME.fullmatch(kv[0]) for kv in pairs):
            ap.error(f"--variant {v!r}: expected NAME:VAR=VALUE[,VAR=VALUE] (VAR an environment variable "
                     f"name; a VALUE holds no ',')")
        if name in variants:
            ap.error(f"--variant {v!r}: the name {name!r} is already taken (a second run would replace the first)")
        variants[name] = dict(pairs)
    args.variants = variants
    if not args.prefill or not args.verify:
        ap.error("--prefill and --verify need at least one length each (ver16 in the table needs 16)")
    return args


def resolve_bandwidth(args: argparse.Namespace) -> tuple[float, str]:
    """The B/s the floors divide by, and where it came from: --bandwidth, else the GPU's copy
    bandwidth measured now, else (a CPU dry run, or no PyTorch) the H200's."""
    if args.bandwidth:
        return args.bandwidth, "--bandwidth"
    if args.device.startswith("cpu"):
        return H200_BANDWIDTH, "the H200's copy bandwidth (a CPU dry run)"
    try:
        return measured_bandwidth(), "device-to-device copy measured at the start"
    except Exception as exc:  # the benchmark still runs; its floors say what they assumed
        return H200_BANDWIDTH, f"the H200's copy bandwidth (measuring failed: {type(exc).__name__}: {exc})"


def main() -> int:
    args = parse_args()
    if args.child:
        return child_main(args)
    start = time.monotonic()

    def left() -> float:
        return args.deadline - (time.monotonic() - start) if args.deadline else float("inf")

    models = list(args.models)
    if args.generate:
        args.scratch.mkdir(parents=True, exist_ok=True)
        models += generate_models(args.generate, args.scratch, args.layers)
    if not models:
        print("no models: give GGUF files or --generate SHAPE:TYPE", file=sys.stderr)
        return 2

    bandwidth, bandwidth_source = resolve_bandwidth(args)
    print(f"bandwidth floor: {bandwidth / 1e12:.2f} TB/s ({bandwidth_source})", flush=True)
    rows = []
    for i, path in enumerate(models, 1):
        row: dict = {"path": str(path), "label": path.name, "bytes_per_token": 0, "floor_tok_s": 0.0}
        try:
            row.update(gguf_summary(path, bandwidth))
            row["label"] = f"{row['shape']} {row['type']}"
        except Exception as exc:
            row["error"] = f"{type(exc).__name__}: {exc}"
            print(f"{path}: unreadable ({exc})", flush=True)
        rows.append(row)
    ok_rows = [r for r in rows if "error" not in r]
    # specd first for every model, then llama.cpp: with a deadline, specd's numbers matter most
    for side in ("specd", "llama") if args.llama_bench else ("specd",):
        for i, row in enumerate(ok_rows, 1):
            print(f"[{side} {i}/{len(ok_rows)}] {row['label']} ({row['file_bytes'] / 1e9:.2f} GB, "
                  f"{row['bytes_per_token'] / 1e6:.0f} MB read per token, floor {row['floor_tok_s']:.0f} tok/s; "
                  f"{time.monotonic() - start:.0f} s elapsed)", flush=True)
            budget = min(args.model_timeout, left() - 5)
            if budget < 20:
                row[side] = {"ok": False, "error": "skipped: out of time (--deadline)"}
                print(f"  {side}: skipped, out of time", flush=True)
                continue
            t0 = time.monotonic()
            path = Path(row["path"])
            row[side] = (run_specd(path, args, budget) if side == "specd"
                         else run_llama_bench(args.llama_bench, path, args, budget))
            row[side]["wall_s"] = time.monotonic() - t0
            if not row[side].get("ok"):
                print(f"  {side}: FAILED: {row[side]['error'][:300]}", flush=True)
            if side != "specd":
                continue
            for name, env in args.variants.items():
                budget = min(args.model_timeout, left() - 5)
                if budget < 20:
                    print(f"  variant {name}: skipped, out of time", flush=True)
                    continue
                print(f"  variant {name} ({', '.join(f'{k}={v}' for k, v in env.items())}):", flush=True)
                row.setdefault("variants", {})[name] = {"env": env, **run_specd(path, args, budget, env)}
    for row in ok_rows:
        summarize(row, args.prefill, args.depth)

    print_table(rows, args.prefill, args.depth)
    stamp = dt.datetime.now(dt.timezone.utc)
    gpu = gpu_info()
    report = {
        "benchmark": "gpu_engine_vs_llamacpp",
        "date": stamp.isoformat(timespec="seconds"),
        "command": " ".join([Path(sys.executable).name] + sys.argv),
        "machine": {"gpu": gpu, "cpu": cpu_name(), "cores": os.cpu_count(), "python": platform.python_version(),
                    "host": platform.node()},
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()
                     if k not in ("child", "child_out", "models")},
        "bandwidth_B_s": bandwidth,
        "bandwidth_source": bandwidth_source,
        "wall_s": time.monotonic() - start,
        "results": rows,
    }
    machine = slug(gpu.get("name", "")) if gpu.get("name") else f"cpu-{slug(cpu_name())[:24]}"
    args.out.mkdir(parents=True, exist_ok=True)
    base = args.out / f"gpu_{machine}_{stamp:%Y%m%d}"
    base.with_suffix(".json").write_text(json.dumps(report, indent=2) + "\n")
    try:
        plot([r for r in rows if "headline" in r], base.with_suffix(".png"), report, args.prefill[0], args.depth)
    except Exception as exc:  # the numbers matter more than the picture
        print(f"plot failed: {type(exc).__name__}: {exc}", flush=True)
    print(f"\nwrote {base.with_suffix('.json')} and {base.with_suffix('.png')} ({time.monotonic() - start:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
